"""The main job's driver: it starts a deployment's fleet (experiments.deploy.fleet), sends the run's
requests on the workload's schedule (Poisson, a fixed number in flight, a trace, or a multiturn
workload's turns after each reply), routes each through the deployment's Router (and its admission),
resumes on a live worker the requests of one that dies or leaves the decode role, makes an elastic
deployment's moves, and collects the results. Whatever happens (an error, Ctrl-C), every child process
is stopped before `run_deployment` returns. Requests are streamed: workers send each step's new tokens
(Progress) as the HTTP server's clients get them, and a request's per-token times are when its tokens
reached the driver, not the worker's clock.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from pathlib import Path

from experiments.deploy.config import DeploymentConfig, RuntimeConfig
from experiments.deploy.fleet import Elastic, Fleet, start_fleet
from experiments.deploy.messages import (
    DeploymentRun,
    Failed,
    HandedBack,
    Load,
    Progress,
    Ready,
    Request,
    Result,
    Submit,
    Switched,
    Timeline,
    Turns,
)
from experiments.deploy.policy import Router

log = logging.getLogger(__name__)


def run_deployment(
    config: RuntimeConfig,
    d: DeploymentConfig,
    requests: list[Request],
    progress: bool = True,
    hooks=None,
    log_dir: Path | None = None,
    first_core: int = 0,
    turns: Turns | None = None,
) -> DeploymentRun:
    """Start the deployment's workers, run every request through them, stop them; returns what happened.

    hooks: an optional callable(run, procs) called every loop turn (tests use it to kill a worker).
    log_dir: where each worker writes <name>.log (None: workers do not log to files).
    turns: a multiturn workload's conversations (requests are their first turns)."""
    run = DeploymentRun(d, list(requests), turns=turns)
    fleet = None
    try:
        fleet = start_fleet(config, d, log_dir, first_core)
        _serve(run, config, fleet, progress, hooks)
    except KeyboardInterrupt:  # SIGTERM (experiments.run raises it) or Ctrl-C: keep what was measured
        run.interrupted = True
        _unfinished(run, "interrupted (SIGTERM or Ctrl-C)")
    finally:
        if fleet is not None:
            run.workers = fleet.workers()
            fleet.stop(lambda name, msg: _late(run, msg))
    return run


def _late(run: DeploymentRun, msg) -> None:
    """What workers send while stopping: their timelines, and results that were already on the way."""
    if isinstance(msg, Timeline):
        run.timelines.append(msg)
    elif isinstance(msg, Result) and msg.request_id not in run.results:
        run.results[msg.request_id] = msg


def _serve(run: DeploymentRun, config: RuntimeConfig, fleet: Fleet, progress: bool, hooks) -> None:
    from tqdm import tqdm

    w = config.workload
    m = config.model
    prefill = [n for n in fleet.procs if fleet.roles[n] == "prefill"]
    router = Router.of(
        run.deployment, fleet.frontends, m.num_pages, m.page_size, fleet.cache_salt, config.slo, prefill
    )
    frontends = router.workers  # where requests go (an elastic deployment's change as workers move)
    in_flight = router.in_flight  # worker -> its requests
    elastic = (
        Elastic(run.deployment, config.slo, fleet, router, run.events, run.moves)
        if run.deployment.elastic
        else None
    )
    queue = list(run.requests)  # in arrival order
    streamed: dict[str, list[float]] = {}  # request -> when each of its tokens reached the driver
    tokens: dict[str, list[int]] = {}  # request -> its tokens so far (what a migration resumes after)
    migrated: dict[str, int] = {}  # request -> times its worker died under it and it went on elsewhere
    by_id = {r.request_id: r for r in run.requests}
    bar = tqdm(total=len(queue), desc=run.deployment.name, disable=not progress, unit="req")

    def resume(rid: str, left: str, why: str, always: bool = False) -> None:
        """rid leaves worker `left` (dead, or switching roles): it goes on on another live one after the
        tokens it streamed so far (their KV recomputed there) where on_worker_death is migrate (always:
        whatever it is), else it ends with an error."""
        req, so_far = by_id[rid], tokens.get(rid, [])
        live = [n for n in frontends if n not in fleet.dead]
        router.moved(rid, left)
        if (always or run.deployment.on_worker_death == "migrate") and live and len(so_far) < req.max_tokens:
            target = router.route_tokens(rid, list(req.prompt_ids) + so_far, live)
            migrated[rid] = migrated.get(rid, 0) + 1
            if fleet.send(
                target, Submit(rid, req.prompt_ids, req.max_tokens, stream=True, output_ids=so_far)
            ):
                return
            router.moved(rid, target)
        run.results[rid] = _error(rid, why, time.perf_counter())
        bar.update()

    run.start = time.perf_counter()
    give_up = time.monotonic() + config.run_timeout_s
    try:
        while len(run.results) < len(run.requests):
            now = time.perf_counter()
            busy = sum(len(s) for s in in_flight.values())
            while (  # due (0 under concurrency, but a multiturn turn's think time), and a slot free
                queue
                and run.start + queue[0].arrival_s <= now
                and (w.arrival != "concurrency" or busy < w.concurrency)
            ):
                req = queue.pop(0)
                live = [n for n in frontends if n not in fleet.dead]
                run.sent[req.request_id] = time.perf_counter()
                if not live:
                    run.results[req.request_id] = _error(req.request_id, "no live worker to take it", now)
                    bar.update()
                    continue
                target = router.route_tokens(req.request_id, req.prompt_ids, live, admit=True)
                if target is None:  # admission=slo: it would miss the SLO anyway
                    run.results[req.request_id] = _error(req.request_id, router.why, now, "rejected")
                    bar.update()
                    continue
                prefill = router.prefill_of(req.request_id)
                submit = Submit(
                    req.request_id, req.prompt_ids, req.max_tokens, stream=True, prefill_worker=prefill
                )
                fleet.send(target, submit)
                busy += 1
            fleet.sock.poll(_wait_ms(run, queue, w.arrival))
            for name, msg in fleet.receive():
                now = time.perf_counter()
                if isinstance(msg, Progress):
                    for rid, ids, *_ in msg.items:  # tokens as the router sees them arrive
                        if rid in in_flight.get(name, ()):
                            if rid not in streamed:
                                router.first_token(rid)
                            streamed.setdefault(rid, []).extend([now] * len(ids))
                            tokens.setdefault(rid, []).extend(ids)
                elif isinstance(msg, Result):
                    if msg.request_id not in in_flight.get(name, ()):
                        continue  # a late one from a worker the request has migrated from
                    done = list(by_id[msg.request_id].prompt_ids) + list(msg.output_ids)
                    router.finished_tokens(name, msg.request_id, done if msg.error is None else [])
                    tokens.pop(msg.request_id, None)
                    msg.migrations = migrated.pop(msg.request_id, 0)
                    times = streamed.pop(msg.request_id, [])
                    if msg.error is None:  # the last tokens came with the Result
                        msg.token_times = times + [now] * (len(msg.output_ids) - len(times))
                    run.results[msg.request_id] = msg
                    bar.update()
                    if elastic is not None:
                        elastic.finished(msg, run.sent[msg.request_id])
                    nxt = (
                        run.follow(by_id[msg.request_id], msg.output_ids, now) if msg.error is None else None
                    )
                    if nxt is not None:  # the conversation's next turn, after its think time
                        by_id[nxt.request_id] = nxt
                        bisect.insort(queue, nxt, key=lambda r: r.arrival_s)
                        bar.total += 1
                elif isinstance(msg, Load):
                    router.observe_load(name, msg)
                elif isinstance(msg, Ready):  # a restarted worker is back
                    run.events.append((now, f"{name} back after a restart"))
                elif isinstance(msg, HandedBack):  # it is leaving the decode role: they go on elsewhere
                    for rid in msg.request_ids:
                        if rid in in_flight.get(name, ()):
                            resume(
                                rid, name, f"{name} left the decode role and no worker could take it", True
                            )
                elif isinstance(msg, Switched) and elastic is not None:
                    elastic.switched(name, msg)
                elif isinstance(msg, Failed):
                    raise RuntimeError(f"worker {name} failed:\n{msg.error}")
            for name, code in fleet.deaths():
                now = time.perf_counter()
                again = " (restarting)" if name in fleet.restarting else ""
                run.events.append((now, f"{name} exited (code {code}){again}"))
                router.forget(name)
                for rid in list(in_flight.get(name, ())):
                    resume(rid, name, f"worker {name} exited")
            if elastic is not None:
                elastic.tick()
            if hooks is not None:
                hooks(run, fleet.procs)
            if time.monotonic() > give_up:
                _unfinished(run, f"not finished within run_timeout_s={config.run_timeout_s}")
                break
    except (
        KeyboardInterrupt
    ):  # SIGTERM (experiments.run turns it into this) or Ctrl-C: keep what was measured
        run.interrupted = True
        _unfinished(run, "interrupted (SIGTERM or Ctrl-C)")
    finally:
        run.end = time.perf_counter()
        bar.close()


def _wait_ms(run: DeploymentRun, queue: list, arrival: str) -> int:
    """How long the router may sleep on its socket: until the next scheduled arrival, at most 20 ms (a
    worker's message wakes it at once; deaths are looked for at least that often). Waking every
    millisecond instead cost the worker's core ~5-10% of its decode speed here (the woken router lands
    on the core of the worker that woke it)."""
    if queue and (arrival in ("poisson", "trace") or queue[0].arrival_s > 0):
        due = run.start + queue[0].arrival_s - time.perf_counter()
        return max(0, min(20, math.ceil(due * 1e3)))
    return 20


def _unfinished(run: DeploymentRun, error: str) -> None:
    for rid in {r.request_id for r in run.requests} - set(run.results):
        run.results[rid] = _error(rid, error, 0.0)


def _error(request_id: str, error: str, now: float, reason: str = "error") -> Result:
    return Result(request_id, "", [], now, None, [], reason, error)
