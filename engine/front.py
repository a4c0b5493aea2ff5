"""The front of an engine's DP groups (engine.LLM's `front`): where each request goes, and the counters and
events summed over every group. One engine (dp = 1, no `engines`) is its own front: every call is its
core's. engine/dp.py's DPLLM gives it the other groups' engines (DPEngines, in other processes) and it
fans requests out to them, steps them with its own core and sums what they report.
"""

from __future__ import annotations

import torch

from engine.core import EngineCore
from engine.sequence import RequestOutput, Sequence


class DPFront:
    """The front of the other DP groups' engines, over this engine's core (engine.LLM's `front`). With
    dp = 1 (engines None) every method is the core's own."""

    def __init__(self, core: EngineCore, kv_regions: list[torch.Tensor], engines=None):
        """kv_regions: this group's (each TP rank's), what group_kv_regions(0) hands a decode messenger;
        engines: the other groups' (engine.dp.DPEngines), None for one engine."""
        self.core, self.engines, self.kv_regions = core, engines, kv_regions
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

    def group_kv_regions(self, rank: int) -> list[torch.Tensor]:
        """DP group rank's KV regions (each of its TP ranks' cache, or e4m3 pages and scales: LLM.kv_regions),
        mapped into this process (decode role)."""
        return self.kv_regions if rank == 0 else self.engines.kv_regions[rank]

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
