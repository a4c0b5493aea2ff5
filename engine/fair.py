"""Fair share among clients: which waiting sequence is admitted next, and whose running one gives way.

A request's client (SamplingParams.client) is a path of names, from the widest: who sent it (the server
says: an address, or what a trusted proxy says the address behind it is), then who it is for within that
(the request's `user`, or its API key). The sequences a worker has admitted are counted per client at
every level of that path. The next one admitted is the waiting sequence whose client holds the fewest, the
sender compared first and the user within it next (ties: the earliest): weighted fair queuing with equal
weights, over sequences instead of bytes. And while the next one cannot start (no room, or the step's
sequences are full), a running sequence gives way (the scheduler preempts it) when its client holds at
least two more than the next one's, compared at the first level where the two clients differ: after the
exchange the first holds no fewer than the second, so no client's long outputs keep another out and no
sequence is traded back and forth.

With one client, or none named (the main job's workload, LLM.generate), this is first come, first served.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

MAX_CLIENT_LEVELS = 2  # sender, user
MAX_CLIENT_CHARS = 64  # of each level's name (the server sends a digest, never the key or address)


def check_client(client) -> tuple[str, ...] | None:
    """client as SamplingParams keeps it: None, or a tuple of 1-2 names of 1-64 characters."""
    if client is None:
        return None
    if (
        not isinstance(client, list | tuple)
        or not 0 < len(client) <= MAX_CLIENT_LEVELS
        or not all(isinstance(c, str) and 0 < len(c) <= MAX_CLIENT_CHARS for c in client)
    ):
        raise ValueError(
            f"client must be None or a list of 1-{MAX_CLIENT_LEVELS} names of 1-{MAX_CLIENT_CHARS} "
            f"characters, got {client!r}"
        )
    return tuple(client)


def _levels(seq) -> list[tuple[str, ...]]:
    client = seq.params.client or ()
    return [client[: i + 1] for i in range(len(client))] or [()]


class Shares:
    """Admitted sequences counted per client, at every level of its path."""

    def __init__(self, admitted: Iterable = ()):
        self.count: Counter[tuple[str, ...]] = Counter()
        for seq in admitted:
            self.add(seq)

    def add(self, seq, k: int = 1) -> None:
        for key in _levels(seq):
            self.count[key] += k

    def remove(self, seq) -> None:
        self.add(seq, -1)

    def rank(self, seq) -> tuple[int, ...]:
        """What seq's client holds, widest level first: the lower, the sooner it is admitted."""
        return tuple(self.count[key] for key in _levels(seq))

    def gives_way(self, running, newcomer) -> bool:
        """Whether running's client holds at least two more than newcomer's, at the first level where
        their clients differ (never for the same client)."""
        for mine, theirs in zip(_levels(running), _levels(newcomer), strict=False):
            if mine != theirs:
                return self.count[mine] >= self.count[theirs] + 2
        return False
