"""The one request loop: a thread that owns the workers' socket, for the HTTP server and the main job alike.

It routes each request to a decode or colocated worker (the deployment's Router and its admission),
passes what the worker streams to the request's sink, times every token as it arrives, fails only the
request whose routing raised, and when a worker dies, goes silent or leaves the decode role, hands its
requests to another live one (DeploymentConfig.on_worker_death: migrate) or fails them. It records what
happens to the workers (deaths, restarts, failures, elastic moves) as events. serving.http.server
feeds it HTTP requests; the main job's driver (experiments.driver) feeds it a workload's arrivals.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from engine.role import Role
from serving.messages import (
    Cancel,
    ErrorKind,
    Failed,
    HandedBack,
    Load,
    Progress,
    Ready,
    Result,
    Submit,
    Switched,
)
from serving.router.policy import Router

WAIT_MS = 20  # the runtime's longest sleep on its sockets: how often it looks for dead workers
MAX_PREFILL_RETRIES = 3  # times a request whose prefill worker died is prefilled again
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Routed:
    """A request's first event: a worker has it (none comes for a request refused at once)."""

    worker: str


@dataclass(frozen=True)
class Streamed:
    """Tokens of a streamed request, as they reach the runtime."""

    ids: list[int]
    text: str
    logprobs: list


@dataclass(frozen=True)
class Ended:
    """A request's last event: its Result (finished, failed, refused or cancelled)."""

    result: Result


Event = Routed | Streamed | Ended


# what other threads ask of the runtime's thread (Runtime.submit, cancel, move, cancel_all)
@dataclass(frozen=True)
class _Submit:
    msg: Submit
    sink: Callable[[Event], None]


@dataclass(frozen=True)
class _Cancel:
    request_id: str
    at: float  # time.time() when its client went away


@dataclass(frozen=True)
class _Move:
    worker: str
    role: str


@dataclass(frozen=True)
class _CancelAll:
    pass


@dataclass
class Flight:
    """One request in flight: what it was submitted with, where it is, what reached the runtime so far."""

    submit: Submit
    sink: Callable[[Event], None]
    worker: str
    routed_at: float  # perf_counter
    ids: list[int] = field(default_factory=list)  # its tokens so far (what a migration resumes after)
    chars: int = 0  # characters of their text sent on to the client
    times: list[float] = field(default_factory=list)  # perf_counter when each token reached the runtime
    logprobs: list = field(default_factory=list)
    migrations: int = 0  # times it went on on another worker after its own died or left
    prefill_retries: int = 0  # times it was prefilled again after its prefill worker died


def start_runtime(config, d, log_dir=None, first_core: int = 0) -> Runtime:
    """Start deployment d's workers (serving.fleet.fleet) and the Runtime over them, its router made
    from the deployment (routing, admission) and the model's cache; the one way both the server and the
    main job start a deployment."""
    from serving.fleet.fleet import start_fleet

    fleet = start_fleet(config, d, log_dir, first_core)
    try:
        m = config.model
        prefill = [n for n in fleet.procs if fleet.roles[n] == Role.PREFILL]
        dp = d.dp_of(d.roles[-1])  # the routed workers' DP groups
        router = Router.of(
            d, fleet.frontends, m.num_pages, m.page_size, fleet.cache_salt, config.slo, prefill, dp
        )
        for name in prefill:  # start_fleet saw each one's Ready
            router.up(name)
        for name, (prefill_tok_s, step_s) in fleet.speeds.items():
            router.measured(name, prefill_tok_s, step_s)
        return Runtime(fleet, d.on_worker_death, config.transfer.peer_timeout_s, router, d, config.slo)
    except BaseException:
        fleet.stop()
        raise


class Runtime:
    """A served deployment: its workers (a Fleet), the router, and the thread that talks to them.

    submit() and cancel() may be called from any thread; each request's sink(event) is called on the
    runtime's thread with Routed once a worker has it (not for one refused at once), Streamed as a
    streamed request's tokens come, and finally Ended with its Result, whose token_times are when each
    token reached the runtime."""

    def __init__(
        self,
        fleet,
        on_worker_death: str = "migrate",
        silent_after_s: float = 10.0,
        router: Router | None = None,
        deployment=None,
        slo=None,
    ):
        """on_worker_death: DeploymentConfig's (migrate | fail); silent_after_s: a worker not heard from
        for this long (frozen, or cut off) makes the deployment unhealthy (GET /health 503) and its
        requests go on elsewhere; router: which worker takes each request (default: cache_aware over the
        fleet's frontends); deployment, slo: an elastic deployment's (DeploymentConfig.planner) moves its
        workers between roles."""
        import zmq

        from serving.elastic import Elastic

        self.fleet, self.on_worker_death, self.silent_after_s = fleet, on_worker_death, silent_after_s
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        # a byte down this pipe wakes the runtime's poll for a new command; otherwise it sleeps until a
        # worker's message or WAIT_MS (a thread waking every millisecond lands on a worker's core and
        # slows its steps)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._poller = zmq.Poller()
        self._poller.register(fleet.sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self.router = router or Router(fleet.frontends)
        self.in_flight = self.router.in_flight  # worker -> its requests
        self.flights: dict[str, Flight] = {}  # request -> its state, while in flight
        self.load: dict[str, Load] = {}
        self.prefill_resent = 0  # requests sent again after their prefill worker died
        self.events: list[tuple[float, str]] = []  # (perf_counter, what happened to the workers)
        self.moves: list[dict] = []  # elastic roles: each worker moved (serving.elastic)
        self.elastic = None
        if deployment is not None and deployment.elastic:
            self.elastic = Elastic(deployment, slo, fleet, self.router, self.events, self.moves)
        # worker -> when it last sent anything (time.monotonic); from now on for each: one that never
        # speaks again is silent after silent_after_s
        self.heard: dict[str, float] = dict.fromkeys(fleet.procs, time.monotonic())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="runtime", daemon=True)
        self._thread.start()

    @property
    def dead(self) -> set[str]:
        """Workers down (a restarting one until it is back)."""
        return self.fleet.dead

    @property
    def silent(self) -> list[str]:
        """Workers up but not heard from for silent_after_s (a frozen process)."""
        now = time.monotonic()
        return [
            n for n, t in list(self.heard.items()) if n not in self.dead and now - t > self.silent_after_s
        ]

    @property
    def healthy(self) -> bool:
        """Every worker up and talking (GET /health)."""
        return not self.dead and not self.silent and self._thread.is_alive()

    @property
    def can_serve(self) -> bool:
        """Some decode or colocated worker is up: a degraded deployment serves with the workers it has."""
        return self._thread.is_alive() and bool(self._live())

    @property
    def num_in_flight(self) -> int:
        return len(self.flights)

    def owner(self, request_id: str) -> str | None:
        """The worker that has request_id now (None: not in flight)."""
        flight = self.flights.get(request_id)
        return flight.worker if flight is not None else None

    def _live(self) -> list[str]:
        """The decode or colocated workers requests may go to now (up, and heard from lately)."""
        silent = set(self.silent)
        return [n for n in self.router.workers if n not in self.dead and n not in silent]

    def submit(self, msg: Submit, sink: Callable[[Event], None]) -> None:
        self._command(_Submit(msg, sink))

    def cancel(self, request_id: str) -> None:
        self._command(_Cancel(request_id, time.time()))

    def move(self, worker: str, role: str) -> None:
        """Move an elastic deployment's worker to role (prefill | decode) as the planner would: its
        requests go on elsewhere first (events and moves record it)."""
        if self.elastic is None:
            raise ValueError("moving workers needs an elastic deployment (deployment.planner)")
        self._command(_Move(worker, role))

    def cancel_all(self) -> None:
        """Cancel every request in flight (a stop whose drain time ran out)."""
        self._command(_CancelAll())

    def _command(self, command) -> None:
        self.commands.put(command)
        os.write(self._wake_w, b"c")

    def close(self, timeout_s: float = 10.0, on_message=None) -> None:
        """Stop the thread, then every worker (Stop; killed after timeout_s) and the run's directory;
        on_message(name, msg) sees what the workers send meanwhile (their Timelines, late Results)."""
        self._stop.set()
        os.write(self._wake_w, b"q")
        self._thread.join(timeout=30)
        try:
            self.fleet.stop(on_message, timeout_s=timeout_s)
        finally:
            os.close(self._wake_r)
            os.close(self._wake_w)

    # -- the loop (its own thread)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception:  # never leave requests hanging: fail them and keep going
                log.exception("runtime loop")
                for rid in list(self.flights):
                    self._finish(Result.failed(rid, ErrorKind.INTERNAL, "internal error in the server"))

    def _turn(self) -> None:
        self._commands()
        if self._wake_r in dict(self._poller.poll(WAIT_MS)):
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        now = time.monotonic()
        for name, msg in self.fleet.receive():
            self.heard[name] = now
            self._message(name, msg)
        self._leave_silent()
        for name, code in self.fleet.deaths():  # a dead prefill worker's decode peers end its requests
            again = " (restarting)" if name in self.fleet.restarting else ""
            self.events.append((time.perf_counter(), f"{name} exited (code {code}){again}"))
            self.load.pop(name, None)
            self.heard.pop(name, None)
            self.router.forget(name)
            self._left(name, ErrorKind.WORKER_LOST, f"worker {name} exited")
        if self.elastic is not None:
            self.elastic.tick()

    def _commands(self) -> None:
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            try:
                match command:
                    case _Submit(msg, sink):
                        self._route(msg, sink)
                    case _Move(worker, role):
                        self.elastic.move(worker, role, "asked")
                    case _CancelAll():
                        for rid, flight in list(self.flights.items()):
                            self.fleet.send(flight.worker, Cancel(rid, time.time()))
                    case _Cancel(rid, at) if rid in self.flights:
                        flight = self.flights[rid]
                        self.fleet.send(flight.worker, Cancel(rid, at))
                        if not flight.ids:  # it may be computing on a prefill worker: stopped there now,
                            # not once its decode worker (busy, or frozen) passes the cancel on
                            for name in self.router.prefill_live:
                                self.fleet.send(name, Cancel(rid, at))
            except Exception as e:  # one request's failure is its own: the loop and the others go on
                log.exception("runtime: %s failed", type(command).__name__.strip("_"))
                if isinstance(command, _Submit):
                    why = f"the server could not route it: {e!r}"
                    self._fail_one(command.msg.request_id, command.sink, why)

    def _message(self, name: str, msg) -> None:
        """One message of worker `name`'s: every kind a worker sends is handled here, and only here."""
        if isinstance(msg, Progress):
            for rid, ids, text, logprobs in msg.items:
                flight = self.flights.get(rid)
                if flight is None or flight.worker != name:
                    continue  # ended, or a late one from a worker it has migrated from
                self.router.first_token(rid)
                flight.ids += ids
                flight.times += [time.perf_counter()] * len(ids)
                flight.logprobs += logprobs
                if flight.submit.stream:  # streamed from the worker for the router's and the clock's sake
                    flight.chars += len(text)
                    flight.sink(Streamed(ids, text, logprobs))
        elif isinstance(msg, Result):
            flight = self.flights.get(msg.request_id)
            if flight is not None and flight.worker == name:  # not a late one from before a migration
                if not (msg.prefill_lost and self._prefill_again(msg, flight)):
                    self._finish(msg)
        elif isinstance(msg, Load):
            self.load[name] = msg
            self.router.observe_load(name, msg)
        elif isinstance(msg, Ready):  # a restarted worker is back (Fleet.receive reconnected it)
            self.events.append((time.perf_counter(), f"{name} back after a restart"))
            self.router.up(name)
            self.router.measured(name, msg.prefill_tok_s, msg.decode_step_s)
        elif isinstance(msg, HandedBack):  # it leaves the decode role: they go on elsewhere
            for rid in msg.request_ids:
                flight = self.flights.get(rid)
                if flight is not None and flight.worker == name and not self._migrate(flight, always=True):
                    self._finish(Result.failed(rid, ErrorKind.WORKER_LOST, f"{name} left decoding", name))
        elif isinstance(msg, Switched) and self.elastic is not None:
            self.elastic.switched(name, msg)
        elif isinstance(msg, Failed):  # it exits next: deaths() then hands its requests on
            log.error("worker %s failed:\n%s", name, msg.error)
            last = msg.error.strip().splitlines()[-1] if msg.error.strip() else "no traceback"
            self.events.append((time.perf_counter(), f"{name} failed: {last}"))

    def _left(self, name: str, kind: ErrorKind, error: str) -> None:
        """Worker `name` has gone (died, silent): its requests go on elsewhere (on_worker_death: migrate)
        or end with the error."""
        for rid in list(self.in_flight.get(name, ())):
            flight = self.flights.get(rid)
            if flight is None:
                self.router.moved(rid, name)
            elif not self._migrate(flight):
                self._finish(Result.failed(rid, kind, error, name))

    def _leave_silent(self) -> None:
        """A decode or colocated worker silent past silent_after_s (frozen: SIGSTOP, a wedged step) is
        treated as dead for its requests: they go on elsewhere (on_worker_death), and it is told to cancel
        them, which it does if it ever wakes (its late messages about them are ignored: not the owner)."""
        for name in self.silent:
            rids = list(self.in_flight.get(name, ()))
            for rid in rids:
                self.fleet.send(name, Cancel(rid))
            self._left(name, ErrorKind.WORKER_LOST, f"worker {name} is silent for {self.silent_after_s} s")
            if rids:
                log.warning("worker %s is silent: its %d requests went on elsewhere", name, len(rids))

    def _prefill_again(self, result: Result, flight: Flight) -> bool:
        """A request that failed only because its prefill worker died (or went silent) mid-transfer is
        sent again, its prompt prefilled by a live prefill worker (or a restarted one): a prefill death
        loses nothing. At most MAX_PREFILL_RETRIES times; False: it ends as it is."""
        if self.on_worker_death != "migrate" or flight.prefill_retries >= MAX_PREFILL_RETRIES:
            return False
        if result.output_ids:
            return False
        flight.prefill_retries += 1
        self.prefill_resent += 1
        log.warning(
            "request %s: %s; prefilled again (%d)", result.request_id, result.error, flight.prefill_retries
        )
        return self._migrate(flight, count=False, always=True)

    def _migrate(self, flight: Flight, count: bool = True, always: bool = False) -> bool:
        """Resubmit a request whose worker died (or left the decode role) to another live one: its prompt
        and the tokens that reached the runtime so far (their KV is recomputed there), so the client's
        stream goes on. False when no worker can take it, or on_worker_death is fail (always: whatever it
        is). count: a migration (not a prefill sent again)."""
        rid, msg, left = flight.submit.request_id, flight.submit, flight.worker
        live = self._live()
        self.router.moved(rid, left)
        if not (always or self.on_worker_death == "migrate") or not live:
            return False
        if len(flight.ids) >= msg.sampling.max_tokens:
            return False
        tokens = list(msg.prompt_ids) + list(flight.ids)
        target = self.router.route_tokens(rid, tokens, live, cache_salt=msg.sampling.cache_salt)
        resumed = msgspec.structs.replace(
            msg,
            output_ids=list(flight.ids),
            text_sent=flight.chars,
            after=None,
            stream=True,
            dp_rank=self.router.dp_rank_of(rid),
        )
        flight.worker = target
        flight.migrations += count
        log.warning(
            "request %s goes on on %s after %s (%d tokens so far)", rid, target, left, len(flight.ids)
        )
        return self.fleet.send(target, resumed)

    def _route(self, msg: Submit, sink) -> None:
        rid = msg.request_id
        if rid in self.flights:
            sink(Ended(Result.failed(rid, ErrorKind.BAD_REQUEST, f"request_id {rid!r} is already in flight")))
            return
        live = self._live()
        if not live:
            sink(Ended(Result.failed(rid, ErrorKind.WORKER_LOST, "no live worker")))
            return
        tokens = list(msg.prompt_ids) + list(msg.output_ids)
        first = self.owner(msg.after) if msg.after is not None else None
        salt = msg.sampling.cache_salt
        if first in live:  # n > 1: a later completion goes where the first one went (admitted with it)
            target = self.router.route_tokens(rid, tokens, [first], cache_salt=salt)
        else:
            msg = msgspec.structs.replace(msg, after=None)
            target = self.router.route_tokens(
                rid,
                tokens,
                live,
                admit=True,
                cache_salt=salt,
                sequences=msg.completions,
                max_tokens=msg.sampling.max_tokens,
            )
        if target is None:  # admission=slo: it would miss the SLO anyway
            sink(Ended(Result.failed(rid, ErrorKind.REJECTED, self.router.why)))
            return
        self.flights[rid] = Flight(msg, sink, target, time.perf_counter())
        # the router learns when each prompt's first token comes (its queue, its admission) and the
        # runtime times every token: the worker streams every request; only a streamed one's tokens
        # reach its client before the end
        while not self.fleet.send(target, self._wire(msg)):
            # gone before the runtime heard (its death is seen with the next look at the processes): the
            # request goes to another live worker, as a migration would take it
            self.router.moved(rid, target)
            live = [w for w in live if w != target]
            if self.on_worker_death != "migrate" or not live:
                self._finish(Result.failed(rid, ErrorKind.WORKER_LOST, f"worker {target} is gone", target))
                return
            msg = msgspec.structs.replace(msg, after=None)
            target = self.router.route_tokens(rid, tokens, live, cache_salt=salt)
            self.flights[rid].worker = target
        sink(Routed(target))

    def _wire(self, msg: Submit) -> Submit:
        """msg as a worker gets it: streamed, with the prefill worker and DP group the router chose."""
        rid = msg.request_id
        return msgspec.structs.replace(
            msg, stream=True, prefill_worker=self.router.prefill_of(rid), dp_rank=self.router.dp_rank_of(rid)
        )

    def _fail_one(self, request_id: str, sink, error: str) -> None:
        """End one request with an error; if a worker has it, cancel it there (its pages come back)."""
        flight = self.flights.get(request_id)
        if flight is not None:
            try:
                self.fleet.send(flight.worker, Cancel(request_id))
            except Exception:
                log.exception("runtime: cancelling %s", request_id)
        result = Result.failed(request_id, ErrorKind.INTERNAL, error, flight.worker if flight else "")
        if flight is None:
            sink(Ended(result))
        else:
            self._finish(result)

    def _finish(self, result: Result) -> None:
        flight = self.flights.pop(result.request_id, None)
        if flight is None:
            return
        result.migrations = flight.migrations
        now = time.perf_counter()
        if result.error is None:  # every token timed on arrival here; the last ones came with the Result
            result.token_times = flight.times + [now] * (len(result.output_ids) - len(flight.times))
        if flight.migrations and result.logprobs is not None:  # the worker it went on on has only its own
            result.logprobs = (
                flight.logprobs[: len(result.output_ids) - len(result.logprobs)] + result.logprobs
            )
        if self.elastic is not None:
            self.elastic.finished(result, flight.routed_at)
        msg = flight.submit
        if flight.worker in self.in_flight:
            done = result.error is None  # what its worker now caches
            tokens = list(msg.prompt_ids) + list(result.output_ids) if done else []
            self.router.finished_tokens(flight.worker, result.request_id, tokens, msg.sampling.cache_salt)
        flight.sink(Ended(result))
