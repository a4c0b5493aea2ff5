"""What the simulator simulates: a request (SimRequest), an instance's prefix cache (PageCache) and a
serving instance with its queues, KV and counters (Instance). experiments/sim/steps.py runs one
instance's step, experiments/sim/simulate.py the event loop over all of them (its docstring says how).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from experiments.sim.cost import CostModel
from experiments.workload import MOONCAKE_BLOCK


@dataclass
class SimRequest:
    rid: int
    arrival: float
    prompt: int
    output: int
    first_token: float | None = None
    done: float | None = None
    computed: int = 0  # prompt tokens whose KV exists
    generated: int = 0  # output tokens sampled
    token_times: list = field(default_factory=list)
    drafted: int = 0  # speculative decoding: drafts proposed, accepted, verify steps
    accepted: int = 0
    verifies: int = 0
    drafting: int = 0  # drafts in the step being simulated
    held: int = 0  # KV slots (tokens) it holds on its decode instance
    fetch: int = 0  # a refetch: the tokens (prompt + outputs) a prefill instance computes again
    shared: int = 0  # prefix caching: its first tokens every request shares (a system prompt)
    stream: object = None  # what its other pages belong to (a conversation); None: itself alone
    conversation: int = -1  # multiturn: its conversation and turn
    turn: int = 0
    cached: int = 0  # prompt tokens its serving instance's cache held (its decode instance's, disaggregated)
    named: int = 0  # tokens of its KV where it runs that the prefix cache names (Instance.fit_cache)
    skip: int = 0  # disaggregated: pages its decode instance held, not sent
    local: bool = False  # disaggregated: its decode instance computed the missing rest itself
    computing: bool = False  # on its decode instance: its context computed there, in chunks, until done
    sent_tokens: int = 0  # KV tokens sent to it (the engine sends whole pages: up to a page more)
    started: float | None = None  # prefill: when its first pass began, and how long that pass took
    first_pass: float = 0.0  # (its first layer's pages can leave a layer's share of it later)
    last_chunk: int = 0  # prefill: the tokens of its latest pass (the last layer of the last one goes last)
    rejected: str | None = None  # why the policy's admission refused it (deployment.admission=slo)
    ready: float = 0.0  # kv_tiers: its pages below the device are loaded by then (it waits out of steps)
    # a Mooncake trace's hash ids of its prompt's 512-token blocks (prefix-chained: the same id, the same
    # tokens before it too), which name its pages as the real run's prompts built from them share them
    blocks: tuple = ()
    block: int = MOONCAKE_BLOCK  # tokens each of those ids names (a trace scaled down: fewer)

    def names(self, tokens: int, page: int) -> list:
        """The names of the pages its first `tokens` tokens fill (whole pages only)."""
        own = self.stream if self.stream is not None else ("request", self.rid)
        size = self.block
        in_blocks = min(self.prompt, len(self.blocks) * size)
        return [
            ("block", self.blocks[i * page // size], i * page % size // page)
            if (i + 1) * page <= in_blocks and size % page == 0
            else ("shared", i)
            if (i + 1) * page <= self.shared
            else (own, i)
            for i in range(tokens // page)
        ]

    @property
    def context(self) -> int:
        """Tokens a prefill computes for it: its prompt, or prompt + outputs when refetched."""
        return self.fetch or self.prompt

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        return (self.done - self.first_token) / (self.output - 1) if self.output > 1 else 0.0


TIER_PAGE_S = {"host": 2e-4, "disk": 1e-3, "pool": 1e-3}  # a page's load, until a run measures it


@dataclass
class TierSpec:
    """KV tiers below every instance's device cache (kv_tiers): the host pool's and the files' capacity
    in pages per instance (0: none), the shared pool's in pages (0: none), and one page's load time from
    each (seconds; compare_real takes them from the run it checks)."""

    host_pages: int = 0
    disk_pages: int = 0
    pool_pages: int = 0
    page_s: dict = field(default_factory=lambda: dict(TIER_PAGE_S))
    # a disaggregated request's decode instance: loads what it finds below its device cache instead of
    # being sent it (kv_tiers.decode_loads, as engine/scheduler.py's load_reserved): never | always | cost
    decode_loads: str = "cost"


def _lru_put(names: OrderedDict, name, capacity: int):
    """Add name as the most recently used; the name that fell out, if any."""
    names[name] = None
    names.move_to_end(name)
    return names.popitem(last=False)[0] if len(names) > capacity else None


class PageCache:
    """An instance's prefix cache: page names, least recently used first, at most `capacity` of them;
    with tiers, what it evicts goes to its host pool (and behind it, every host page, to its files), and
    every page it names goes to the pool all instances share (a decode instance's do not: `share`), as
    engine/kv/tiers.py does."""

    def __init__(self, capacity: int, tiers: TierSpec | None = None, pool: OrderedDict | None = None):
        self.capacity, self.pages = max(int(capacity), 0), OrderedDict()
        self.size = self.capacity  # what it may hold at most; capacity: what it may hold now (fit)
        self.queries = self.hits = 0  # prompt tokens looked up, and found (on the device or below)
        self.tiers, self.pool = tiers, pool
        self.host: OrderedDict = OrderedDict()
        self.disk: OrderedDict = OrderedDict()
        self.tier_hits = {"host": 0, "disk": 0, "pool": 0}  # tokens loaded from each
        self.load_s = 0.0  # loads of the step being scheduled (its duration takes them)
        self.share = True  # put what it names into the pool (a decode instance does not, as the engine)

    def peek(self, r: SimRequest, context: int, page: int) -> list:
        """The names of the pages at the head of r's first `context` tokens that are cached (at most what
        leaves its last token to compute), on the device or, with tiers, below it."""
        names = r.names(context - 1, page)
        n = 0
        while n < len(names) and names[n] in self.pages:
            n += 1
        while n < len(names) and self._below(names[n]) is not None:
            n += 1
        return names[:n]

    def _below(self, name) -> str | None:
        if self.tiers is None:
            return None
        if name in self.host:
            return "host"
        if name in self.disk:
            return "disk"
        return "pool" if self.pool is not None and name in self.pool else None

    def lookup(self, r: SimRequest, context: int, page: int, within_s: float | None = None) -> int:
        """How many pages peek finds, counted as a query; they become the most recently used (those below
        the device are loaded: their time goes to load_s). within_s: take the pages below the device only
        while their loads add up to at most this (0: none of them; None: all)."""
        names = self.peek(r, context, page)
        tiers = [None if name in self.pages else self._below(name) for name in names]  # device ones first
        staged = self.tiers.host_pages // 2 if self.tiers is not None and self.tiers.host_pages else None
        if staged is not None:  # as engine/kv/tiers.py's load: a disk or pool page is staged through a
            # host slot, and one load takes a page from them only while it holds under half the slots
            below = [i for i, t in enumerate(tiers) if t is not None]
            cut = next((i for k, i in enumerate(below) if k >= staged and tiers[i] != "host"), len(names))
            names, tiers = names[:cut], tiers[:cut]
        if within_s is not None:
            n, total = 0, 0.0
            while n < len(names) and (tiers[n] is None or total + self.tiers.page_s[tiers[n]] <= within_s):
                total += self.tiers.page_s[tiers[n]] if tiers[n] is not None else 0.0
                n += 1
            names, tiers = names[:n], tiers[:n]
        for name, tier in zip(names, tiers, strict=True):
            if tier is not None:
                self.tier_hits[tier] += page
                self.load_s += self.tiers.page_s[tier]
            self._put(name)
        n = len(names)
        self.queries += context
        self.hits += n * page
        return n

    def add(self, r: SimRequest, tokens: int, page: int) -> None:
        """r's first `tokens` tokens' pages are named: the last one least recently used, as the engine
        releases a request's pages last first (a prompt's tail leaves before the prefix others share)."""
        names = r.names(tokens, page)
        for name in reversed(names):
            self._put(name)
        if self.pool is not None and self.tiers.pool_pages and self.share:
            for name in names:  # put as they are named
                _lru_put(self.pool, name, self.tiers.pool_pages)

    def _put(self, name) -> None:
        evicted = _lru_put(self.pages, name, self.capacity)
        if evicted is not None:
            self._evicted(evicted)

    def _evicted(self, name) -> None:
        if self.tiers is not None and self.tiers.host_pages:
            _lru_put(self.host, name, self.tiers.host_pages)
            if self.tiers.disk_pages:  # written behind the host pool
                _lru_put(self.disk, name, self.tiers.disk_pages)

    def fit(self, room: int) -> None:
        """Hold at most min(size, room) pages from now: the least recently used names leave (to the
        tiers below, as any eviction)."""
        self.capacity = max(min(self.size, room), 0)
        while len(self.pages) > self.capacity:
            self._evicted(self.pages.popitem(last=False)[0])

    def take_load_s(self) -> float:
        out, self.load_s = self.load_s, 0.0
        return out


@dataclass(eq=False)  # identity: two idle instances of one config are still two
class Instance:
    cost: CostModel
    budget: int = 2048  # tokens per step
    step_budget: object = None  # chunk_size: slo: the engine's SloBudget (engine/budget.py), fed its steps
    max_seqs: int = 256
    chunked: bool = True
    kv_fraction: float = 0.9  # of the HBM left after weights
    slowdown: float = 1.0  # every step takes this many times the cost model's (measured work beside it)
    # the machine's other workers (experiments.sim.contention.Contention): a step beside their steps takes
    # longer, by what it and they read from memory; None: instances do not share a machine
    contention: object = None
    last_bytes: float = 0.0  # what the step just scheduled reads (with contention)
    waiting: list = field(default_factory=list)
    running: list = field(default_factory=list)
    kv_used: float = 0.0
    spec_k: int = 0  # speculative decoding: drafts per decode step (0: none)
    spec_acceptance: float = 0.0  # the chance each draft is accepted, given the ones before it were
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    kv_tokens: float | None = None  # KV capacity in tokens (None: what HBM holds after the weights)
    reserved_tokens: int | None = None  # decode admission horizon (engine.config.SchedulerConfig)
    preemption: str = "refetch"  # decode: refetch | recompute_local
    recompute: list = field(default_factory=list)  # decode: preempted, to recompute here
    preemptions: int = 0
    recomputed_tokens: int = 0  # computed again on this instance after a preemption
    refetched_tokens: int = 0  # fetched again from a prefill instance after a preemption
    page_size: int = 16
    cache: PageCache | None = None  # prefix caching (see the module's docstring); None: off
    local_prefill_max_tokens: int = 0  # decode: computes a missing rest this short itself
    # what a real worker's Load counts (the policy's admission reads it): prompt tokens computed and the
    # time of those steps; decode-only steps, their sequences and time
    speed: list = field(default_factory=lambda: [0, 0.0, 0, 0, 0.0])
    last_step: tuple = (0, 0)  # (prompt tokens, decoding sequences) of the step just scheduled
    # elastic roles: role -> the settings this instance takes when it moves to that role
    role_settings: dict = field(default_factory=dict)
    handed_back: int = 0  # requests it handed back when it left the decode role
    link_free: float = 0.0  # disaggregated prefill: when its NICs have sent what was given them so far

    def enable_cache(
        self, pages: int | None = None, tiers: TierSpec | None = None, pool: OrderedDict | None = None
    ) -> Instance:
        """Turn prefix caching on, over `pages` pages (None: the instance's KV capacity), with tiers below
        it (pool: the one all instances share)."""
        capacity = self.kv_capacity_tokens // self.page_size if pages is None else pages
        self.cache = PageCache(min(capacity, 1 << 40), tiers, pool)
        return self

    @property
    def kv_capacity_tokens(self) -> float:
        if self.kv_tokens is not None:
            return self.kv_tokens
        free = self.cost.hw.hbm_bytes - self.cost.weight_bytes_per_rank()
        return self.cost.dp * max(free, 0) * self.kv_fraction / self.cost.kv_bytes_per_token_per_rank()

    def fit_cache(self) -> None:
        """As the engine's one allocator: the prefix cache holds the pages the running requests' KV
        leaves, where the KV they computed (or were sent) counts only for the pages the cache does not
        already name (their hits, and a computed prompt once named). Not what they are owed yet: the
        engine takes a page when a request grows into it, evicting the least recently used cached one."""
        if self.cache is None:
            return
        held = 0
        for r in self.running:
            owned = min(r.computed + r.generated, r.held or r.context + r.output)
            held += max(owned - r.named, 0)
        pages = int(min(self.kv_capacity_tokens, 1 << 50)) // self.page_size
        self.cache.fit(pages - -(-held // self.page_size))

    def load(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.recompute)


def check_fits(d, role: str, instance: Instance, tokens: int) -> None:
    """Refuse, naming the numbers, a placement whose instance cannot hold its weights or, beside them,
    the KV of the workload's longest request (`tokens`: its prompt, and on a colocated or decode
    instance its output too): it would never finish it (a 70B model on one H200 once printed a TTFT p50
    of an hour instead)."""
    cost, keys = instance.cost, {"colocated": "tp", "prefill": "prefill_tp", "decode": "decode_tp"}
    weights, hbm = cost.weight_bytes_per_rank(), cost.hw.hbm_bytes
    capacity = instance.kv_capacity_tokens
    if weights < hbm and capacity >= tokens:
        return
    raise ValueError(
        f"deployment {d.name}: a {role} instance of {cost.model.name} at tp={cost.tp}, dp={cost.dp} on "
        f"{cost.hw.name} holds {weights / 1e9:.1f} GB of weights a rank of its {hbm / 1e9:.1f} GB, "
        f"leaving KV for {capacity:,.0f} tokens; the workload's longest request needs {tokens:,}: raise "
        f"deployment.{keys[role]} (or dp), or pick hardware with more memory"
    )
