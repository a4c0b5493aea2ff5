"""What the prefill side knows of its rails (its agents, one per NIC of a rank: transfer/agents.py): the
rate each moves bytes at, which the writes are striped by; which are down after a failover and when they
are tried again (transfer/prefill.py fails a rail over; the rate and the back-off live here); and how
large a post may be, so that a rail that moves says so often."""

from __future__ import annotations

import numpy as np

HALF_LIFE_S = 1.0  # a rail's rate figure halves its weight on what it measured this long ago
MAX_BACKOFF_S = 30.0  # a rail taken down is tried again after rail_timeout_s, doubling up to this
# rails' weights are their rates, none below this share of the fastest's: a rate read off posts that
# wait on latency more than on the link grows with the bytes a rail is given, and would feed on itself
MIN_WEIGHT = 0.5
# a post carries at most this many bytes (more go as several): each post that finishes tells the rail
# moves, so a rail's silence past rail_timeout_s means stuck, not a large post on a slow link
MAX_POST_BYTES = 1 << 20


class Rates:
    """Each agent's bytes per second, measured where the link, not the latency, set it: a post counts
    when it finished with another behind it on its agent (a backlog), over the time since the agent's
    previous event. Both sums decay with time (HALF_LIFE_S), so posts finishing together at one poll
    count whole. What a rank pair's writes are striped over its rails by."""

    def __init__(self, agents: int):
        self.busy = [0] * agents  # posts in flight
        self.since = [0.0] * agents  # the agent's last event: its busy stretch began, or a post finished
        self.nbytes = [0.0] * agents
        self.seconds = [0.0] * agents

    def posted(self, agent: int, now: float) -> None:
        if not self.busy[agent]:
            self.since[agent] = now
        self.busy[agent] += 1

    def finished(self, agent: int, nbytes: int, now: float) -> None:
        if self.busy[agent] >= 2:  # more behind it: the link was busy all this while
            keep = 0.5 ** ((now - self.since[agent]) / HALF_LIFE_S)
            self.nbytes[agent] = keep * self.nbytes[agent] + nbytes
            self.seconds[agent] = keep * self.seconds[agent] + (now - self.since[agent])
        self.busy[agent] -= 1
        self.since[agent] = now

    def reset(self, agent: int, now: float) -> None:
        """The agent's posts are gone (moved to other rails) and its figure with them."""
        self.busy[agent], self.since[agent], self.nbytes[agent], self.seconds[agent] = 0, now, 0.0, 0.0

    def finished_rate(self, agent: int) -> float | None:
        """Bytes/s of the agent's finished posts alone (its stretch now, stuck or not, left out)."""
        return self.nbytes[agent] / self.seconds[agent] if self.seconds[agent] > 0 else None

    def weights(self) -> dict[int, float]:
        """Each measured agent's weight for striping: its rate, at least MIN_WEIGHT of the fastest's."""
        rates = {a: r for a in range(len(self.busy)) if (r := self.finished_rate(a))}
        top = max(rates.values(), default=0.0)
        return {a: max(r, MIN_WEIGHT * top) for a, r in rates.items()}


class Rails:
    """A side's rails: their rates, and those taken down (until when, and the next back-off)."""

    def __init__(self, agents: int, timeout_s: float):
        self.rates = Rates(agents)
        self.timeout_s = timeout_s
        self.down_until: dict[int, float] = {}  # agent -> when its rail is tried again
        self.retired: set[int] = set()  # agents closed for good, their successor not yet started
        self._backoff: dict[int, float] = {}  # agent -> the back-off its next fault gets

    def up(self, agent: int, now: float) -> bool:
        """Whether the rail may carry writes (never taken down, or its back-off over and its agent
        started again)."""
        return agent not in self.retired and self.down_until.get(agent, 0.0) <= now

    def due(self, now: float) -> list[int]:
        """Retired agents whose back-off is over: their successor may be started."""
        return [a for a in sorted(self.retired) if self.down_until.get(a, 0.0) <= now]

    def take_down(self, agent: int, now: float) -> None:
        """Its posts were moved away: none goes its way for a back-off (rail_timeout_s, doubling on each
        fault until a post finishes there again, at most MAX_BACKOFF_S)."""
        self.rates.reset(agent, now)
        backoff = self._backoff.get(agent, self.timeout_s)
        self.down_until[agent] = now + backoff
        self._backoff[agent] = min(2 * backoff, MAX_BACKOFF_S)

    def moved(self, agent: int) -> None:
        """A post finished on the rail: a later fault backs off anew."""
        self._backoff.pop(agent, None)


def parts_of(ops) -> list:
    """A post's writes as posts of at most MAX_POST_BYTES each (a write larger than that alone)."""
    if isinstance(ops, list) or int(ops[:, 4].sum()) <= MAX_POST_BYTES:
        return [ops]
    cuts, size = [], 0
    for i, nbytes in enumerate(ops[:, 4].tolist()):
        if size and size + nbytes > MAX_POST_BYTES:
            cuts.append(i)
            size = 0
        size += nbytes
    return np.split(ops, cuts)
