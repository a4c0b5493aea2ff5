"""Tensor parallelism inside one worker: rank processes that mirror the lead's forward passes.

The lead process (rank 0, the LLM object) schedules, sends each step's inputs to ranks 1..N-1 over a
pipe, and runs its own shard; the ranks all-reduce over torch.distributed (gloo on CPU, NCCL on GPU).
Each rank allocates its KV cache in shared memory and hands the lead a mapping of it, so the lead (and
its messenger) can read and write every rank's pages. Only the lead samples and owns the layer counter.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import traceback
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.kv_cache import allocate_kv_cache
from engine.model import BatchMeta, Model, Shard
from engine.weights import load_model
from pdkernels import ops

START_TIMEOUT_S = 300  # loading SmolLM2 takes seconds per rank; this bounds a rank that never comes up
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def init_rank(rank: int, size: int, rendezvous: str, device: str) -> None:
    """Join the group through a file store in the lead's private directory (no listening socket); gloo's
    own connections stay on loopback unless GLOO_SOCKET_IFNAME names another interface."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend, init_method=f"file://{rendezvous}", rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )


def build_rank(model_name: str, config: EngineConfig, rank: int) -> tuple[Model, torch.Tensor]:
    """This rank's model shard and KV cache (in shared memory on the CPU)."""
    loaded = load_model(model_name)
    device = torch.device(config.device)
    shard = Shard.of(loaded.config, rank, config.tp)
    model = Model(loaded.config, loaded.weights, device, config.torch_dtype, shard)
    kv_cache = allocate_kv_cache(loaded.config, config.cache, shard.num_kv_heads, device, config.torch_dtype)
    return model, kv_cache.share_memory_() if device.type == "cpu" else kv_cache


def _rank_main(
    rank: int, model_name: str, config: EngineConfig, rendezvous: str, conn, backend: str, lead: int
) -> None:
    """Ranks 1..N-1: build the shard, hand the lead the KV cache, then mirror each step until told to stop."""
    try:
        torch.set_num_threads(1)
        ops.set_backend(backend)  # the lead's choice, not this process's environment
        model, kv_cache = build_rank(model_name, config, rank)
        conn.send(("ready", kv_cache))  # before the rendezvous, so the lead learns of load failures at once
        init_rank(rank, config.tp, rendezvous, config.device)
        while True:
            if not conn.poll(1.0):
                if os.getppid() != lead:  # the lead died (reparented): nobody will send another step
                    return
                continue
            msg = conn.recv()
            if msg is None:
                return
            input_ids, meta = msg
            with torch.inference_mode():
                model.forward(input_ids, meta, kv_cache)
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankDied(RuntimeError):
    """A TP rank process has exited: this engine cannot run another step."""


class TPGroup:
    """The lead's handle on ranks 1..N-1 (spawned processes)."""

    def __init__(self, model_name: str, config: EngineConfig):
        self.size = config.tp
        self._dir = tempfile.mkdtemp(prefix="pdk-tp-")  # mode 0700
        rendezvous = os.path.join(self._dir, "rendezvous")
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(1, self.size):
            lead_end, rank_end = ctx.Pipe()
            args = (rank, model_name, config, rendezvous, rank_end, ops.get_backend(), os.getpid())
            proc = ctx.Process(target=_rank_main, args=args, daemon=True)
            proc.start()
            self.conns.append(lead_end)
            self.procs.append(proc)
        self.kv_caches = [self._await_ready(rank) for rank in range(1, self.size)]
        init_rank(0, self.size, rendezvous, config.device)

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
        if kind != "ready":
            self.close()
            raise RuntimeError(f"TP rank {rank} failed to start:\n{payload}")
        return payload

    def step(self, input_ids: torch.Tensor, meta: BatchMeta) -> None:
        """Send one forward pass to every rank (the lead then runs its own shard)."""
        msg = (input_ids, replace(meta, counter=None))  # only the lead counts layers
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True), start=1):
            if not proc.is_alive():
                raise RankDied(f"TP rank {rank} has exited (code {proc.exitcode})")
            conn.send(msg)

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.procs, self.conns = [], []
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._dir, ignore_errors=True)
