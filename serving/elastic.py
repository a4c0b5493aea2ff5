"""An elastic deployment's moves between prefill and decode (deployment.planner), made by the runtime."""

from __future__ import annotations

import logging
import time

from serving.messages import Result, Switched
from serving.router.planner import Planner
from serving.router.policy import Router

log = logging.getLogger(__name__)


class Elastic:
    """An elastic deployment's moves (deployment.planner), made by the runtime (the server's and the
    main job's): each turn, tick() asks the Planner (its scripted switches, or its look at the SLO) and
    starts the move it names (the router stops routing to the worker, the fleet tells it); switched()
    makes the worker's new role the router's. Every step is an event (when, what): results.json's."""

    def __init__(self, deployment, slo, fleet, router: Router, events: list, moves: list):
        """events: where (when, what) go; moves: where each move goes, {worker, from, to, at (perf_counter),
        why, seconds (what the switch took of the worker's time, once done)}."""
        self.planner = Planner(deployment.planner, (slo.ttft_s, slo.tpot_s))
        self.fleet, self.router, self.events, self.moves = fleet, router, events, moves

    def tick(self) -> None:
        if not self.planner.due():
            return
        fleet = self.fleet
        roles = {n: r for n, r in fleet.roles.items() if r.switchable and n not in fleet.dead}
        move = self.planner.decide(roles, self.router, busy=bool(fleet.switching))
        if move is not None:
            self.move(*move, self.planner.why)

    def move(self, worker: str, role: str, why: str) -> None:
        """Start moving worker to role (the planner's pick, or one asked for: Runtime.move); a move the
        fleet refuses (the last of its role, one under way) is an event, not an error."""
        now = time.perf_counter()
        try:
            self.fleet.switch(worker, role)
        except ValueError as e:
            self.events.append((now, f"planner: no move: {e}"))
            return
        self.router.leave(worker)
        old = self.fleet.roles[worker]
        self.moves.append({"worker": worker, "from": old, "to": role, "at": now, "why": why})
        self.events.append((now, f"{worker}: {old} -> {role} begins ({why})"))
        log.info("%s: %s -> %s (%s)", worker, old, role, why)

    def switched(self, name: str, msg: Switched) -> None:
        self.router.join(name, msg.role)
        for move in self.moves:
            if move["worker"] == name and "seconds" not in move:
                move["seconds"], move["settle_s"] = msg.seconds, msg.settle_s
        what = (
            f"{name} serves {msg.role} ({msg.seconds:.3f} s of its time, {msg.settle_s:.3f} s of it settling)"
        )
        self.events.append((time.perf_counter(), what))

    def finished(self, result: Result, sent: float) -> None:
        """A request's end, for the planner's percentiles (sent: when it was routed, perf_counter)."""
        if result.error is None and result.token_times:
            times = result.token_times
            tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
            self.planner.observe(times[0] - sent, tpot)
