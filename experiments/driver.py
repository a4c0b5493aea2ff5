"""The main job's load generator: it starts a deployment through the same Runtime the HTTP server runs
(serving.runtime: routing, admission, deaths, migration, restarts, elastic moves), submits
each request of the workload on its schedule (Poisson, a fixed number in flight, a trace, or a multiturn
workload's turns after each reply), and records what comes back. Whatever happens (an error, Ctrl-C,
SIGTERM), every worker process is stopped before `run_deployment` returns. A request's token times are
when its tokens reached the runtime, not any worker's clock.
"""

from __future__ import annotations

import bisect
import logging
import queue
import time
from dataclasses import replace
from pathlib import Path

from experiments.record import DeploymentRun, Request, Turns
from serving.messages import ErrorKind, Submit, Timeline
from serving.runtime import WAIT_MS, Ended, Event, Routed, Runtime, Streamed, start_runtime

log = logging.getLogger(__name__)


def run_deployment(
    config,
    d,
    requests: list[Request],
    progress: bool = True,
    hooks=None,
    log_dir: Path | None = None,
    first_core: int = 0,
    turns: Turns | None = None,
) -> DeploymentRun:
    """Start deployment d's workers, run every request through them, stop them; returns what happened.

    config: the experiment's RunConfig (its workload, SLO, run_timeout_s). hooks: an optional
    callable(run, runtime) called as the run goes (each result, and every WAIT_MS at least): a script's
    or a test's way to act at a point of progress (kill a worker: runtime.fleet.procs; move one:
    runtime.move). log_dir: where each worker writes <name>.log (None:
    workers do not log to files). turns: a multiturn workload's conversations (requests are their first
    turns)."""
    run = DeploymentRun(d, list(requests), turns=turns)
    runtime = None
    try:
        runtime = start_runtime(config, d, log_dir, first_core)
        run.events, run.moves = runtime.events, runtime.moves  # the runtime's, as they happen
        _generate(run, config, runtime, progress, hooks)
    except KeyboardInterrupt:  # SIGTERM (experiments.run raises it) or Ctrl-C: keep what was measured
        run.interrupted = True
        run.end_unfinished(ErrorKind.CANCELLED, "interrupted (SIGTERM or Ctrl-C)")
    finally:
        run.end = run.end or time.perf_counter()
        if runtime is not None:
            run.workers = runtime.fleet.workers()
            runtime.close(on_message=lambda name, msg: _timeline(run, msg))
    return run


def _timeline(run: DeploymentRun, msg) -> None:
    """What workers send while stopping: each one's timeline (every request has ended by then: its
    Result, or the failed one DeploymentRun.end_unfinished made)."""
    if isinstance(msg, Timeline):
        run.timelines.append(msg)


def _generate(run: DeploymentRun, config, runtime: Runtime, progress: bool, hooks) -> None:
    """Submit each request when it is due (and, under fixed concurrency, a slot is free); take each
    result, and a multiturn conversation's next turn after it."""
    from tqdm import tqdm

    w = config.workload
    due = list(run.requests)  # in arrival order
    by_id = {r.request_id: r for r in run.requests}
    results: queue.SimpleQueue = queue.SimpleQueue()  # filled on the runtime's thread
    busy = 0  # submitted, not yet ended
    bar = tqdm(total=len(due), desc=run.deployment.name, disable=not progress, unit="req")

    def sink_of(rid: str):
        def sink(event: Event):  # on the runtime's thread
            match event:
                case Routed(worker):
                    run.tokens[rid] = [worker, 0]
                case Streamed(ids):
                    run.tokens[rid][1] += len(ids)
                case Ended(result):
                    results.put(result)

        return sink

    run.start = time.perf_counter()
    give_up = time.monotonic() + config.run_timeout_s
    try:
        while len(run.results) < len(run.requests):
            now = time.perf_counter()
            while (
                due
                and run.start + due[0].arrival_s <= now
                and (w.arrival != "concurrency" or busy < w.concurrency)
            ):
                req = due.pop(0)
                run.sent[req.request_id] = time.perf_counter()
                submit = Submit(
                    req.request_id,
                    list(req.prompt_ids),
                    replace(w.sampling, max_tokens=req.max_tokens),
                    stream=True,
                )
                runtime.submit(submit, sink_of(req.request_id))
                busy += 1
            # a result frees a slot or ends the run; the next arrival may come sooner (if it is due and
            # waits for a slot, only a result can let it go)
            wait_s = WAIT_MS / 1e3
            until = run.start + due[0].arrival_s - time.perf_counter() if due else 0.0
            if until > 0:
                wait_s = min(wait_s, until)
            try:
                result = results.get(timeout=wait_s)
            except queue.Empty:
                result = None
            while result is not None:
                busy -= 1
                run.results[result.request_id] = result
                bar.update()
                if result.error is None:
                    nxt = run.follow(by_id[result.request_id], result.output_ids, time.perf_counter())
                    if nxt is not None:  # the conversation's next turn, after its think time
                        by_id[nxt.request_id] = nxt
                        bisect.insort(due, nxt, key=lambda r: r.arrival_s)
                        bar.total += 1
                try:
                    result = results.get_nowait()
                except queue.Empty:
                    result = None
            if hooks is not None:
                hooks(run, runtime)
            if time.monotonic() > give_up:
                run.end_unfinished(
                    ErrorKind.DEADLINE, f"not finished within run_timeout_s={config.run_timeout_s}"
                )
                break
    finally:
        run.end = time.perf_counter()
        bar.close()
