"""Continuous batching with chunked prefill, in the three roles disaggregation needs.

Each step takes the running sequences' decode tokens first, then prefill chunks (continuing ones, then
new ones) under a token budget: the Sarathi/vLLM mix of prefill and decode in one pass.
- colocated: a sequence computes all of its tokens and samples after the last one.
- prefill: a sequence computes every token it is given and never samples; then it is "prefilled",
  keeps its pages, and the listener (the messenger) takes over. Disaggregation hands it the prompt
  without its last token, which the decode worker runs as its first step.
- decode: like colocated, and also admits sequences whose prompt KV (all but the last token) is
  already in its pages; their first step runs the last prompt token and samples the first output.
Admission with room to finish: a sequence starts (a new prefill, or pages reserved for KV a prefill
worker will write) only when the free pages then still cover every admitted sequence's growth to
min(max_tokens, reserved_tokens) past the length it was admitted at; otherwise it waits. So an admitted
sequence never runs out of pages within that horizon. With fair_share (the default) the horizon is also
capped at the sequence's share of the cache (its pages over the sequences admitted or waiting), so a new
request waits only while the others are within their share, never for their long outputs to end (three
900-token streams kept a 5-token request waiting 1,791 steps). One that runs past its horizon grows into
pages no one is owed, or is preempted: its KV is dropped and recomputed here later, or (decode role,
preemption "refetch") handed back to the worker, which asks a prefill worker for prompt + outputs again,
so that a decode step never carries a whole prompt.
Where each sequence is, is its status (engine/sequence.py Status): the queues `waiting` and `running`
hold WAITING and RUNNING ones, and `aside` every other: LOADING (its pages come up from below device
memory), AWAITING_KV and AWAITING_LOADS (decode role: a prefill worker writes its KV; then its loads from
below land), REFETCH and REFETCHING (decode role: preempted, its KV to be fetched again).
Prefix caching (salt set): a sequence that starts holding no pages first looks up the names of its full
pages (engine/kv/cache.py); the leading ones that are cached are shared and count as computed, but at
least its last `min_compute` tokens are computed (the one that samples; two when an MTP head needs the
hidden state before it). After each step the pages a sequence filled get their names.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.budget import SloBudget, decode_state
from engine.config import SchedulerConfig
from engine.fair import Shares
from engine.kv.cache import PageAllocator, page_hashes, request_salt
from engine.kv.tiers import KVTiers
from engine.role import Role
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
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: PageAllocator,
        context: int | None = None,
        salt: bytes | None = None,
    ):
        """context: the model's longest sequence (no sequence is owed pages past it). salt: the prefix
        cache's key for what else changes the KV (model, dtype); None turns the cache off."""
        self.config, self.allocator, self.context, self.salt = config, allocator, context, salt
        self.min_compute = 1  # tokens of a sequence always computed, never taken from the cache
        self.num_prefix_queries = 0  # tokens looked up in the prefix cache, and found there
        self.num_prefix_hits = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.aside: dict[str, Sequence] = {}  # in neither queue, waiting for KV from elsewhere: see status
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # tokens computed again here because a preemption dropped their KV
        self.num_refetched_tokens = 0  # tokens whose KV a preemption dropped, to be fetched again
        self.propose = None  # speculative decoding: seq -> draft token ids for its next decode step
        self.tiers: KVTiers | None = None  # KV below device memory (engine/kv/tiers.py)
        self._candidates = 0  # has_room: a sequence not yet queued that asks for room
        self.budget = (  # an SLO-driven step budget (engine/budget.py), or None: the fixed one
            SloBudget(config.step_target_s, config.max_num_batched_tokens)
            if config.step_target_s is not None
            else None
        )

    @property
    def role(self) -> Role:
        return self.config.role

    def target(self, seq: Sequence) -> int:
        """Tokens whose KV this worker computes for seq."""
        return seq.num_tokens if self.role.samples else len(seq.prompt_ids)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _set_aside(self, seq: Sequence, status: Status) -> None:
        seq.status = status
        self.aside[seq.request_id] = seq

    def _take(self, seq: Sequence, status: Status) -> None:
        """Back from aside, into the queue status names (at its end: RUNNING; at its front: WAITING)."""
        del self.aside[seq.request_id]
        seq.status = status
        if status is Status.RUNNING:
            self.running.append(seq)
        else:
            self.waiting.appendleft(seq)

    def in_state(self, *statuses: Status) -> list[Sequence]:
        """The sequences set aside in any of these states, in the order they were set aside."""
        return [s for s in self.aside.values() if s.status in statuses]

    def resume(self, seq: Sequence) -> None:
        """Decode role: seq resumes with outputs (a migrated or handed-back request); the worker fetches
        its KV: it waits, holding no pages, to reserve them as a refetched one does."""
        self._set_aside(seq, Status.REFETCHING)

    def refetched(self, request_id: str) -> Sequence | None:
        """The preempted (or resumed) sequence whose KV the worker fetches again under this id, if any."""
        seq = self.aside.get(request_id)
        return seq if seq is not None and seq.status in (Status.REFETCH, Status.REFETCHING) else None

    def reserve(self, seq: Sequence, hit: list[int]) -> None:
        """Decode role: seq starts with the cached pages hit (lookup's) and its other pages are reserved
        (pinned) for KV a prefill worker writes; it counts as admitted from now on. The caller checked
        has_room(seq, hit)."""
        seq.admitted_at = seq.num_tokens
        self._start(seq, hit)
        seq.num_computed = 0  # nothing runs before admit_prefilled
        self._set_aside(seq, Status.AWAITING_KV)

    def unreserve(self, request_id: str) -> None:
        """Decode role: a reserved sequence's pages are owed nothing more (released, or held elsewhere
        for a transfer that may still write them)."""
        seq = self.aside.get(request_id)
        if seq is not None and seq.status is Status.AWAITING_KV:
            del self.aside[request_id]

    def load_reserved(self, seq: Sequence, within_s: float) -> None:
        """Decode role: start loading the reserved seq's next leading pages found below device memory
        (after its device hits) instead of having them sent: as many as kv_tiers.decode_loads allows
        ("cost": while their expected load time stays within within_s, the time the transfer is
        expected to take). Its `load` says how many (no prefill worker needs to send them)."""
        if self.tiers is None or self.tiers.config.decode_loads == "never":
            return
        below = self._below(seq, seq.pages_named)
        if self.tiers.config.decode_loads == "cost":
            total, n = 0.0, 0
            for tier in below:
                total += self.tiers.page_s(tier)
                if total > within_s:
                    break
                n += 1
            below = below[:n]
        if below:
            self._load(seq, below)

    def admit_prefilled(self, seq: Sequence) -> None:
        """Decode role: seq's pages hold the KV of all its tokens but the last (a prompt's, or a
        refetched sequence's prompt and outputs); its next step runs that token and samples. Pages it
        loads from below (load_reserved) must land first: until then it is AWAITING_LOADS."""
        if seq.load is not None:
            self._set_aside(seq, Status.AWAITING_LOADS)
            return
        seq.num_computed = seq.num_tokens - 1
        self._take(seq, Status.RUNNING)

    def recompute(self, seq: Sequence) -> None:
        """Decode role: a reserved sequence is prefilled here instead (it keeps its pages; those it shares
        from the prefix cache hold their KV already, and those loading from below join it once landed)."""
        seq.num_computed = seq.pages_named * self.allocator.page_size
        if seq.load is not None:
            self._set_aside(seq, Status.LOADING)
            return
        del self.aside[seq.request_id]
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def take_refetches(self) -> list[Sequence]:
        """Sequences preempted since the last call whose KV the worker must fetch again."""
        new = self.in_state(Status.REFETCH)
        for seq in new:
            seq.status = Status.REFETCHING
        return new

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.landing)

    @property
    def landing(self) -> list[Sequence]:
        """Sequences whose loads a step waits for (not reserved ones: their transfer is still to land)."""
        return self.in_state(Status.LOADING, Status.AWAITING_LOADS)

    # ---- admission with room to finish -----------------------------------------------------------

    def final_tokens(self, seq: Sequence) -> int:
        """The length seq is owed pages for: its prompt (prefill role), else min(max_tokens,
        reserved_tokens) tokens past the length it was admitted at, within the context."""
        if not self.role.samples:
            return len(seq.prompt_ids)
        start = max(seq.admitted_at, len(seq.prompt_ids))
        left = seq.params.max_tokens - (start - len(seq.prompt_ids))  # outputs it may still make
        if self.config.reserved_tokens is not None:
            left = min(left, self.config.reserved_tokens)
        final = start + max(left, 1)
        if self.config.fair_share:  # no more than its share of the cache while others wait for room
            final = min(final, max(start + 1, self.fair_tokens))
        return final if self.context is None else min(final, self.context)

    @property
    def fair_tokens(self) -> int:
        """A sequence's share of the cache: its tokens over the sequences admitted or waiting."""
        active = len(self.running) + len(self.waiting) + len(self.aside)
        share = self.allocator.num_pages // max(active + self._candidates, 1)  # whole pages: the shares fit
        return share * self.allocator.page_size

    def need(self, seq: Sequence) -> int:
        """Pages seq still lacks to reach final_tokens."""
        owned = len(self.allocator.pages(seq.request_id))
        return max(0, self.allocator.pages_for(self.final_tokens(seq)) - owned)

    def admitted(self) -> list[Sequence]:
        """The sequences admitted: running, reserved, queued with pages, or loading them from below."""
        queued = [s for s in self.waiting if self.allocator.pages(s.request_id)]
        return [*self.running, *self.in_state(Status.AWAITING_KV), *queued, *self.landing]

    def debt(self) -> int:
        """Pages the admitted sequences are owed."""
        return sum(self.need(s) for s in self.admitted())

    def has_room(self, seq: Sequence, hit: list[int] = ()) -> bool:
        """Whether seq, not yet admitted and holding no pages, may start now (sharing the cached pages
        hit: they count as its own, and those no request holds leave the free pages)."""
        free = self.allocator.num_free - self.allocator.num_unused(hit)
        queued = seq in self.waiting or self.refetched(seq.request_id) is seq
        self._candidates = 0 if queued else 1  # it counts among those sharing the cache
        try:
            return self.need(seq) - len(hit) + self.debt() <= free
        finally:
            self._candidates = 0

    def _excess(self, seq: Sequence, num_tokens: int) -> int:
        """Pages seq needs for num_tokens beyond what it is owed."""
        owned = len(self.allocator.pages(seq.request_id))
        return max(0, self.allocator.pages_for(num_tokens) - owned - self.need(seq))

    def next_waiting(self, shares: Shares) -> Sequence:
        """The waiting sequence admitted next: one holding pages first, else the earliest of the client
        that holds the fewest (engine/fair.py; first come, first served among one client's)."""
        return min(self.waiting, key=lambda s: (not self.allocator.pages(s.request_id), shares.rank(s)))

    def give_way(self, seq: Sequence, shares: Shares | None = None) -> bool:
        """seq, not admitted, may not start (no room, or max_num_seqs run): preempt the newest running
        sequence of the client that holds the most, while it holds at least two more than seq's
        (engine/fair.py), until seq could start. Returns whether seq could start once they gave way
        (False without asking about room when no client holds two more: one client alone costs nothing)."""
        shares = shares or Shares(self.admitted())
        hit = None
        while True:
            pinned = self.allocator.is_pinned
            victims = [s for s in self.running if shares.gives_way(s, seq) and not pinned(s.request_id)]
            if not victims:
                return False
            hit = self.lookup(seq) if hit is None else hit  # named pages stay cached through preemptions
            if len(self.running) < self.config.max_num_seqs and self.has_room(seq, hit):
                return True
            victim = max(reversed(victims), key=shares.rank)  # the first of the most: the newest of them
            shares.remove(victim)
            self.preempt(victim)

    def schedule(self) -> Batch | None:
        self._landed()
        held = self._held()
        shares = Shares(self.admitted())
        if self.waiting and self.role.samples:  # a prefill's pages go free once sent, soon
            head = self.next_waiting(shares)
            if not self.allocator.pages(head.request_id):
                self.give_way(head, shares)
        batch, budget = Batch(), self.config.max_num_batched_tokens
        decoding = [s for s in self.running if self.target(s) - s.num_computed == 1]
        if self.budget is not None and decoding:  # prompts get what keeps the decodes on time
            now = time.perf_counter()
            states = [
                decode_state(s.token_times, now, s.params.max_tokens - len(s.output_ids) - 1)
                for s in decoding[: self.config.max_num_seqs]
            ]
            budget = min(budget, len(states) + self.budget.prompt_tokens(states))
        prefilling = [s for s in self.running if self.target(s) - s.num_computed > 1]
        spare = self.allocator.num_free - self.debt()  # pages no admitted sequence is owed
        for seq in decoding + prefilling:
            if budget == 0 or len(batch.chunks) == self.config.max_num_seqs:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(self.target(seq) - seq.num_computed, budget)
            decodes = self.target(seq) - seq.num_computed == 1
            drafts = self._drafts(seq, budget - n) if decodes else []
            if drafts and self._excess(seq, seq.num_computed + n + len(drafts)) > max(spare, 0):
                drafts = []  # guesses take only pages no one is owed
            excess = self._excess(seq, seq.num_computed + n + len(drafts))
            if excess > max(spare, 0):  # past its horizon, and every free page is owed to others
                self.preempt(seq)
                continue
            if self._make_room(seq, seq.num_computed + n + len(drafts), batch):
                batch.chunks.append(self._chunk(seq, n, drafts))
                budget -= n + len(drafts)
                spare -= excess
        debt = self.debt()
        while self.waiting and budget > 0 and len(batch.chunks) < self.config.max_num_seqs:
            seq = self.next_waiting(shares)
            holds = bool(self.allocator.pages(seq.request_id))  # then already counted in debt
            hit = [] if holds else self.lookup(seq)
            below = [] if holds else self._below(seq, len(hit))
            if not holds:
                seq.admitted_at = seq.num_tokens
            start = len(hit) * self.allocator.page_size if hit else seq.num_computed
            n = min(self.target(seq) - start, budget)
            others = debt - self.need(seq) if holds else debt
            free = self.allocator.num_free - self.allocator.num_unused(hit)  # sharing revives those
            owned = len(self.allocator.pages(seq.request_id)) + len(hit)
            if (
                self.need(seq) - len(hit) + others > free
                or self.allocator.pages_for(start + n) - owned > free
            ):
                if holds and not (self.running or self.in_state(Status.AWAITING_KV) or batch.chunks):
                    self.preempt(seq)  # nothing else can free a page for it: let the others go on
                    continue
                break  # wait for pages: running sequences' growth comes first
            self.waiting.remove(seq)
            if not holds:
                self._start(seq, hit)
                shares.add(seq)
            if below:  # it waits out of the batch while they load
                self._load(seq, below)
                self._set_aside(seq, Status.LOADING)
                debt = others + self.need(seq)
                continue
            seq.status = Status.RUNNING
            seq.scheduled_time = seq.scheduled_time or time.perf_counter()
            self.running.append(seq)
            batch.chunks.append(self._chunk(seq, n))
            budget -= n
            debt = others + self.need(seq)
        self.waiting.extendleft(reversed(held))
        return batch if batch.chunks else None

    def _held(self) -> list[Sequence]:
        """Take out of the queue, for this step, the later completions of an n > 1 request whose first
        completion's prompt KV is not computed yet (or, decode role, has not landed): they start once it
        is, sharing its pages through the prefix cache; the sequences behind them go ahead meanwhile."""
        held = []
        for seq in self.waiting:
            first = seq.after
            if first is None:
                continue
            if first.finished or first.num_computed >= len(first.prompt_ids):
                seq.after = None  # from now on an ordinary sequence
            else:
                held.append(seq)
        for seq in held:
            self.waiting.remove(seq)
        return held

    # ---- prefix cache ---------------------------------------------------------------------------------

    def lookup(self, seq: Sequence) -> list[int]:
        """The cached pages seq (holding none) may start with: its leading named pages, short of its last
        min_compute tokens."""
        if self.salt is None:
            return []
        size, usable = self.allocator.page_size, self._usable(seq)
        if usable <= 0:
            return []
        if len(seq.page_hashes) < usable:
            page_hashes(seq.all_ids[: usable * size], size, self._salt(seq), seq.page_hashes)
        return self.allocator.lookup(seq.page_hashes[:usable])

    def _usable(self, seq: Sequence) -> int:
        """How many of seq's leading pages a cache may give it: all short of its last min_compute tokens."""
        return (self.target(seq) - self.min_compute) // self.allocator.page_size

    def _below(self, seq: Sequence, device: int) -> list[str]:
        """The tiers of seq's next leading pages (after its device hits, lookup's) found below device
        memory."""
        usable = self._usable(seq)
        if self.tiers is None or self.salt is None or device >= usable:
            return []
        return self.tiers.find(seq.page_hashes[device:usable])

    def _load(self, seq: Sequence, tiers: list[str]) -> None:
        """Start loading seq's pages found below: their host slots first (kept from the pages that
        taking device pages for them evicts), then those device pages."""
        size, first = self.allocator.page_size, seq.pages_named
        names = seq.page_hashes[first : first + len(tiers)]
        job = self.tiers.plan(names, tiers)
        try:
            pages = self.allocator.grow(seq.request_id, (first + len(tiers)) * size)
        except Exception:
            job.cancel()  # run as cancelled: it copies nothing and gives its slots back
            self.tiers.start(job, [])
            raise
        self.tiers.start(job, pages[first:])
        seq.load = job

    def _landed(self) -> None:
        """Sequences whose loads ended (or passed their deadline) queue first, computing from there."""
        if self.tiers is None:
            return
        self.tiers.poll()
        for seq in self.landing:  # not a reserved one: its transfer has not landed yet
            job = seq.load
            if not job.due:
                continue
            seq.load = None
            ok = job.cancel()
            loaded = ok * self.allocator.page_size
            self.num_prefix_hits += loaded
            seq.num_cached_tokens = (seq.num_cached_tokens or 0) + loaded
            if seq.status is Status.AWAITING_LOADS:  # decode role: the rest of its KV was sent
                if ok == len(job.plan):
                    seq.num_computed = seq.num_tokens - 1
                    self._take(seq, Status.RUNNING)
                    continue
                # a page failed to load: compute from there (over the KV sent after it)
                seq.num_computed = seq.pages_named * self.allocator.page_size
            seq.num_computed += loaded
            self.computed(seq)
            self._take(seq, Status.WAITING)

    def _salt(self, seq: Sequence) -> bytes:
        """What seq's page names start from: the engine's salt, and its request's cache_salt."""
        return request_salt(self.salt, seq.params.cache_salt)

    def _start(self, seq: Sequence, hit: list[int]) -> None:
        """seq, holding no pages, is admitted: it shares the cached pages hit and computes from there."""
        cached = len(hit) * self.allocator.page_size
        if self.salt is not None:
            self.num_prefix_queries += self.target(seq)
            self.num_prefix_hits += cached
        if hit:
            self.allocator.share(seq.request_id, hit)
        seq.num_computed, seq.pages_named = cached, len(hit)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = cached

    def computed(self, seq: Sequence) -> None:
        """seq's KV now covers num_computed tokens: name the full pages it filled."""
        if self.salt is None:
            return
        size = self.allocator.page_size
        full = min(seq.num_computed, seq.num_tokens) // size
        if full <= seq.pages_named:
            return
        if len(seq.page_hashes) < full:
            page_hashes(seq.all_ids[: full * size], size, self._salt(seq), seq.page_hashes)
        seq.pages_named = self.allocator.name(seq.request_id, seq.page_hashes[:full], seq.pages_named)

    def _drafts(self, seq: Sequence, room: int) -> list[int]:
        """Drafts for a decoding sequence: within the step's budget and what it may still generate."""
        if self.propose is None or room <= 0 or not self.role.samples:
            return []
        left = seq.params.max_tokens - len(seq.output_ids) - 1  # the verify step adds one more itself
        return self.propose(seq)[: max(0, min(room, left))]

    def _chunk(self, seq: Sequence, n: int, drafts: list[int] | None = None) -> Chunk:
        drafts = drafts or []
        total = seq.num_computed + n + len(drafts)
        pages = self.allocator.grow(seq.request_id, total)
        if seq.num_computed < seq.recompute_until:  # KV a preemption dropped, computed again
            self.num_recomputed_tokens += min(total, seq.recompute_until) - seq.num_computed
        samples = self.role.samples and seq.num_computed + n == seq.num_tokens
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
        """Drop seq's KV. It goes back to the front of the queue and is recomputed (prompt + outputs),
        or (decode role, preemption "refetch") waits as REFETCH for the worker to fetch it again. A
        queued one that holds pages (prefilled here, waiting for more) may be preempted too."""
        (self.running if seq in self.running else self.waiting).remove(seq)
        self.allocator.free(seq.request_id)
        self.num_preemptions += 1
        seq.pages_named = 0
        refetch = self.role.receives_kv and self.config.preemption == "refetch"
        if refetch:
            self.num_refetched_tokens += seq.num_computed
        else:
            seq.recompute_until = max(seq.recompute_until, seq.num_computed)
        seq.num_computed, seq.status = 0, Status.WAITING
        if refetch:
            self._set_aside(seq, Status.REFETCH)
        else:
            self.waiting.appendleft(seq)

    def remove(self, seq: Sequence, free_pages: bool = True) -> None:
        """Take seq out of the queues (finished or aborted), returning its pages unless told otherwise."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.aside.get(seq.request_id) is seq:
            del self.aside[seq.request_id]
        if seq.load is not None:
            seq.load.cancel()  # no page of it is written after this: they may be freed
            seq.load = None
        if free_pages:
            self.allocator.unpin(seq.request_id)
            self.allocator.free(seq.request_id)
