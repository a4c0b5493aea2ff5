"""The decode role's side of the hand-off, as methods of engine.LLM (a mixin: LLM is its only user).

The decode messenger (engine/disagg.py's DecodeSide) drives these: reserve pages for a prefill worker's
KV, admit the request once every write has landed (or prefill it here instead), stop it while a transfer
may still touch its pages, release them after, and hand preempted sequences back to be fetched again.
"""

from __future__ import annotations

import torch

from engine.kv.cache import OutOfPages
from engine.sequence import SamplingParams, Sequence


class DecodeHandoff:
    """What LLM does in the decode role beyond its own steps (self is the LLM)."""

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
        would not cover the growth every admitted request is owed (SchedulerConfig.reserved_tokens)."""
        seq = self.scheduler.refetching.get(request_id) if request_id is not None else None
        if seq is None:
            if params is not None and params.n > 1:
                raise ValueError(f"n={params.n}: reserve takes one completion (add each, with after)")
            seq = self.make_sequence(prompt, params, request_id)
        hit = self.scheduler.lookup(seq)
        seq.admitted_at = seq.num_tokens  # what it is owed counts from now (a refetch's too)
        if not self.scheduler.has_room(seq, hit):
            raise OutOfPages(
                f"{seq.request_id}: {self.scheduler.need(seq) - len(hit)} pages to finish, "
                f"{self.allocator.num_free} free, {self.scheduler.debt()} owed to admitted requests"
            )
        self.scheduler.reserve(seq, hit)
        self.allocator.grow(seq.request_id, seq.num_tokens - 1)
        self.allocator.pin(seq.request_id)
        self.seqs[seq.request_id] = seq
        self.scheduler.load_reserved(seq, load_within_s)
        return seq

    def reserved_below(self, request_id: str) -> int:
        """Pages of a reserved request loading from below device memory (reserve's), 0 if none."""
        loading = self.scheduler.loading.get(request_id)
        return len(loading[1].plan) if loading is not None else 0

    def take_refetches(self) -> list[Sequence]:
        """Decode role with preemption "refetch": sequences preempted since the last call. Each holds no
        pages; the caller fetches the KV of seq.all_ids[:-1] again (reserve with its request_id, then
        admit_prefilled) or aborts it."""
        return self.scheduler.take_refetches()

    def admit_prefilled(self, request_id: str, context: torch.Tensor | None = None) -> None:
        """Decode role: every write has landed; the pages now belong to the running request. context: the
        hidden state of the last prefilled position, which the prefill worker wrote (the MTP head's first
        input)."""
        self.allocator.unpin(request_id)
        seq = self.seqs[request_id]
        if self.drafter is not None:
            self.drafter.begin(seq, context)
        self.scheduler.admit_prefilled(seq)

    def prefill_locally(self, request_id: str) -> None:
        """Decode role: compute a reserved request's prompt here instead (a short prompt under conditional
        disaggregation, or a failed transfer); it keeps whatever pages it holds, unpinned."""
        seq = self.seqs[request_id]
        self.allocator.unpin(request_id)
        if self.drafter is not None:
            self.drafter.begin(seq)  # it reads the hidden states this worker computes
        self.scheduler.recompute(seq)

    def stop(self, request_id: str, error: str | None = None) -> None:
        """End a request now (finish_reason 'abort', or 'error') but keep its pages until `release`: a
        transfer may still be reading or writing them."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.finished:
            return
        self.scheduler.remove(seq, free_pages=False)
        self._finish(seq, "error" if error else "abort", error)

    def set_aside(self, request_id: str, owner: str) -> None:
        """A stopped request's pages, which a transfer may still write, held under owner (a name no
        request uses: `release(owner)` frees them) so that request_id can be sent again meanwhile."""
        self.scheduler.reserved.pop(request_id, None)
        self.allocator.rename(request_id, owner)

    def release(self, request_id: str) -> None:
        """The request's KV is no longer moving (sent, or its transfer ended): unpin and free its pages."""
        self.scheduler.reserved.pop(request_id, None)  # its pages are owed nothing more
        self.allocator.unpin(request_id)
        self.allocator.free(request_id)
