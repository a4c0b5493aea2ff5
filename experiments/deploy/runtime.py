"""The driver side of the HTTP server: one thread owns the workers' socket (experiments.deploy.server).

It routes each request to a decode or colocated worker (the deployment's Router), passes the tokens it
streams to the request's sink, fails only the request whose routing raised, and, when a worker dies,
hands its requests to another live one (DeploymentConfig.on_worker_death: migrate) or fails them.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import msgspec

from experiments.deploy.messages import Cancel, Failed, HandedBack, Load, Progress, Result, Submit, Switched
from experiments.deploy.policy import Router

WAIT_MS = 20  # the runtime's longest sleep on its sockets: how often it looks for dead workers
MAX_PREFILL_RETRIES = 3  # times a request whose prefill worker died is prefilled again
log = logging.getLogger(__name__)


class Runtime:
    """A served deployment: its workers (a Fleet), the router, and the thread that talks to them.

    submit() and cancel() may be called from any thread; each request's sink(kind, message) is called
    on the runtime's thread with ("routed", worker) once a worker has it (not for one refused at once),
    ("progress", (token ids, text)) for streamed requests and finally ("result", Result)."""

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
        for this long (frozen, or cut off) makes the deployment unhealthy (GET /health 503); router:
        which worker takes each request (default: cache_aware over the fleet's frontends); deployment,
        slo: an elastic deployment's (DeploymentConfig.planner) moves its workers between roles."""
        import zmq

        from experiments.deploy.fleet import Elastic

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
        self.sinks: dict[str, object] = {}
        self.router = router or Router(fleet.frontends)
        self.in_flight = self.router.in_flight  # worker -> its requests
        self.owner: dict[str, str] = {}  # request -> the worker it went to
        self.load: dict[str, Load] = {}
        self.requests: dict[str, Submit] = {}  # request -> what it was submitted with
        self.streamed: dict[str, list] = {}  # streamed request -> [token ids, characters, token times] sent
        self.migrated: dict[str, tuple[int, list[float]]] = {}  # -> (migrations, token times before)
        self.routed_at: dict[str, float] = {}  # request -> when it was routed (perf_counter)
        self.prefill_retries: dict[str, int] = {}  # request -> times it was prefilled again
        self.prefill_resent = 0  # requests sent again after their prefill worker died
        self.events: list[tuple[float, str]] = []  # elastic roles: (perf_counter, what happened)
        self.moves: list[dict] = []
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

    def _live(self) -> list[str]:
        """The decode or colocated workers requests may go to now (up, and heard from lately)."""
        silent = set(self.silent)
        return [n for n in self.router.workers if n not in self.dead and n not in silent]

    def submit(self, msg: Submit, sink) -> None:
        self.commands.put(("submit", msg, sink))
        os.write(self._wake_w, b"s")

    def cancel(self, request_id: str) -> None:
        self.commands.put(("cancel", request_id, None))
        os.write(self._wake_w, b"c")

    def cancel_all(self) -> None:
        """Cancel every request in flight (a stop whose drain time ran out)."""
        self.commands.put(("cancel_all", None, None))
        os.write(self._wake_w, b"c")

    @property
    def num_in_flight(self) -> int:
        return len(self.sinks)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread, then every worker (Stop; killed after timeout_s) and the run's directory."""
        self._stop.set()
        os.write(self._wake_w, b"q")
        self._thread.join(timeout=30)
        self.fleet.stop(timeout_s=timeout_s)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception:  # never leave requests hanging: fail them and keep going
                log.exception("runtime loop")
                for rid in list(self.sinks):
                    self._finish(Result(rid, "", [], 0.0, None, [], "error", "internal error in the server"))

    def _turn(self) -> None:
        while True:
            try:
                kind, arg, sink = self.commands.get_nowait()
            except queue.Empty:
                break
            try:
                if kind == "submit":
                    self._route(arg, sink)
                elif kind == "cancel_all":
                    for rid, owner in list(self.owner.items()):
                        self.fleet.send(owner, Cancel(rid))
                elif arg in self.owner:
                    self.fleet.send(self.owner[arg], Cancel(arg))
            except Exception as e:  # one request's failure is its own: the loop and the others go on
                log.exception("runtime: %s of a request failed", kind)
                if kind == "submit":
                    self._fail_one(arg.request_id, sink, f"the server could not route it: {e!r}")
        if self._wake_r in dict(self._poller.poll(WAIT_MS)):
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        now = time.monotonic()
        for name, msg in self.fleet.receive():
            self.heard[name] = now
            if isinstance(msg, Progress):
                for rid, ids, text, logprobs in msg.items:
                    sink = self.sinks.get(rid)
                    if sink is not None and self.owner.get(rid) == name:
                        self.router.first_token(rid)
                        if not self.requests[rid].stream:
                            continue  # streamed from the worker only for the router's sake
                        sent = self.streamed.setdefault(rid, [[], 0, [], []])
                        sent[0] += ids
                        sent[1] += len(text)
                        sent[2] += [time.perf_counter()] * len(ids)
                        sent[3] += logprobs
                        sink("progress", (ids, text, logprobs))
            elif isinstance(msg, Result):
                if self.owner.get(msg.request_id) == name:  # not a late one from before a migration
                    if not (msg.prefill_lost and self._prefill_again(msg, name)):
                        self._finish(msg)
            elif isinstance(msg, Load):
                self.load[name] = msg
                self.router.observe_load(name, msg)
            elif isinstance(msg, HandedBack):  # it leaves the decode role: they go on elsewhere
                for rid in msg.request_ids:
                    if self.owner.get(rid) == name and not self._migrate(rid, name):
                        self._finish(Result(rid, name, [], 0.0, None, [], "error", f"{name} left decoding"))
            elif isinstance(msg, Switched) and self.elastic is not None:
                self.elastic.switched(name, msg)
            elif isinstance(msg, Failed):
                log.error("worker %s failed:\n%s", name, msg.error)
        self._leave_silent()
        for name, _ in self.fleet.deaths():  # a dead prefill worker's decode peers end its requests
            self.load.pop(name, None)
            self.heard.pop(name, None)
            self.router.forget(name)
            for rid in list(self.in_flight.get(name, ())):
                if not (self.on_worker_death == "migrate" and self._migrate(rid, name)):
                    self._finish(Result(rid, name, [], 0.0, None, [], "error", f"worker {name} exited"))
        if self.elastic is not None:
            self.elastic.tick()

    def _leave_silent(self) -> None:
        """A decode or colocated worker silent past silent_after_s (frozen: SIGSTOP, a wedged step) is
        treated as dead for its requests: they go on elsewhere (on_worker_death), and it is told to cancel
        them, which it does if it ever wakes (its late messages about them are ignored: not the owner)."""
        for name in self.silent:
            rids = list(self.in_flight.get(name, ()))
            for rid in rids:
                self.fleet.send(name, Cancel(rid))
                if not (self.on_worker_death == "migrate" and self._migrate(rid, name)):
                    error = f"worker {name} is silent for {self.silent_after_s} s"
                    self._finish(Result(rid, name, [], 0.0, None, [], "error", error))
            if rids:
                log.warning("worker %s is silent: its %d requests went on elsewhere", name, len(rids))

    def _prefill_again(self, result: Result, worker: str) -> bool:
        """A request that failed only because its prefill worker died (or went silent) mid-transfer is
        sent again, its prompt prefilled by a live prefill worker (or a restarted one): a prefill death
        loses nothing under HTTP either. At most MAX_PREFILL_RETRIES times; False: it ends as it is."""
        rid = result.request_id
        tries = self.prefill_retries.get(rid, 0)
        if self.on_worker_death != "migrate" or tries >= MAX_PREFILL_RETRIES or result.output_ids:
            return False
        self.prefill_retries[rid] = tries + 1
        self.prefill_resent += 1
        log.warning("request %s: %s; prefilled again (%d)", rid, result.error, tries + 1)
        return self._migrate(rid, worker, count=False)

    def _migrate(self, request_id: str, dead: str, count: bool = True) -> bool:
        """Resubmit a request of a worker that died (or left the decode role) to another live one: its
        prompt and the tokens it streamed so far (their KV is recomputed there), so the client's stream
        goes on. False when no worker can take it. count: a migration (not a prefill sent again)."""
        msg = self.requests.get(request_id)
        live = self._live()
        sent = self.streamed.get(request_id, [[], 0, [], []])
        if msg is None or not live or len(sent[0]) >= msg.max_tokens:
            return False
        resumed = msgspec.structs.replace(
            msg, output_ids=list(sent[0]), text_sent=sent[1], after=None, stream=True
        )
        self.router.moved(request_id, dead)
        tokens = list(msg.prompt_ids) + list(sent[0])
        target = self.router.route_tokens(request_id, tokens, live, cache_salt=msg.cache_salt)
        self.owner[request_id] = target
        times = self.migrated.get(request_id, (0,))[0] + count
        self.migrated[request_id] = (times, list(sent[2]), list(sent[3]))
        log.warning(
            "request %s goes on on %s after %s (%d tokens so far)", request_id, target, dead, len(sent[0])
        )
        return self.fleet.send(target, resumed)

    def _route(self, msg: Submit, sink) -> None:
        live = self._live()
        if not live:
            sink("result", Result(msg.request_id, "", [], 0.0, None, [], "error", "no live worker"))
            return
        tokens = list(msg.prompt_ids) + list(msg.output_ids)
        first = self.owner.get(msg.after) if msg.after is not None else None
        salt = msg.cache_salt
        if first in live:  # n > 1: a later completion goes where the first one went (admitted with it)
            target = self.router.route_tokens(msg.request_id, tokens, [first], cache_salt=salt)
        else:
            msg = msgspec.structs.replace(msg, after=None)
            target = self.router.route_tokens(msg.request_id, tokens, live, admit=True, cache_salt=salt)
        if target is None:  # admission=slo: it would miss the SLO anyway
            sink("result", Result(msg.request_id, "", [], 0.0, None, [], "rejected", self.router.why))
            return
        self.sinks[msg.request_id] = sink
        self.requests[msg.request_id] = msg
        self.routed_at[msg.request_id] = time.perf_counter()
        self.owner[msg.request_id] = target
        # the router learns when each prompt's first token comes (its queue, its admission): the worker
        # streams every request; only a streamed one's tokens reach its client before the end
        prefill = self.router.prefill_of(msg.request_id)
        wire = msgspec.structs.replace(msg, stream=True, prefill_worker=prefill)
        if not self.fleet.send(target, wire):
            self._finish(
                Result(msg.request_id, target, [], 0.0, None, [], "error", f"worker {target} is gone")
            )
            return
        sink("routed", target)

    def _fail_one(self, request_id: str, sink, error: str) -> None:
        """End one request with an error; if a worker has it, cancel it there (its pages come back)."""
        owner = self.owner.get(request_id)
        if owner is not None:
            try:
                self.fleet.send(owner, Cancel(request_id))
            except Exception:
                log.exception("runtime: cancelling %s", request_id)
        self.sinks.setdefault(request_id, sink)
        self._finish(Result(request_id, owner or "", [], 0.0, None, [], "error", error))

    def _finish(self, result: Result) -> None:
        msg = self.requests.pop(result.request_id, None)
        routed = self.routed_at.pop(result.request_id, None)
        self.streamed.pop(result.request_id, None)
        migrated = self.migrated.pop(result.request_id, None)
        self.prefill_retries.pop(result.request_id, None)
        if migrated is not None:  # its tokens from before: the worker it went on on timed only its own
            result.migrations, before, logprobs = migrated
            result.token_times = before + list(result.token_times)
            if result.logprobs is not None:
                result.logprobs = logprobs + result.logprobs
        sink = self.sinks.pop(result.request_id, None)
        worker = self.owner.pop(result.request_id, None)
        if self.elastic is not None and routed is not None:
            self.elastic.finished(result, routed)
        if worker in self.in_flight:
            done = result.error is None and msg is not None  # what its worker now caches
            tokens = list(msg.prompt_ids) + list(msg.output_ids) + list(result.output_ids) if done else []
            salt = msg.cache_salt if msg is not None else None
            self.router.finished_tokens(worker, result.request_id, tokens, salt)
        if sink is not None:
            sink("result", result)
