"""The record of one run of the main job (what experiments.metrics reads) and the requests it runs.

The main job's driver (experiments.driver), the load client (experiments.load) and the simulator
(experiments.sim) each fill a DeploymentRun; experiments.workload makes the Requests. Nothing here
crosses a socket: the runtime's wire messages are serving/messages.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from serving.config import DeploymentConfig
from serving.messages import Result, Timeline


@dataclass(frozen=True)
class Request:
    """A request of a run: what the driver submits (experiments.workload makes them; how it samples is
    the workload's: workload.sampling, an engine.SamplingParams)."""

    request_id: str
    arrival_s: float  # offset from the start of the run (poisson); 0 under fixed concurrency
    prompt_ids: list[int] | range  # a range stands in for a simulated request's prompt
    max_tokens: int
    conversation: int = -1  # multiturn: its conversation and turn (0, 1, ...)
    turn: int = 0


class Turns(Protocol):
    """A closed-loop workload (experiments.workload.Conversations): the request that follows a reply."""

    def next(self, request: Request, reply_ids: list[int], now_s: float) -> Request | None: ...


@dataclass
class DeploymentRun:
    """The record of one deployment's run: what the driver, the load client and the simulator produce
    and experiments.metrics reads."""

    deployment: DeploymentConfig
    requests: list[Request]
    sent: dict[str, float] = field(default_factory=dict)  # perf_counter when each request was routed
    results: dict[str, Result] = field(default_factory=dict)
    timelines: list[Timeline] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)  # (perf_counter, what happened)
    moves: list[dict] = field(default_factory=list)  # elastic roles: each worker moved (fleet.Elastic)
    start: float = 0.0
    end: float = 0.0
    interrupted: bool = False  # stopped by SIGTERM or Ctrl-C: unfinished requests are recorded as errors
    workers: list[dict] = field(default_factory=list)  # {name, role, node_id, pid} of each worker
    # the main job's driver: request -> [the worker it was routed to, tokens that reached the runtime]
    tokens: dict[str, list] = field(default_factory=dict)
    turns: Turns | None = None  # a multiturn workload: where each reply's next turn comes from

    def end_unfinished(self, kind, error: str, worker: str = "") -> None:
        """Every request without a Result (never sent, or cut off) ends as failed: kind (an ErrorKind)
        and error say why."""
        for r in self.requests:
            if r.request_id not in self.results:
                self.results[r.request_id] = Result.failed(r.request_id, kind, error, worker)

    def follow(self, request: Request, reply_ids: list[int], now: float) -> Request | None:
        """A multiturn workload's next turn after request's reply (ended at perf_counter now), added to
        requests; None when there is none (another workload, or the conversation is over)."""
        if self.turns is None:
            return None
        nxt = self.turns.next(request, reply_ids, now - self.start)
        if nxt is not None:
            self.requests.append(nxt)
        return nxt
