"""The decode role's side of the hand-off (engine.LLM's `handoff`, over its EngineCore).

The decode messenger (engine/disagg.py's DecodeSide) drives these through the LLM: reserve pages for a
prefill worker's KV, admit the request once every write has landed (or prefill it here instead), set a
stopped request's pages aside while a transfer may still touch them, and release them after.
"""

from __future__ import annotations

import torch

from engine.core import EngineCore
from engine.kv.cache import OutOfPages
from engine.sequence import SamplingParams, Sequence


class DecodeHandoff:
    """What an engine does in the decode role beyond its own steps. make_sequence: the LLM's (its DP
    front's, which also refuses a request_id another DP group holds)."""

    def __init__(self, core: EngineCore, make_sequence):
        self.core, self.make_sequence = core, make_sequence

    def reserve(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        load_within_s: float = 0.0,
    ) -> Sequence:
        """Decode role: pin pages for the KV of all but the last prompt token, for a prefill worker. Its
        leading pages that the prefix cache holds are shared instead (seq.num_cached_tokens of them: no
        one needs to write those), and those found next below device memory may load from there
        (kv_tiers.decode_loads; with "cost", while expected to load within load_within_s: reserved_below
        says how many pages). A request_id that take_refetches handed out resumes that sequence instead
        (prompt and params are its own: pages for all its tokens but the last).

        Raises engine.kv.cache.OutOfPages (taking nothing) when the free pages, after this reservation,
        would not cover the growth every admitted request is owed (SchedulerConfig.reserved_tokens), and
        no client over its share gives way (engine/fair.py)."""
        seq = self.core.scheduler.refetched(request_id) if request_id is not None else None
        if seq is None:
            if params is not None and params.n > 1:
                raise ValueError(f"n={params.n}: reserve takes one completion (add each, with after)")
            seq = self.make_sequence(prompt, params, request_id)
        scheduler = self.core.scheduler
        hit = scheduler.lookup(seq)
        seq.admitted_at = seq.num_tokens  # what it is owed counts from now (a refetch's too)
        if not scheduler.has_room(seq, hit) and scheduler.give_way(seq):  # clients over their share
            hit = scheduler.lookup(seq)
        if not self.core.scheduler.has_room(seq, hit):
            raise OutOfPages(
                f"{seq.request_id}: {self.core.scheduler.need(seq) - len(hit)} pages to finish, "
                f"{self.core.allocator.num_free} free, {self.core.scheduler.debt()} owed to admitted requests"
            )
        self.core.scheduler.reserve(seq, hit)
        self.core.allocator.grow(seq.request_id, seq.num_tokens - 1)
        self.core.allocator.pin(seq.request_id)
        self.core.seqs[seq.request_id] = seq
        self.core.scheduler.load_reserved(seq, load_within_s)
        return seq

    def reserved_below(self, request_id: str) -> int:
        """Pages of a reserved request loading from below device memory (reserve's), 0 if none."""
        seq = self.core.seqs.get(request_id)
        return len(seq.load.plan) if seq is not None and seq.load is not None else 0

    def admit_prefilled(self, request_id: str, context: torch.Tensor | None = None) -> None:
        """Decode role: every write has landed; the pages now belong to the running request. context: the
        hidden state of the last prefilled position, which the prefill worker wrote (the MTP head's first
        input)."""
        self.core.allocator.unpin(request_id)
        seq = self.core.seqs[request_id]
        if self.core.drafter is not None:
            self.core.drafter.begin(seq, context)
        self.core.scheduler.admit_prefilled(seq)

    def prefill_locally(self, request_id: str) -> None:
        """Decode role: compute a reserved request's prompt here instead (a short prompt under conditional
        disaggregation, or a failed transfer); it keeps whatever pages it holds, unpinned."""
        seq = self.core.seqs[request_id]
        self.core.allocator.unpin(request_id)
        if self.core.drafter is not None:
            self.core.drafter.begin(seq)  # it reads the hidden states this worker computes
        self.core.scheduler.recompute(seq)

    def set_aside(self, request_id: str, owner: str) -> None:
        """A stopped request's pages, which a transfer may still write, held under owner (a name no
        request uses: `release(owner)` frees them) so that request_id can be sent again meanwhile."""
        self.core.scheduler.unreserve(request_id)
        self.core.allocator.rename(request_id, owner)

    def release(self, request_id: str) -> None:
        """The request's KV is no longer moving (sent, or its transfer ended): unpin and free its pages."""
        self.core.scheduler.unreserve(request_id)  # its pages are owed nothing more
        self.core.allocator.unpin(request_id)
        self.core.allocator.free(request_id)
