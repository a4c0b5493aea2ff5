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
    skip: int = 0  # disaggregated: pages its decode instance held, not sent
    local: bool = False  # disaggregated: its decode instance computed the missing rest itself
    sent_tokens: int = 0  # KV tokens sent to it (the engine sends whole pages: up to a page more)
    rejected: str | None = None  # why the policy's admission refused it (deployment.admission=slo)
    # a Mooncake trace's hash ids of its prompt's 512-token blocks (prefix-chained: the same id, the same
    # tokens before it too), which name its pages as the real run's prompts built from them share them
    blocks: tuple = ()

    def names(self, tokens: int, page: int) -> list:
        """The names of the pages its first `tokens` tokens fill (whole pages only)."""
        own = self.stream if self.stream is not None else ("request", self.rid)
        in_blocks = min(self.prompt, len(self.blocks) * MOONCAKE_BLOCK)
        return [
            ("block", self.blocks[i * page // MOONCAKE_BLOCK], i * page % MOONCAKE_BLOCK // page)
            if (i + 1) * page <= in_blocks and MOONCAKE_BLOCK % page == 0
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


class PageCache:
    """An instance's prefix cache: page names, least recently used first, at most `capacity` of them."""

    def __init__(self, capacity: int):
        self.capacity, self.pages = max(int(capacity), 0), OrderedDict()
        self.queries = self.hits = 0  # prompt tokens looked up, and found

    def peek(self, r: SimRequest, context: int, page: int) -> list:
        """The names of the pages at the head of r's first `context` tokens that are cached (at most what
        leaves its last token to compute)."""
        names = r.names(context - 1, page)
        for n, name in enumerate(names):
            if name not in self.pages:
                return names[:n]
        return names

    def lookup(self, r: SimRequest, context: int, page: int) -> int:
        """How many pages peek finds, counted as a query; they become the most recently used."""
        names = self.peek(r, context, page)
        for name in names:
            self.pages.move_to_end(name)
        n = len(names)
        self.queries += context
        self.hits += n * page
        return n

    def add(self, r: SimRequest, tokens: int, page: int) -> None:
        for name in r.names(tokens, page):
            self.pages[name] = None
            self.pages.move_to_end(name)
        while len(self.pages) > self.capacity:
            self.pages.popitem(last=False)


@dataclass(eq=False)  # identity: two idle instances of one config are still two
class Instance:
    cost: CostModel
    budget: int = 2048  # tokens per step
    max_seqs: int = 256
    chunked: bool = True
    kv_fraction: float = 0.9  # of the HBM left after weights
    slowdown: float = 1.0  # every step takes this many times the cost model's (measured work beside it)
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

    def enable_cache(self, pages: int | None = None) -> Instance:
        """Turn prefix caching on, over `pages` pages (None: the instance's KV capacity)."""
        capacity = self.kv_capacity_tokens // self.page_size if pages is None else pages
        self.cache = PageCache(min(capacity, 1 << 40))
        return self

    @property
    def kv_capacity_tokens(self) -> float:
        if self.kv_tokens is not None:
            return self.kv_tokens
        free = self.cost.hw.hbm_bytes - self.cost.weight_bytes_per_rank()
        return self.cost.dp * max(free, 0) * self.kv_fraction / self.cost.kv_bytes_per_token_per_rank()

    def load(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.recompute)
