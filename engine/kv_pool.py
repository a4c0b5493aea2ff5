"""The shared tier: pages in a pool every worker of a deployment reads and writes (Mooncake Store,
transfer/backends/mooncake.py). A page's key is its namespace and chained-hash name, so any worker with
the same model, dtype, layout, page size and TP finds what any other computed, and a restarted worker
starts warm. Pages are staged through host slots; what the pool returns is used only if its header and
MAC (the deployment's secret) check out, and an object that fails is replaced by the next put of its
page. Which names the pool holds is remembered for a second, so that a request waiting for room does
not ask again every step.
"""

from __future__ import annotations

import time

from torch import Tensor

KNOWN_S = 1.0  # how long an answer of the pool's about a name is trusted
KNOWN_MAX = 50_000


class PoolTier:
    def __init__(self, master: str, metadata: str, memory: Tensor, space: bytes, deadline_s: float):
        from transfer.backends.mooncake import StoreClient

        self.client = StoreClient(master, metadata, memory, deadline_s)
        self.prefix = f"pdkv/{space.hex()}/"
        self._known: dict[bytes, tuple[bool, float]] = {}  # name -> (held?, when asked)
        # names whose object failed its check here: the next put of the page replaces it (else a bad or
        # short object under a key kept that prefix out of the pool for good: puts skip held keys)
        self.rejected: dict[bytes, float] = {}  # name -> when its removal may be tried (monotonic)
        self.puts = 0  # pages this worker put

    def key(self, name: bytes) -> str:
        return self.prefix + name.hex()

    def find(self, names: list[bytes]) -> int:
        """How many leading names the pool holds (0 while it is down)."""
        now, ask = time.monotonic(), []
        for name in names:
            held = self._known.get(name)
            if held is None or now - held[1] > KNOWN_S:
                ask.append(name)
        if ask and self.client.up:
            if len(self._known) > KNOWN_MAX:
                self._known.clear()
            for name, held in zip(ask, self.client.exists([self.key(n) for n in ask]), strict=True):
                self._known[name] = (held, now)
        found = 0
        for name in names:
            held = self._known.get(name)
            if not self.client.up or held is None or not held[0]:
                break
            found += 1
        return found

    def holds(self, name: bytes) -> bool:
        """Known to be in the pool, however long ago (a put of it would most likely be wasted)."""
        held = self._known.get(name)
        return held is not None and held[0]

    def stored(self, name: bytes) -> None:
        self._known[name] = (True, time.monotonic())

    def forget(self, name: bytes) -> None:
        self._known.pop(name, None)

    def reject(self, name: bytes) -> None:
        """name's object failed its check: not known to be held, and replaced when next put."""
        self.forget(name)
        if len(self.rejected) > KNOWN_MAX:
            self.rejected.clear()
        self.rejected[name] = 0.0

    def close(self) -> None:
        self.client.close()
