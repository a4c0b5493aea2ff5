"""What the router believes of each worker (serving/router/policy.py): which pages it caches, an LRU of
the page names it was routed or reported (page_names, leading, apply_events; per DP group of a worker:
Groups), and how fast it runs, from the counters in its Loads (Speed).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field


def page_names(
    token_ids, page_size: int, salt: bytes = b"router", cache_salt: str | None = None
) -> list[bytes]:
    """The names of token_ids' full pages: the engine's chained hash (with its salt and the request's
    cache_salt, the same names)."""
    from engine.kv.cache import page_hashes, request_salt  # here: the simulator imports this without torch

    return page_hashes(list(token_ids), page_size, request_salt(salt or b"router", cache_salt), [])


@dataclass
class Speed:
    """What one worker's Loads say about its speed (their counters only grow, until it restarts)."""

    counters: tuple = ()  # the last Load's (prefill tokens, prefill s, decode steps, seqs, decode s)
    prefill_tok_s: float | None = None  # moving average over Loads that computed prompt tokens
    decode: deque = field(default_factory=lambda: deque(maxlen=32))  # (mean batch, mean step s, when)

    def observe(self, counters: tuple, when: float = 0.0) -> None:
        last, self.counters = self.counters, counters
        if not last or any(now < before for now, before in zip(counters, last, strict=True)):
            last = (0,) * len(counters)  # the first Load seen, or a restarted worker's: since it started
        tokens, seconds, steps, seqs, decode_s = (
            now - before for now, before in zip(counters, last, strict=True)
        )
        if tokens and seconds > 0:
            rate = tokens / seconds
            self.prefill_tok_s = rate if self.prefill_tok_s is None else 0.7 * self.prefill_tok_s + 0.3 * rate
        if steps:
            self.decode.append((seqs / steps, decode_s / steps, when))

    def expire(self, before: float) -> None:
        """Forget the decode steps measured before this time (a slow step long ago says nothing now)."""
        while self.decode and self.decode[0][2] < before:
            self.decode.popleft()

    def step_s(self, batch: int) -> float | None:
        """A decode step's predicted time at this batch: a line through the recent (batch, time) pairs,
        their mean where they do not span two batch sizes or the line falls."""
        if not self.decode:
            return None
        xs, ys, _ = zip(*self.decode, strict=True)
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var > 0.25 else 0.0
        return my + max(slope, 0.0) * (batch - mx)


def leading(cached: OrderedDict, names: list[Hashable]) -> int:
    """How many of names' leading pages a belief holds."""
    for n, name in enumerate(names):
        if name not in cached:
            return n
    return len(names)


def apply_events(cached: OrderedDict, events: Iterable[tuple[bool, Hashable]], cap: int) -> None:
    """Cache events, in order, on a belief (an LRU of page names): (True, name) stored, (False, name)
    dropped; the oldest go past cap names."""
    for stored, name in events:
        if stored:
            cached[name] = None
            cached.move_to_end(name)
        else:
            cached.pop(name, None)
    while len(cached) > cap:
        cached.popitem(last=False)


class Groups:
    """A worker's DP groups as the router sees them: each one's cached page names and requests."""

    def __init__(self, dp: int, cache_pages: int):
        self.cached = [OrderedDict() for _ in range(dp)]
        self.in_flight: list[set] = [set() for _ in range(dp)]
        self.cache_pages = cache_pages

    def choose(self, names: list[Hashable], pages: dict, weight: float, size: int) -> int:
        """The group with the least cost for a request of `size` pages named `names`: weight x its pages
        that group must compute + the pages of the requests it has (pages: request -> its pages)."""

        def cost(g: int) -> tuple[float, int]:
            load = sum(pages.get(r, 0) for r in self.in_flight[g])
            return weight * (size - leading(self.cached[g], names)) + load, len(self.in_flight[g])

        return min(range(len(self.cached)), key=cost)

    def remember(self, g: int, names: Iterable[Hashable]) -> None:
        self.observe(g, [(True, n) for n in names])

    def observe(self, g: int, events: Iterable[tuple[bool, Hashable]]) -> None:
        apply_events(self.cached[g], events, self.cache_pages)

    def discard(self, request_id) -> None:
        for requests in self.in_flight:
            requests.discard(request_id)

    def clear(self) -> None:
        for cached in self.cached:
            cached.clear()
