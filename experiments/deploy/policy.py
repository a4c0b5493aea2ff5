"""Which decode (or colocated) worker takes a request: one Router for the main job's driver, the
server's runtime and the simulator.

Policies (`deployment.routing`):
- `round_robin`: the live workers in turn.
- `least_loaded`: the one with the fewest requests in flight.
- `cache_aware` (default): the lowest cost = overlap_weight x the pages it would have to compute (the
  request's pages minus the leading ones the router believes that worker caches) + the pages of the
  requests it already has in flight (Dynamo's KV router's cost, in pages; SGLang's cache-aware router
  keeps the same kind of approximate index). Ties go to the fewest in flight, then the first worker.

What a worker caches is the router's belief: the pages of every prompt it routed there (at once, before
the worker has computed them), and what the worker reports, batched in its Load about once a second:
each page it named and each name it dropped (Dynamo's KV events; observe()), with names computed as the
engine's (its salt: model, dtype, page size, from the worker's Ready); an LRU per worker as large as
the worker's cache. Without events (a simulator, a run whose workers do not send them) a request's end
adds its reply's pages. A worker that dies forgets all of it. A belief that is stale costs only speed:
the worker looks its own cache up and computes what it lacks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

POLICIES = ("round_robin", "least_loaded", "cache_aware")


def page_names(token_ids, page_size: int, salt: bytes = b"router") -> list[bytes]:
    """The names of token_ids' full pages: the engine's chained hash (with its salt, the same names)."""
    from engine.kv_cache import page_hashes  # here: the simulator imports this module without torch

    return page_hashes(list(token_ids), page_size, salt or b"router", [])


class Router:
    """in_flight: worker -> the requests it has (the callers' one record of where each request is)."""

    def __init__(
        self,
        workers: Iterable[str],
        policy: str = "cache_aware",
        overlap_weight: float = 1.0,
        cache_pages: int = 512,
        page_size: int = 16,
        salt: bytes = b"",
    ):
        if policy not in POLICIES:
            raise ValueError(f"deployment.routing={policy!r} is not allowed: one of {POLICIES}")
        self.policy, self.overlap_weight = policy, overlap_weight
        self.cache_pages, self.page_size, self.salt = cache_pages, page_size, salt
        self.events = 0  # cache events observed (stored and dropped names)
        self.workers = list(workers)
        self.in_flight: dict[str, set] = {w: set() for w in self.workers}
        self.cached: dict[str, OrderedDict] = {w: OrderedDict() for w in self.workers}  # its belief
        self._pages: dict = {}  # request -> pages of its prompt (the load it adds)
        self._turn = 0
        self.routed_pages = self.overlap_pages = 0  # what it routed, and found cached where it went

    @classmethod
    def of(
        cls, deployment, workers: Iterable[str], cache_pages: int, page_size: int, salt: bytes = b""
    ) -> Router:
        """The router a DeploymentConfig asks for (salt: the workers' page names', from their Ready)."""
        w = deployment.routing_overlap_weight
        return cls(workers, deployment.routing, w, cache_pages, page_size, salt)

    def route_tokens(self, request_id, token_ids, live: list[str]) -> str:
        """route() for a real request: its tokens (prompt, and any outputs it resumes after)."""
        names = page_names(token_ids, self.page_size, self.salt)
        return self.route(request_id, names, len(token_ids), live)

    def finished_tokens(self, worker: str, request_id, token_ids) -> None:
        """finished() for a real request: its prompt and outputs (the last output has no KV yet); with
        cache events the worker says what it named itself."""
        tokens = [] if self.events else list(token_ids)[:-1]
        self.finished(worker, request_id, page_names(tokens, self.page_size, self.salt))

    def observe(self, worker: str, events: list[tuple[bool, bytes]]) -> None:
        """A worker's cache events, in order: (True, name) stored, (False, name) dropped."""
        cached = self.cached.get(worker)
        if cached is None:
            return
        for stored, name in events:
            if stored:
                cached[name] = None
                cached.move_to_end(name)
            else:
                cached.pop(name, None)
        self.events += len(events)
        while len(cached) > self.cache_pages:
            cached.popitem(last=False)

    def route(self, request_id, names: list[Hashable], tokens: int, live: list[str]) -> str:
        """Pick a live worker for a request whose prompt is `tokens` long, its full pages named `names`
        (leading first), and record it there."""
        if not live:
            raise ValueError("no live worker to route to")
        pages = -(-tokens // self.page_size)
        if self.policy == "round_robin":
            target = live[self._turn % len(live)]
            self._turn += 1
        elif self.policy == "least_loaded":
            target = min(live, key=lambda w: len(self.in_flight[w]))
        else:
            target = min(live, key=lambda w: (self.cost(w, names, pages), len(self.in_flight[w])))
        hit = self.overlap(target, names)
        self.routed_pages += len(names)
        self.overlap_pages += hit
        self.in_flight[target].add(request_id)
        self._pages[request_id] = pages
        self._remember(target, names)
        return target

    def overlap(self, worker: str, names: list[Hashable]) -> int:
        """How many of names' leading pages the router believes worker caches."""
        cached = self.cached[worker]
        for n, name in enumerate(names):
            if name not in cached:
                return n
        return len(names)

    def cost(self, worker: str, names: list[Hashable], pages: int) -> float:
        load = sum(self._pages.get(r, 0) for r in self.in_flight[worker])
        return self.overlap_weight * (pages - self.overlap(worker, names)) + load

    def finished(self, worker: str, request_id, names: list[Hashable] = ()) -> None:
        """request_id ended on worker; names: the pages its prompt and reply filled (now cached there)."""
        self.in_flight.get(worker, set()).discard(request_id)
        self._pages.pop(request_id, None)
        if worker in self.cached:
            self._remember(worker, names)

    def moved(self, request_id, dead: str) -> None:
        """request_id leaves dead (to be routed again)."""
        self.in_flight[dead].discard(request_id)
        self._pages.pop(request_id, None)

    def forget(self, worker: str) -> None:
        """worker died (or restarted): its cache is gone."""
        self.cached[worker].clear()

    def _remember(self, worker: str, names: Iterable[Hashable]) -> None:
        cached = self.cached[worker]
        for name in names:
            cached[name] = None
            cached.move_to_end(name)
        while len(cached) > self.cache_pages:
            cached.popitem(last=False)
