"""What the router believes sits below each worker's device pages (kv_tiers: its host pool and files, and
the pool all workers share), and what a page costs there.

The belief comes from the workers' tier events (engine.kv.tiers.KVTiers.take_events, batched in their
Loads): each name a tier gained or dropped. A page's price is in units of computing it: on the device 0,
below it the time a load took per page over the time computing a page takes on that worker (both from
its Loads: the tier's load seconds over the pages it loaded, the prefill speed), 1 where it is nowhere.
Until measured, a tier costs its prior (PRIORS). A stale belief costs only speed: the worker looks its
tiers up itself.
"""

from __future__ import annotations

from collections import OrderedDict

TIERS = ("host", "disk", "pool")
PRIORS = {"host": 0.05, "disk": 0.2, "pool": 0.2}  # of a page's compute time, until a load is measured
POOL_PAGES = 1 << 20  # the pool's belief is bounded too (the store evicts without telling)


class Below:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.held: dict[str, dict[str, OrderedDict]] = {}  # worker -> host | disk -> names (LRU)
        self.pool: OrderedDict = OrderedDict()
        self.price = dict(PRIORS)
        self.measured: dict[tuple[str, str], tuple[float, int]] = {}  # (worker, tier) -> (load s, tokens)

    def observe(self, worker: str, events) -> None:
        """A worker's tier events, in order: (tier, stored?, name)."""
        for tier, stored, name in events:
            names = (
                self.pool
                if tier == "pool"
                else self.held.setdefault(worker, {}).setdefault(tier, OrderedDict())
            )
            if stored:
                names[name] = None
                names.move_to_end(name)
            else:
                names.pop(name, None)
        if len(self.pool) > POOL_PAGES:
            for _ in range(len(self.pool) - POOL_PAGES):
                self.pool.popitem(last=False)

    def observe_load(self, worker: str, tiers: dict, prefill_tok_s: float | None) -> None:
        """A worker's per-tier counters (so far) and prefill speed: each tier's price, as measured."""
        if not prefill_tok_s:
            return
        compute_s = self.page_size / prefill_tok_s  # one page's prefill
        for tier, c in tiers.items():
            last_s, last_tokens = self.measured.get((worker, tier), (0.0, 0))
            self.measured[worker, tier] = (c.load_s, c.hit_tokens)
            tokens, seconds = c.hit_tokens - last_tokens, c.load_s - last_s
            if tokens <= 0 or seconds <= 0 or tier not in self.price:
                continue
            price = min(1.0, seconds / (tokens / self.page_size) / compute_s)
            self.price[tier] = 0.7 * self.price[tier] + 0.3 * price

    def price_of(self, worker: str, name) -> float | None:
        """The cheapest load of name onto worker from below its device pages (None: nowhere)."""
        held = self.held.get(worker, {})
        prices = [self.price[t] for t, names in held.items() if name in names]
        if name in self.pool:
            prices.append(self.price["pool"])
        return min(prices, default=None)

    def forget(self, worker: str) -> None:
        """worker died: its host pool is gone (its files stay, and so does the pool)."""
        self.held.get(worker, {}).pop("host", None)
