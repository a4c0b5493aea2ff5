"""Data-parallel attention: dp engines in step, the routed experts spread over all of their ranks.

`LLM(dp=N)` (EngineConfig.dp) runs N engines, one per DP group: each schedules its own requests and holds
its own KV pages (its own Scheduler and PageAllocator, as any engine), with the attention side (the
projections, dense layers, LM head) whole in every group, or split over the group's tp ranks as today.
The MoE layers' routed experts are spread over all tp x dp ranks, and each layer's tokens reach their
experts and come back through an all-to-all (engine/moe.py's dispatch; gloo on CPU, NCCL on GPU). That
is the deployment DeepSeek's serving papers describe: attention data-parallel, experts expert-parallel.

The LLM object is DP group 0's engine and, through its DPFront, the front of the others: DPEngines
spawns groups 1..N-1 (each an LLM with its dp_rank, in its own process, leading its own TP ranks),
sends each request to one group
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
import time
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.multiprocessing as mp

from engine import dp_group
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.cache import OutOfPages
from engine.sequence import RequestOutput, SamplingParams, Sequence
from engine.tp import RankDied, stop_processes
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
    """DP group 0's handle on the engines of groups 1..dp-1 (spawned processes)."""

    def __init__(self, config: EngineConfig, rendezvous: str, engine: type):
        """config: the lead engine's; engine: its class (each group builds one of them with its dp_rank:
        engine/dp_group.py)."""
        ctx, dp, tp = mp.get_context("spawn"), config.dp, config.tp
        self.conns, self.procs = [], []
        self.stats: dict[int, dict] = {}  # rank -> its counters (_stats), as of its step or refresh
        self.events: dict[int, list] = {r: [] for r in range(1, dp)}  # their prefix caches' events, untaken
        self.kv_caches: dict[int, list[torch.Tensor]] = {}  # decode role: each group's, mapped here
        self.refetches: list[Refetch] = []  # decode role: their preempted sequences, untaken
        self.busy: dict[int, bool] = {}  # prefill role: rank -> it has work (its latest step or poll)
        for rank in range(1, dp):
            lead_end, engine_end = ctx.Pipe()
            # an engine that leads TP ranks starts processes: a daemon may not (close() stops it instead)
            proc = ctx.Process(
                target=dp_group.main,
                args=(rank, config, rendezvous, engine_end, ops.get_backend(), os.getpid(), engine),
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
            kv_caches = self._recv(rank, START_TIMEOUT_S)[1]
            if kv_caches is not None:
                self.kv_caches[rank] = kv_caches

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


class DPFront:
    """The front of the other DP groups' engines, over this engine's core (engine.LLM's `front`). With
    dp = 1 (engines None) every method is the core's own."""

    def __init__(self, core: EngineCore, engines: DPEngines | None, kv_caches: list[torch.Tensor]):
        """kv_caches: this group's (each TP rank's), what group_kv_caches(0) hands a decode messenger."""
        self.core, self.engines, self.kv_caches = core, engines, kv_caches
        # request -> (its group, its prompt and prompt ids) while another group's engine has it
        self._remote: dict[str, tuple[int, str | None, list[int]]] = {}

    def add_request(self, prompt, params=None, request_id=None, output_ids=None, after=None, dp_rank=None):
        """EngineCore.add_request; dp_rank: the DP group that takes it (None: the one with the fewest
        requests; a completion with `after` goes where that one is)."""
        dp = self.core.config.dp
        if dp_rank is not None and (
            isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp
        ):
            raise ValueError(f"dp_rank must be an integer in [0, {dp}), got {dp_rank!r}")
        if after is not None and after in self._remote:  # its first completion is on another group
            dp_rank = self._remote[after][0]
        self._check_free(request_id)
        return self.submit(self.core.prepare(prompt, params, request_id, output_ids, after), dp_rank, after)

    def make_sequence(self, prompt, params=None, request_id=None, output_ids=None) -> Sequence:
        """EngineCore.make_sequence, refusing a request_id another DP group's engine holds too."""
        self._check_free(request_id)
        return self.core.make_sequence(prompt, params, request_id, output_ids)

    def _check_free(self, request_id: str | None) -> None:
        if request_id is not None and request_id in self._remote:
            raise ValueError(f"request_id {request_id!r} is already in use (until it finishes)")

    def dp_rank_of(self, request_id: str) -> int:
        """The DP group whose engine holds a request in flight (0: this one)."""
        return self._remote[request_id][0] if request_id in self._remote else 0

    def submit(self, seq: Sequence, rank: int | None = None, after: str | None = None) -> str:
        """Queue a checked sequence on DP group rank's engine (None: where its `after` is, else the least
        busy group); its request_id."""
        if self.engines is None:
            return self.core.submit(seq)
        if seq.after is not None:
            rank, after = self.dp_rank_of(seq.after.request_id), seq.after.request_id
        elif rank is None:
            rank = self.least_busy_group()
        if rank == 0:
            return self.core.submit(seq)
        self.engines.add(rank, seq, after)
        self._remote[seq.request_id] = (rank, seq.prompt, seq.prompt_ids)
        return seq.request_id

    def start_group_messengers(self, transfer, agent: str, peers: dict[int, list], creds) -> list[list[str]]:
        """Prefill role: each other DP group's own messenger (engine/dp_group.py's _prefill_messenger), its
        agents named agent-dp<rank> (and -tp<t> for its other TP ranks), connected to peers[rank]
        ((decode worker, address) pairs). Returns the agents' names, a list per group. Group 0's messenger
        is the caller's (engine.disagg.prefill_messenger)."""
        names = []
        for rank in range(1, self.core.config.dp):
            name = f"{agent}-dp{rank}"
            names.append(self.engines.start_messenger(rank, transfer, name, peers[rank], creds))
        return names

    def poll_groups(self) -> bool:
        """Prefill role: every other DP group's messenger takes what arrived; whether any group has work
        (has_unfinished says so too from now on)."""
        return self.engines.poll() if self.engines is not None else False

    def least_busy_group(self) -> int:
        """The DP group whose engine holds the fewest requests (0 without DP)."""
        counts = [len(self.core.seqs)] + [0] * (self.core.config.dp - 1)
        for r, *_ in self._remote.values():
            counts[r] += 1
        return min(range(self.core.config.dp), key=lambda r: counts[r])

    def holds(self, request_id: str) -> bool:
        """Whether some DP group's engine has this request (running, waiting, or preempted)."""
        return request_id in self.core.seqs or request_id in self._remote

    def group_kv_caches(self, rank: int) -> list[torch.Tensor]:
        """DP group rank's KV caches (each of its TP ranks'), mapped into this process (decode role)."""
        return self.kv_caches if rank == 0 else self.engines.kv_caches[rank]

    def reserve_in(self, rank: int, request_id: str, prompt_ids: list[int], params, load_within_s: float):
        """engine.disagg.DecodeSide.reserve on DP group rank's engine (another process): its pages and the
        tokens they hold already; the request is that group's from now on."""
        pages, held = self.engines.call(rank, "reserve", request_id, prompt_ids, params, load_within_s)
        if request_id not in self._remote:  # a refetch is there already
            self._remote[request_id] = (rank, None, list(prompt_ids))
        return pages, held

    def take_refetches(self) -> list:
        """Decode role with preemption "refetch": sequences preempted since the last call, every DP
        group's (the others' as Refetch tuples). Each holds no pages; the caller fetches the KV of
        seq.all_ids[:-1] again (reserve with its request_id, then admit_prefilled) or aborts it."""
        own = self.core.scheduler.take_refetches()
        if self.engines is None:
            return own
        theirs, self.engines.refetches = self.engines.refetches, []
        return own + theirs

    def abort(self, request_id: str, error: str | None = None) -> None:
        if request_id in self._remote:
            self.engines.abort(self._remote[request_id][0], request_id, error)
            return
        self.core.abort(request_id, error)

    def has_unfinished(self) -> bool:
        theirs = self.engines is not None and any(self.engines.busy.values())
        return self.core.has_unfinished() or bool(self._remote) or theirs

    # ---- counters over every DP group (what a worker reports) -----------------------------------------

    def _theirs(self, key: str) -> list:
        return [s[key] for s in self.engines.stats.values()] if self.engines is not None else []

    @property
    def pages(self) -> tuple[int, int]:
        """(free, all) KV pages of every DP group's engine, now (asks the others)."""
        if self.engines is not None:
            self.engines.refresh()
        own = (self.core.allocator.num_free, self.core.allocator.num_pages)
        return tuple(sum(p) for p in zip(own, *self._theirs("pages"), strict=True))

    @property
    def queues(self) -> tuple[int, int]:
        """(running, waiting) sequences of every DP group's engine."""
        own = (len(self.core.scheduler.running), len(self.core.scheduler.waiting))
        return tuple(sum(q) for q in zip(own, *self._theirs("queues"), strict=True))

    @property
    def prefix_cache_stats(self) -> dict[str, int]:
        own = self.core.prefix_cache_stats
        return {k: v + sum(s[k] for s in self._theirs("prefix_cache_stats")) for k, v in own.items()}

    @property
    def preemption_stats(self) -> dict[str, int]:
        own = self.core.preemption_stats
        return {k: v + sum(s[k] for s in self._theirs("preemption_stats")) for k, v in own.items()}

    def load_grammar(self, spec, compiled_json: str) -> None:
        """engine.structured.Grammars.load in every DP group's engine (a request may go to any of them),
        so that none compiles a client's grammar on its step loop (ValueError if it does not load)."""
        self.core.grammars.load(spec, compiled_json)
        if self.engines is not None:
            self.engines.load_grammar(spec, compiled_json)

    @property
    def grammar_compiles(self) -> int:
        """Grammars compiled by the engines themselves (every DP group's; the others' as of their step)."""
        own = len(self.core._grammars.compile_s) if self.core._grammars is not None else 0
        return own + sum(self._theirs("grammar_compiles"))

    def record_cache_events(self) -> None:
        """From now on keep every DP group's prefix-cache events (engine.kv.cache's (stored?, name))."""
        self.core.allocator.record_events()
        if self.engines is not None:
            self.engines.record_events()

    def take_cache_events(self) -> list[list[tuple[bool, bytes]]]:
        """Each DP group's prefix-cache events since the last call, group 0 first (the others' as of their
        latest step; one list for one engine)."""
        out = [self.core.allocator.take_events()]
        if self.engines is not None:
            for rank, events in self.engines.events.items():
                out.append(events)
                self.engines.events[rank] = []
        return out

    def step(self) -> list[RequestOutput]:
        """Every DP group's engine steps (each its own batch, all in one set of collectives); the outputs
        of all of them."""
        if self.engines is None:
            return self.core.step()
        self.engines.begin_step()
        try:
            outs = self.core.step()
        finally:  # their answers are read even when this engine's step raised: the next step starts clean
            theirs = self.engines.end_step()
        for out in theirs:
            _, out.prompt, prompt_ids = self._remote[out.request_id]
            out.prompt_token_ids = list(prompt_ids)
            if out.finished:
                del self._remote[out.request_id]
            outs.append(out)
        return outs
