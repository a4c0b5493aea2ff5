"""Elastic roles' policy: when to move a worker between prefill and decode (Planner, its config
`deployment.planner`), for the runtime (serving.elastic) and the simulator alike."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.role import Role
from serving.router.policy import ROLES, Router


@dataclass(frozen=True)
class PlannerConfig:
    """`deployment.planner`: elastic roles in a disaggregated deployment (Planner)."""

    enabled: bool = False  # the planner moves workers between prefill and decode by the SLO
    interval_s: float = 5.0  # how often it looks
    min_prefill: int = 1  # it never leaves fewer workers in a role than these
    min_decode: int = 1  # ... and in decode
    patience: int = 2  # looks in a row that must call for the same move before it is made (hysteresis)
    headroom: float = 0.5  # a role gives a worker up only while its own percentile is under this x its SLO
    window_s: float = 20.0  # the TTFT and TPOT percentiles are over requests finished this recently
    # scripted moves, planner or not: [[at_s, worker, role], ...] (seconds since the run started)
    switches: tuple = ()
    # elastic, its workers moved only when the caller asks (Runtime.move: a script, a test, a hook of the
    # main job's driver), with neither the planner nor scripted switches
    manual: bool = False

    def __post_init__(self):
        key = "deployment.planner"
        for name in ("enabled", "manual"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{key}.{name}={getattr(self, name)!r} is not allowed: true or false")
        for name in ("interval_s", "window_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < float("inf"):
                raise ValueError(f"{key}.{name}={v!r} is not allowed: a number of seconds > 0")
        for name in ("min_prefill", "min_decode", "patience"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{key}.{name}={v!r} is not allowed: an integer >= 1")
        h = self.headroom
        if isinstance(h, bool) or not isinstance(h, int | float) or not 0 < h <= 1:
            raise ValueError(f"{key}.headroom={h!r} is not allowed: a number in (0, 1]")
        moves = []
        for move in self.switches:
            ok = isinstance(move, list | tuple) and len(move) == 3
            if ok:
                at, worker, role = move
                ok = not isinstance(at, bool) and isinstance(at, int | float) and at >= 0
                ok = ok and isinstance(worker, str) and bool(worker) and role in ROLES
                role = Role(role) if ok else role
            if not ok:
                raise ValueError(
                    f"{key}.switches: {move!r} is not allowed: each is [at_s >= 0, worker, role], role one "
                    f"of {', '.join(ROLES)}"
                )
            moves.append((float(at), worker, role))
        object.__setattr__(self, "switches", tuple(sorted(moves)))

    @property
    def elastic(self) -> bool:
        """Whether workers may change roles in this deployment."""
        return self.enabled or self.manual or bool(self.switches)


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0-100) of values by nearest rank (None for none)."""
    xs = sorted(values)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, -(-len(xs) * q // 100) - 1))]


class Planner:
    """Moves one worker at a time between prefill and decode as load shifts (Dynamo's SLA planner,
    DistServe's re-planning, in their simplest form), for the real driver and the simulator alike.

    Every interval_s it compares two pressures with the SLO: prefill's = the larger of the measured TTFT
    p90 (requests finished in the last window_s) and the router's predicted wait of a new prompt at the
    least busy prefill worker, over slo.ttft_s; decode's = the measured TPOT p90 over slo.tpot_s. When one
    is over 1 while the other is under `headroom`, and the giving role keeps its minimum, a worker of the
    giving role moves (a decode worker with the fewest requests in flight, a prefill worker with the fewest
    prompt tokens ahead). The same move must be called for `patience` looks in a row, and after a move it
    waits as long again (hysteresis). Scripted `switches` are made at their times whatever it thinks."""

    def __init__(self, config: PlannerConfig, slo: tuple[float, float], clock=time.perf_counter):
        self.config, self.slo, self.clock = config, slo, clock
        self.start = clock()
        self.finished: deque = deque()  # (when, TTFT s or None, TPOT s or None)
        self.next_look = self.start + config.interval_s
        self.streak: tuple = (None, 0)  # (the move called for, looks in a row)
        self.quiet_until = 0.0
        self.script = list(config.switches)
        self.why = ""  # what the last move was made for

    def observe(self, ttft: float | None, tpot: float | None) -> None:
        """A request finished with this TTFT and TPOT (seconds; None where it has none)."""
        self.finished.append((self.clock(), ttft, tpot))

    def pressures(self, router: Router | None = None) -> tuple[float | None, float | None]:
        """(prefill's, decode's): their percentile over its SLO (None: nothing to go by yet)."""
        now = self.clock()
        while self.finished and self.finished[0][0] < now - self.config.window_s:
            self.finished.popleft()
        ttft = percentile([t for _, t, _ in self.finished if t is not None], 90)
        tpot = percentile([t for _, _, t in self.finished if t is not None], 90)
        if router is not None:
            waits = [router._queue_s(p, 0) for p in router.prefill_workers if p in router.prefill_live]
            waits = [w for w in waits if w is not None]
            if waits:
                ttft = max(ttft or 0.0, min(waits))
        return (
            None if ttft is None else ttft / self.slo[0],
            None if tpot is None else tpot / self.slo[1],
        )

    def due(self) -> bool:
        """Whether decide() could move anything now (a scripted move's time, or the planner's next look):
        callers skip gathering the roles until then."""
        now = self.clock()
        scripted = bool(self.script) and self.script[0][0] <= now - self.start
        return scripted or (self.config.enabled and now >= self.next_look)

    def decide(self, roles: dict, router: Router | None = None, busy: bool = False) -> tuple | None:
        """The move to make now: (worker, new role), or None. roles: each live worker's current role
        (prefill | decode); busy: a move is under way (nothing else moves until it is done)."""
        now = self.clock()
        if busy:
            return None
        while self.script and self.script[0][0] <= now - self.start:
            _, worker, role = self.script.pop(0)
            if roles.get(worker) not in (None, role):
                self.why = "scripted"
                return worker, role
        if not self.config.enabled or now < self.next_look:
            return None
        self.next_look = now + self.config.interval_s
        if now < self.quiet_until:
            return None
        prefill_p, decode_p = self.pressures(router)
        count = {r: sum(1 for v in roles.values() if v == r) for r in ROLES}
        c = self.config
        pressure = {Role.PREFILL: prefill_p or 0.0, Role.DECODE: decode_p or 0.0}
        minimum = {Role.PREFILL: c.min_prefill, Role.DECODE: c.min_decode}
        give = next(  # the role with room that can spare a worker for the one over its SLO
            (
                r
                for r in ROLES
                if pressure[r.other] > 1 and pressure[r] < c.headroom and count[r] > minimum[r]
            ),
            None,
        )
        move, n = self.streak
        self.streak = (give, n + 1 if give == move else 1)
        if give is None or self.streak[1] < c.patience:
            return None
        self.streak = (None, 0)
        self.quiet_until = now + c.patience * c.interval_s
        candidates = [w for w, r in roles.items() if r == give]
        if give == Role.DECODE:
            pick = min(candidates, key=lambda w: (len(router.in_flight.get(w, ())) if router else 0, w))
        else:
            pick = min(candidates, key=lambda w: (router._ahead(w) if router else 0, w))
        self.why = (
            f"TTFT at {prefill_p:.2f}x its SLO, TPOT at {decode_p or 0:.2f}x"
            if give == Role.DECODE
            else f"TPOT at {decode_p:.2f}x its SLO, TTFT at {prefill_p or 0:.2f}x"
        )
        return pick, give.other
