"""Tensor parallelism inside one worker: rank processes that mirror the lead's forward passes.

The lead process (rank 0, the LLM object) schedules, sends each step's inputs to ranks 1..N-1 over a
pipe, and runs its own shard; the ranks all-reduce over torch.distributed (gloo on CPU, NCCL on GPU;
PDKERNELS_TP_COLLECTIVES=gloo forces gloo, e.g. for two ranks on one GPU, which NCCL refuses).
Each rank allocates its KV cache in shared memory (on GPU: a CUDA VMM allocation whose file descriptor
the lead imports and maps, engine/vmm.py) and hands the lead a mapping of it, so the lead (and its
messenger, with a NIXL agent per rank over that rank's mapping: transfer/agents.py) can read and write
every rank's pages. Only the lead samples and owns the layer counter. Under data-parallel attention
(engine/dp.py) each DP group's engine leads its own TP ranks this way, and all tp x dp ranks share one
process group (the MoE layers' all-to-all).
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.forking import fork_context
from engine.kv.cache import allocate_kv_cache, scaled_region_bytes, scaled_views
from engine.model import BatchMeta, Model, Shard
from engine.weights import load_model
from pdkernels import ops

START_TIMEOUT_S = 300  # loading SmolLM2 takes seconds per rank; this bounds a rank that never comes up
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


@dataclass
class Groups:
    """The process groups a rank's collectives use beyond the default one (all tp x dp ranks)."""

    tp: object | None = None  # its DP group's TP ranks (None: the default group, when dp == 1)
    leads: object | None = None  # every DP group's first rank (dp > 1): whether any group has a batch


def init_rank(rank: int, config: EngineConfig, rendezvous: str) -> Groups:
    """TP rank `rank` of DP group config.dp_rank joins all tp x dp ranks through a file store in the lead's
    private directory (no listening socket); gloo's own connections stay on loopback unless
    GLOO_SOCKET_IFNAME names another interface. Every rank makes every group, in the same order."""
    device = config.device
    backend = os.environ.get("PDKERNELS_TP_COLLECTIVES") or ("nccl" if device.startswith("cuda") else "gloo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tp, dp = config.tp, config.dp
    dist.init_process_group(
        backend,
        init_method=f"file://{rendezvous}",
        rank=config.dp_rank * tp + rank,
        world_size=tp * dp,
        timeout=COLLECTIVE_TIMEOUT,
    )
    if dp == 1:
        return Groups()
    groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(dp)]
    # the step agreement is a tiny CPU tensor: gloo even beside NCCL
    leads = dist.new_group([g * tp for g in range(dp)], backend="gloo")
    return Groups(groups[config.dp_rank], leads)


def rank_context():
    """The context TP ranks and DP groups start in: forked from multiprocessing's fork server, which
    imported torch and the engine once (engine/forking.py; a spawned rank imported them itself, 4 s of
    CPU each on an AVX2 EPYC)."""
    return fork_context(["engine.tp", "engine.dp_group"])


def build_rank(config: EngineConfig, rank: int):
    """This rank's model shard, its KV cache, the region the cache lives in (the cache itself; an e4m3
    cache's pages and scales: engine.kv.cache.scaled_views), shared with the lead, and, on GPU, the VMM
    allocation of that region (else None)."""
    loaded = load_model(config.model)
    device = torch.device(config.device)
    shard = Shard.of(loaded.config, rank, config.tp, config.expert_parallel, config.dp, config.dp_rank)
    model = Model(
        loaded.config, loaded.weights, device, config.torch_dtype, shard, config.batch_invariant,
        config.cache.kv_layout,
    )  # fmt: skip
    arch, cache, heads = loaded.config, config.cache, shard.num_kv_heads
    if cache.fp8:  # the rank's region (pages and scales) is what the lead maps; the model reads its views
        nbytes, shape, dtype = scaled_region_bytes(arch, cache, heads), None, torch.uint8
    else:
        shape = allocate_kv_cache(arch, cache, heads, "meta", config.torch_dtype).shape
        nbytes, dtype = (
            shape.numel() * torch.empty((), dtype=config.torch_dtype).element_size(),
            config.torch_dtype,
        )
    if device.type == "cpu":
        region, alloc = torch.zeros(nbytes // dtype.itemsize, dtype=dtype).share_memory_(), None
    else:
        from engine.vmm import SharedAllocation

        alloc = SharedAllocation(nbytes, device.index or 0)
        region = alloc.tensor(tuple(shape) if shape else (nbytes,), dtype).zero_()
    if not cache.fp8:
        return model, region.view(shape), region.view(shape), alloc
    kv_cache, model.kv_scales = scaled_views(region, arch, cache, heads)
    model.kv_scales.fill_(1.0)
    return model, kv_cache, region, alloc


def _rank_main(rank: int, config: EngineConfig, rendezvous: str, conn, backend: str, lead: int) -> None:
    """Ranks 1..N-1: build the shard, hand the lead the KV cache, then mirror each step until told to stop."""
    try:
        torch.set_num_threads(1)
        ops.set_backend(backend)  # the lead's choice, not this process's environment
        model, kv_cache, region, alloc = build_rank(config, rank)
        # before the rendezvous, so the lead learns of load failures at once
        if alloc is None:
            conn.send(("ready", region))
        else:  # the lead maps this allocation: its size and layout, then its descriptor (SCM_RIGHTS)
            from multiprocessing.reduction import send_handle

            conn.send(("vmm", (alloc.nbytes, tuple(region.shape), str(region.dtype))))
            send_handle(conn, alloc.export_fd(), lead)
        model.tp_group = init_rank(rank, config, rendezvous).tp
        for msg in from_lead(conn, lead):
            with torch.inference_mode():
                if msg == "idle":  # data-parallel attention: this group has no tokens this step
                    model.idle()
                    continue
                input_ids, meta = _to(msg, kv_cache.device)
                model.forward(input_ids, meta, kv_cache)
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _to(msg, device: torch.device):
    """A step's inputs on this rank's device. They travel as numpy arrays, pickled as bytes: a tensor
    would go through torch.multiprocessing's shared-memory file per tensor (seven a step, the rank then
    starting each step milliseconds after the lead), and a CUDA tensor through CUDA IPC."""
    input_ids, meta = msg
    moved = {f: torch.from_numpy(getattr(meta, f)).to(device) for f in META_TENSORS}
    return torch.from_numpy(input_ids).to(device), replace(meta, **moved)


META_TENSORS = ("positions", "batch_indices", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")


def from_lead(conn, lead: int):
    """The lead's messages down conn, until it sends None or is gone: its end of the pipe closed, or the
    process `lead` no longer there (this process is the fork server's child, not the lead's)."""
    while True:
        if not conn.poll(1.0):
            if not _alive(lead):
                return
            continue
        try:
            msg = conn.recv()
        except EOFError:  # the lead's end closed: nobody will send another
            return
        if msg is None:
            return
        yield msg


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # there, under another user (a pid reused: the pipe's end tells the rest)
        return True
    return True


def stop_processes(conns, procs, within_s: float) -> None:
    """Tell each live process to stop (None down its pipe), wait within_s for each, kill what is left."""
    for conn, proc in zip(conns, procs, strict=True):
        if proc.is_alive():
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
    for proc in procs:
        proc.join(timeout=within_s)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


class RankDied(RuntimeError):
    """A TP rank process has exited: this engine cannot run another step."""


class TPGroup:
    """The lead's handle on ranks 1..N-1 (processes forked from the fork server): they load their shards,
    then join the process group (engine.llm.LLM calls init_rank for the lead, through `rendezvous`, a path
    in a private directory its owner removes)."""

    def __init__(self, config: EngineConfig, rendezvous: str):
        self.size, self.device = config.tp, torch.device(config.device)
        self._allocs = []  # the ranks' VMM allocations mapped here (GPU)
        ctx = rank_context()
        self.conns, self.procs = [], []
        for rank in range(1, self.size):
            lead_end, rank_end = ctx.Pipe()
            args = (rank, config, rendezvous, rank_end, ops.get_backend(), os.getpid())
            proc = ctx.Process(target=_rank_main, args=args, daemon=True)
            proc.start()
            self.conns.append(lead_end)
            self.procs.append(proc)
        self.regions = [self._await_ready(rank) for rank in range(1, self.size)]  # their KV caches' (llm.py)

    def _await_ready(self, rank: int) -> torch.Tensor:
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not conn.poll(0.2):
            if not proc.is_alive() or time.monotonic() > deadline:
                self.close()
                why = (
                    f"exited with code {proc.exitcode}"
                    if not proc.is_alive()
                    else f"took over {START_TIMEOUT_S} s"
                )
                raise RuntimeError(f"TP rank {rank} did not start: it {why}")
        kind, payload = conn.recv()
        if kind == "vmm":
            from multiprocessing.reduction import recv_handle

            from engine.vmm import SharedAllocation

            nbytes, shape, dtype = payload
            fd = recv_handle(conn)
            alloc = SharedAllocation(nbytes, self.device.index or 0, fd=fd)
            os.close(fd)
            self._allocs.append(alloc)
            return alloc.tensor(shape, getattr(torch, dtype.removeprefix("torch.")))
        if kind != "ready":
            self.close()
            raise RuntimeError(f"TP rank {rank} failed to start:\n{payload}")
        return payload

    def step(self, input_ids: torch.Tensor, meta: BatchMeta) -> None:
        """Send one forward pass to every rank (the lead then runs its own shard)."""
        meta = replace(meta, counter=None)  # only the lead counts layers
        meta = replace(meta, **{f: getattr(meta, f).cpu().numpy() for f in META_TENSORS})  # _to says why
        self._send((input_ids.cpu().numpy(), meta))

    def idle(self) -> None:
        """Data-parallel attention: this group has no tokens this step; its ranks join the all-to-alls."""
        self._send("idle")

    def _send(self, msg) -> None:
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True), start=1):
            if not proc.is_alive():
                raise RankDied(f"TP rank {rank} has exited (code {proc.exitcode})")
            conn.send(msg)

    def close(self) -> None:
        stop_processes(self.conns, self.procs, 10)
        self.procs, self.conns = [], []
        self.regions = []
        for alloc in self._allocs:
            alloc.close()
        self._allocs = []
