"""Continuous batching with chunked prefill, in the three roles disaggregation needs.

Each step takes the running sequences' decode tokens first, then prefill chunks (continuing ones, then
new ones) under a token budget: the Sarathi/vLLM mix of prefill and decode in one pass.
- colocated: a sequence computes all of its tokens and samples after the last one.
- prefill: a sequence computes every token it is given and never samples; then it is "prefilled",
  keeps its pages, and the listener (the messenger) takes over. Disaggregation hands it the prompt
  without its last token, which the decode worker runs as its first step.
- decode: like colocated, and also admits sequences whose prompt KV (all but the last token) is
  already in its pages; their first step runs the last prompt token and samples the first output.
Out of pages, a decode token preempts the newest unpinned sequence (its KV is recomputed later);
a new prefill waits.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_cache import PageAllocator
from engine.sequence import Sequence, Status


@dataclass
class Chunk:
    seq: Sequence
    start: int  # position of the first token computed in this step
    num_tokens: int
    samples: bool  # the chunk's last token yields the sequence's next token
    pages: list[int]  # the pages that hold positions [0, start + num_tokens)
    drafts: list[int] = field(default_factory=list)  # speculative tokens after its one decode token

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The ids this step computes: the sequence's own, then any drafts."""
        return self.seq.all_ids[self.start : self.end - len(self.drafts)] + self.drafts


@dataclass
class Batch:
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator):
        self.config, self.allocator = config, allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.propose = None  # speculative decoding: seq -> draft token ids for its next decode step

    @property
    def role(self) -> str:
        return self.config.role

    def target(self, seq: Sequence) -> int:
        """Tokens whose KV this worker computes for seq."""
        return len(seq.prompt_ids) if self.role == "prefill" else seq.num_tokens

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit_prefilled(self, seq: Sequence) -> None:
        """Decode role: seq's pages (owned in the allocator) hold the KV of all but its last prompt token."""
        seq.num_computed, seq.status = len(seq.prompt_ids) - 1, Status.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        batch, budget = Batch(), self.config.max_num_batched_tokens
        decoding = [s for s in self.running if self.target(s) - s.num_computed == 1]
        prefilling = [s for s in self.running if self.target(s) - s.num_computed > 1]
        for seq in decoding + prefilling:
            if budget == 0 or len(batch.chunks) == self.config.max_num_seqs:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(self.target(seq) - seq.num_computed, budget)
            decodes = self.target(seq) - seq.num_computed == 1
            drafts = self._drafts(seq, budget - n) if decodes else []
            if drafts and not self.allocator.can_grow(seq.request_id, seq.num_computed + 1 + len(drafts)):
                drafts = []  # no pages to spare for guesses
            if self._make_room(seq, seq.num_computed + n + len(drafts), batch):
                batch.chunks.append(self._chunk(seq, n, drafts))
                budget -= n + len(drafts)
        while self.waiting and budget > 0 and len(batch.chunks) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(self.target(seq) - seq.num_computed, budget)
            if not self.allocator.can_grow(seq.request_id, seq.num_computed + n):
                break  # wait for pages
            self.waiting.popleft()
            seq.status = Status.RUNNING
            seq.scheduled_time = seq.scheduled_time or time.perf_counter()
            self.running.append(seq)
            batch.chunks.append(self._chunk(seq, n))
            budget -= n
        return batch if batch.chunks else None

    def _drafts(self, seq: Sequence, room: int) -> list[int]:
        """Drafts for a decoding sequence: within the step's budget and what it may still generate."""
        if self.propose is None or room <= 0 or self.role == "prefill":
            return []
        left = seq.params.max_tokens - len(seq.output_ids) - 1  # the verify step adds one more itself
        return self.propose(seq)[: max(0, min(room, left))]

    def _chunk(self, seq: Sequence, n: int, drafts: list[int] | None = None) -> Chunk:
        drafts = drafts or []
        total = seq.num_computed + n + len(drafts)
        pages = self.allocator.grow(seq.request_id, total)
        samples = self.role != "prefill" and seq.num_computed + n == seq.num_tokens
        return Chunk(
            seq, seq.num_computed, n + len(drafts), samples, pages[: self.allocator.pages_for(total)], drafts
        )

    def _make_room(self, seq: Sequence, num_tokens: int, batch: Batch) -> bool:
        """Preempt the newest unscheduled, unpinned sequences until seq can grow; else preempt seq itself."""
        scheduled = {c.seq.request_id for c in batch.chunks}
        while not self.allocator.can_grow(seq.request_id, num_tokens):
            victims = [
                s
                for s in self.running
                if s is not seq
                and s.request_id not in scheduled
                and not self.allocator.is_pinned(s.request_id)
            ]
            if not victims:
                self.preempt(seq)
                return False
            self.preempt(victims[-1])
        return True

    def preempt(self, seq: Sequence) -> None:
        """Drop seq's KV; it goes back to the front of the queue and is recomputed (prompt + outputs)."""
        self.running.remove(seq)
        self.allocator.free(seq.request_id)
        seq.num_computed, seq.status = 0, Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def remove(self, seq: Sequence, free_pages: bool = True) -> None:
        """Take seq out of the queues (finished or aborted), returning its pages unless told otherwise."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if free_pages:
            self.allocator.unpin(seq.request_id)
            self.allocator.free(seq.request_id)
