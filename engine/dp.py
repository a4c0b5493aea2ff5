"""Data-parallel attention: dp engines in step, the routed experts spread over all of their ranks.

`DPLLM(config)` (EngineConfig.dp = N > 1) runs N engines, one per DP group: each schedules its own
requests and holds its own KV pages (its own Scheduler and PageAllocator, as any engine), with the
attention side (the projections, dense layers, LM head) whole in every group, or split over the group's
tp ranks as today.
The MoE layers' routed experts are spread over all tp x dp ranks, and each layer's tokens reach their
experts and come back through an all-to-all (engine/moe.py's dispatch; gloo on CPU, NCCL on GPU). That
is the deployment DeepSeek's serving papers describe: attention data-parallel, experts expert-parallel.

DP is composed from outside the engine: a DPLLM is DP group 0's engine (an engine.LLM, which knows
nothing of the other groups) and, through the DPFront it is given (engine/front.py), the front of the
others: DPEngines starts groups 1..N-1 (each an LLM with its dp_rank, in its own process, leading its
own TP ranks: engine/dp_group.py), sends each request to one group
(add_request's dp_rank, else the one with the fewest requests) and steps all of them together. Every
step every engine schedules; the groups' first ranks then agree (engine.collectives.any_true) whether any has
a batch, and a group without one runs an idle forward pass that joins each MoE layer's all-to-all with
no tokens, so that every rank takes part in every collective. Requests travel to the other engines as
token ids and SamplingParams over a pipe between these processes (nothing from a socket).

In the decode role each group's KV is written by a prefill worker: each group's engine allocates its
KV in shared memory and hands the front a mapping of it when it is ready (as TP ranks hand theirs to
their lead), so the front's decode messenger registers each group's KV with an agent of its own (on
its own NIC: transfer.nics_per_rank) and drives each group's engine through engine.disagg.DecodeSide
(`call`: reserve, admit, fail, free, recompute, over the same pipe). In the prefill role each group
is a prefill peer of its own: its messenger, layer counter and agents run in its engine's process
(start_group_messengers), the front polls them between steps (poll_groups) and steps every group when
any has work.
A worker of DP groups behind the router: serving/router/policy.py's Groups picks each request's
group, which add_request's dp_rank (and a decode worker's messenger's group) takes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from dataclasses import replace
from typing import NamedTuple

import torch

from engine import dp_group
from engine.config import EngineConfig
from engine.decode_role import DecodeHandoff
from engine.front import DPFront
from engine.kv.cache import OutOfPages
from engine.llm import LLM, PrefillListener
from engine.sequence import RequestOutput, SamplingParams, Sequence
from engine.tp import RankDied, rank_context, stop_processes
from engine.weights import load_model
from pdkernels import ops

START_TIMEOUT_S = 300  # an engine loads its model and joins the process group within this
STEP_TIMEOUT_S = 600  # one step of another engine (its collectives time out at 120 s before this)


class EngineDied(RankDied):
    """Another DP group's engine has exited or stopped answering: this LLM cannot step again."""


class Refetch(NamedTuple):
    """A sequence another group's engine preempted (decode role, preemption "refetch"): what the caller
    needs to fetch its KV again (engine.LLM.take_refetches hands out Sequences with these names)."""

    request_id: str
    all_ids: list[int]
    params: SamplingParams


class DPEngines:
    """DP group 0's handle on the engines of groups 1..dp-1 (processes forked from the fork server)."""

    def __init__(self, config: EngineConfig, rendezvous: str):
        """config: the lead engine's (each group builds an LLM of it with its own dp_rank:
        engine/dp_group.py)."""
        ctx, dp, tp = rank_context(), config.dp, config.tp
        self.conns, self.procs = [], []
        self.stats: dict[int, dict] = {}  # rank -> its counters (_stats), as of its step or refresh
        self.events: dict[int, list] = {r: [] for r in range(1, dp)}  # their prefix caches' events, untaken
        self.kv_regions: dict[int, list[torch.Tensor]] = {}  # decode role: each group's, mapped here
        self.refetches: list[Refetch] = []  # decode role: their preempted sequences, untaken
        self.busy: dict[int, bool] = {}  # prefill role: rank -> it has work (its latest step or poll)
        for rank in range(1, dp):
            lead_end, engine_end = ctx.Pipe()
            # an engine that leads TP ranks starts processes: a daemon may not (close() stops it instead)
            proc = ctx.Process(
                target=dp_group.main,
                args=(rank, config, rendezvous, engine_end, ops.get_backend(), os.getpid()),
                daemon=tp == 1,
                name=f"dp-engine-{rank}",
            )
            proc.start()
            self.conns.append(lead_end)
            self.procs.append(proc)

    def _recv(self, rank: int, timeout_s: float):
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        give_up = time.monotonic() + timeout_s
        while not conn.poll(0.1):
            if not proc.is_alive():
                raise EngineDied(f"DP engine {rank} has exited (code {proc.exitcode})")
            if time.monotonic() > give_up:
                raise EngineDied(f"DP engine {rank} did not answer within {timeout_s:.0f} s")
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError) as e:
            raise EngineDied(f"DP engine {rank} is gone: {e!r}") from e
        if kind == "failed":
            raise EngineDied(f"DP engine {rank} failed:\n{payload}")
        return kind, payload

    @property
    def ranks(self) -> range:
        """The DP groups whose engines these are: 1..dp-1."""
        return range(1, len(self.conns) + 1)

    def await_ready(self) -> None:
        for rank in self.ranks:
            kv_regions = self._recv(rank, START_TIMEOUT_S)[1]
            if kv_regions is not None:
                self.kv_regions[rank] = kv_regions

    def call(self, rank: int, method: str, *args):
        """engine.disagg.DecodeSide's method on engine rank; raises what it raised there (OutOfPages, or a
        ValueError for a request it refused)."""
        self._send(rank, ("side", (method, args)))
        kind, payload = self._recv(rank, START_TIMEOUT_S)
        if kind == "refused":
            error, why = payload
            raise OutOfPages(why) if error == "OutOfPages" else ValueError(why)
        return payload

    def add(self, rank: int, seq: Sequence, after: str | None = None) -> None:
        """Queue seq (checked here by make_sequence) on engine rank, after: an earlier completion of its
        prompt there; ValueError if that engine refuses."""
        params = replace(seq.params, n=1)  # the family is fanned out here: each completion comes alone
        self._send(rank, ("add", (seq.prompt_ids, params, seq.request_id, seq.output_ids or None, after)))
        kind, why = self._recv(rank, START_TIMEOUT_S)
        if kind == "refused":
            raise ValueError(why)

    def abort(self, rank: int, request_id: str, error: str | None) -> None:
        self._send(rank, ("abort", (request_id, error)))

    def begin_step(self) -> None:
        for rank in self.ranks:
            self._send(rank, ("step", None))

    def end_step(self) -> list[RequestOutput]:
        """Every other engine's outputs of the step begin_step started (their counters kept in stats)."""
        outs = []
        for rank in self.ranks:
            theirs, self.stats[rank] = self._recv(rank, STEP_TIMEOUT_S)[1]
            self.events[rank] += self.stats[rank].pop("cache_events")
            self.refetches += [Refetch(*r) for r in self.stats[rank].pop("refetches")]
            self.busy[rank] = self.stats[rank].pop("busy")
            outs += theirs
        return outs

    def record_events(self) -> None:
        for rank in self.ranks:
            self._send(rank, ("record", None))

    def load_grammar(self, spec, compiled_json: str) -> None:
        for rank in self.ranks:
            self._send(rank, ("grammar", (spec, compiled_json)))

    def refresh(self) -> None:
        """Every other engine's counters now (pages and queues change between steps too: a messenger
        frees a transfer's pages, or the front's calls do)."""
        for rank, counters in self._ask_all("counters").items():
            self.stats.setdefault(rank, {}).update(counters)

    def start_messenger(self, rank: int, *args) -> list[str]:
        """Prefill role: engine rank builds its own messenger (args: engine/dp_group.py's
        _prefill_messenger's); its agents."""
        self._send(rank, ("prefill_messenger", args))
        return self._recv(rank, START_TIMEOUT_S)[1]

    def poll(self) -> bool:
        """Prefill role: every other engine polls its messenger (new requests, aborts, pages to free);
        whether any of them now has work to step."""
        self.busy.update(self._ask_all("poll"))
        return any(self.busy.values())

    def _ask_all(self, kind: str) -> dict:
        """Every other engine's answer to a message of this kind (sent to all first, then read)."""
        for rank in self.ranks:
            self._send(rank, (kind, None))
        return {rank: self._recv(rank, START_TIMEOUT_S)[1] for rank in self.ranks}

    def _send(self, rank: int, msg) -> None:
        proc = self.procs[rank - 1]
        if not proc.is_alive():
            raise EngineDied(f"DP engine {rank} has exited (code {proc.exitcode})")
        try:
            self.conns[rank - 1].send(msg)
        except (BrokenPipeError, OSError) as e:
            raise EngineDied(f"DP engine {rank} is gone: {e!r}") from e

    def close(self) -> None:
        stop_processes(self.conns, self.procs, 30)  # each stops its own TP ranks first
        self.procs, self.conns = [], []


def _close_groups(engines: DPEngines, folder: str) -> None:
    """Stop the other DP groups' engines (each its own TP ranks first) and remove the rendezvous directory
    (a DPLLM's finalizer: it holds no reference to the DPLLM)."""
    engines.close()
    shutil.rmtree(folder, ignore_errors=True)


class DPLLM(LLM):
    """dp engines in step (EngineConfig.dp > 1): DP group 0's engine, here, is this LLM; groups 1..dp-1's
    run in processes of their own (DPEngines), and the DPFront this one is given sends each request to
    one of them, steps them all together and sums their counters. Everything LLM offers works on the
    whole: add_request (with a dp_rank, or to the least busy group), step, generate, abort, the counters."""

    def __init__(
        self,
        config: EngineConfig | str = "tiny-random-deepseek",
        /,
        *,
        listener: PrefillListener | None = None,
        **overrides,
    ):
        config = EngineConfig.of(config, **overrides)
        if config.dp < 2:
            raise ValueError(f"DPLLM runs dp >= 2 DP groups, got dp={config.dp}: build an LLM for one engine")
        # the checks that need the model's shape (its experts against tp x dp), before any group starts
        config = replace(config, arch=load_model(config.model, weights=False).config)
        folder = tempfile.mkdtemp(prefix="pdk-dp-")  # private (mode 0700): the ranks' file store
        rendezvous = os.path.join(folder, "rendezvous")
        self.dp_engines = DPEngines(config, rendezvous)
        self._groups_finalizer = weakref.finalize(self, _close_groups, self.dp_engines, folder)
        try:
            super().__init__(config, listener=listener, rendezvous=rendezvous)  # joins every group's ranks
            self.dp_engines.await_ready()
        except BaseException:
            self._groups_finalizer()
            raise
        self.front = DPFront(self.core, self.kv_regions, self.dp_engines)
        self.handoff = DecodeHandoff(self.core, self.front.make_sequence)

    def close(self) -> None:
        """Stop the other DP groups' engines, then this one's TP ranks (also done when the DPLLM is
        garbage-collected or at exit)."""
        self._groups_finalizer()
        super().close()


def make_llm(config: EngineConfig | str, /, **overrides) -> LLM:
    """The engine a config describes: an LLM for one DP group, a DPLLM of config.dp groups (what a worker
    whose deployment sets dp builds)."""
    config = EngineConfig.of(config, **overrides)
    return DPLLM(config) if config.dp > 1 else LLM(config)
