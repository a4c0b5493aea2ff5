"""What the prefill side knows of its rails (its agents, one per NIC of a rank: transfer/agents.py): the
rate each moves bytes at, which the writes are striped by, and which are down after a failover and
when they are tried again (transfer/prefill.py fails a rail over; the rate and the back-off live here)."""

from __future__ import annotations

RATE_MEMORY = 0.8  # each finished post keeps this share of an agent's rate figure before it
# a post that finished sooner than this after its rail's last event tells the poll's latency, not the
# rail's rate (a rate from such posts fed back on itself: the rail given more bytes looked faster)
MIN_SAMPLE_S = 0.02
MAX_BACKOFF_S = 30.0  # a rail taken down is tried again after rail_timeout_s, doubling up to this


class Rates:
    """Each agent's bytes per second while it had posts in flight (decayed, RATE_MEMORY per finished post,
    from posts that took MIN_SAMPLE_S or more): what a rank pair's writes are striped over its rails by.
    A rail whose posts stop finishing weighs less and less as its busy time grows."""

    def __init__(self, agents: int):
        self.busy = [0] * agents  # posts in flight
        self.since = [0.0] * agents  # when the agent's current busy stretch (or its last post) began
        self.nbytes = [0.0] * agents
        self.seconds = [0.0] * agents

    def posted(self, agent: int, now: float) -> None:
        if not self.busy[agent]:
            self.since[agent] = now
        self.busy[agent] += 1

    def finished(self, agent: int, nbytes: int, now: float) -> None:
        self.busy[agent] -= 1
        if now - self.since[agent] >= MIN_SAMPLE_S:
            self.nbytes[agent] = RATE_MEMORY * self.nbytes[agent] + nbytes
            self.seconds[agent] = RATE_MEMORY * self.seconds[agent] + (now - self.since[agent])
        self.since[agent] = now

    def reset(self, agent: int, now: float) -> None:
        """The agent's posts are gone (moved to other rails) and its figure with them."""
        self.busy[agent], self.since[agent], self.nbytes[agent], self.seconds[agent] = 0, now, 0.0, 0.0

    def finished_rate(self, agent: int) -> float | None:
        """Bytes/s of the agent's finished posts alone (its stretch now, stuck or not, left out)."""
        return self.nbytes[agent] / self.seconds[agent] if self.seconds[agent] > 0 else None

    def of(self, now: float) -> dict[int, float]:
        """Bytes/s of each agent measured so far (its busy stretch up to now counted)."""
        out = {}
        for a, (b, s) in enumerate(zip(self.nbytes, self.seconds, strict=True)):
            seconds = s + (now - self.since[a] if self.busy[a] else 0.0)
            if b and seconds > 0:
                out[a] = b / seconds
        return out


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
