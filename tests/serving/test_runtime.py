"""The one request loop (serving.runtime.Runtime) against an in-process fake fleet: what the
workers would send is delivered by hand, in the order a test needs (late messages, deaths, restarts,
hand-backs), and every test waits for the event it needs, never for a time."""

import queue
import time

import pytest
import zmq

from engine import SamplingParams
from serving.config import DeploymentConfig, SloConfig
from serving.messages import (
    Cancel,
    ErrorKind,
    Failed,
    HandedBack,
    Progress,
    Ready,
    Result,
    Submit,
    Switched,
)
from serving.runtime import MAX_PREFILL_RETRIES, Ended, Routed, Runtime, Streamed
from tests.waits import until

DEADLINE_S = 30  # generous: a test waits for events, this only ends one that would hang


def _until(done) -> None:
    """Wait for a state the runtime's thread reaches (bounded by DEADLINE_S, which only ends a hang)."""
    until(done, "a state of the runtime's thread", DEADLINE_S, every_s=0.002)


class FakeProc:
    def __init__(self):
        self.alive, self.exitcode, self.pid = True, None, 0

    def is_alive(self):
        return self.alive


class FakeFleet:
    """What Runtime uses of serving.fleet.fleet.Fleet: its socket (to wake the runtime's poll),
    send, receive, deaths, stop, and the workers' roles; messages "from" workers come from deliver()."""

    def __init__(self, roles: dict[str, str]):
        ctx = zmq.Context.instance()
        self.sock = ctx.socket(zmq.PULL)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self._push = ctx.socket(zmq.PUSH)
        self._push.connect(f"tcp://127.0.0.1:{port}")
        self.roles, self.procs = dict(roles), {n: FakeProc() for n in roles}
        self.dead, self.restarting = set(), set()
        self.switching: dict[str, str] = {}  # an elastic move under way: worker -> its new role
        self.sent: queue.SimpleQueue = queue.SimpleQueue()  # (worker, message) the runtime sent
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.stopped = False
        self.gone: set[str] = set()  # workers whose socket is gone before their death is seen

    @property
    def frontends(self):
        return [n for n, r in self.roles.items() if r != "prefill"]

    def send(self, name, msg) -> bool:
        if name in self.dead or name in self.gone:
            return False
        self.sent.put((name, msg))
        return True

    def deliver(self, name, msg) -> None:
        self.inbox.put((name, msg))
        self._push.send(b"x")  # wakes the runtime's poll

    def receive(self):
        while self.sock.poll(0):
            self.sock.recv()
        out = []
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def kill(self, name, restart=False):
        self.procs[name].alive, self.procs[name].exitcode = False, -9
        if restart:
            self.restarting.add(name)
        self._push.send(b"x")

    def deaths(self):
        out = []
        for name, proc in self.procs.items():
            if not proc.alive and name not in self.dead:
                self.dead.add(name)
                out.append((name, proc.exitcode))
        return out

    def back(self, name):
        """A restarted worker's Ready (Fleet.receive reconnects it and passes the Ready on)."""
        self.procs[name].alive = True
        self.dead.discard(name)
        self.restarting.discard(name)
        self.deliver(name, Ready(name))

    def switch(self, name, role):
        """What Fleet.switch checks and records (the worker is told; here nothing runs)."""
        if self.switching or self.roles.get(name) == role:
            raise ValueError(f"{name} cannot move to {role}")
        self.switching[name] = role

    def switched(self, name, msg):
        """A worker's Switched, as Fleet.receive takes it (its role changes) and passes it on."""
        del self.switching[name]
        self.roles[name] = msg.role
        self.deliver(name, msg)

    def workers(self):
        return [{"name": n, "role": r} for n, r in self.roles.items()]

    def stop(self, on_message=None, timeout_s=10.0):
        self.stopped = True
        self.sock.close()
        self._push.close()

    def next_sent(self, kind=Submit):
        """The next message of this kind the runtime sent (others are skipped)."""
        while True:
            name, msg = self.sent.get(timeout=DEADLINE_S)
            if isinstance(msg, kind):
                return name, msg


class Sink:
    def __init__(self):
        self.events: queue.SimpleQueue = queue.SimpleQueue()

    def __call__(self, event):
        self.events.put(event)

    def next(self, kind=None):
        """The next event (of that type)."""
        while True:
            got = self.events.get(timeout=DEADLINE_S)
            if kind is None or isinstance(got, kind):
                return got

    def result(self) -> Result:
        return self.next(Ended).result


@pytest.fixture
def runtime_of():
    made = []

    def make(roles=None, **kwargs):
        fleet = FakeFleet(roles or {"decode-0": "decode", "decode-1": "decode", "prefill-0": "prefill"})
        runtime = Runtime(fleet, **kwargs)
        made.append(runtime)
        return fleet, runtime

    yield make
    for runtime in made:
        runtime.close()


def _submit(rid="r1", prompt=(1, 2, 3, 4), max_tokens=8, stream=True, **sampling):
    return Submit(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sampling), stream=stream)


def _done(rid, worker, ids, **kw):
    return Result(rid, worker, list(ids), 0.0, None, [], "length", None, **kw)


def test_a_request_streams_and_every_token_is_timed_by_the_runtime(runtime_of):
    fleet, runtime = runtime_of()
    sink = Sink()
    runtime.submit(_submit(max_tokens=4, seed=7), sink)
    worker, wire = fleet.next_sent()
    assert sink.next() == Routed(worker)
    assert wire.stream and wire.sampling == SamplingParams(max_tokens=4, seed=7)  # handed on unchanged
    fleet.deliver(worker, Progress([("r1", [5, 6], "ab", [])]))
    assert sink.next(Streamed) == Streamed([5, 6], "ab", [])
    fleet.deliver(worker, _done("r1", worker, [5, 6, 7, 8], text="abcd"))
    result = sink.result()
    assert result.output_ids == [5, 6, 7, 8] and len(result.token_times) == 4 and result.error is None
    assert result.token_times == sorted(result.token_times)  # the runtime's clock, never the worker's
    assert runtime.num_in_flight == 0


def test_a_request_not_streamed_gets_only_its_result_but_is_timed_all_the_same(runtime_of):
    fleet, runtime = runtime_of()
    sink = Sink()
    runtime.submit(_submit(stream=False, max_tokens=3), sink)
    worker, wire = fleet.next_sent()
    assert wire.stream  # the worker streams every request: the router and the clock see each token
    fleet.deliver(worker, Progress([("r1", [5], "a", [])]))
    fleet.deliver(worker, _done("r1", worker, [5, 6, 7]))
    assert [type(sink.next()), type(sink.next())] == [Routed, Ended]


def test_a_dead_worker_s_request_goes_on_elsewhere_after_its_tokens_and_its_late_messages_are_ignored(
    runtime_of,
):
    fleet, runtime = runtime_of()
    sink = Sink()
    runtime.submit(_submit(max_tokens=6), sink)
    first, _ = fleet.next_sent()
    fleet.deliver(first, Progress([("r1", [5, 6], "ab", [])]))
    sink.next(Streamed)
    fleet.kill(first)
    second, resumed = fleet.next_sent()
    assert second != first and resumed.output_ids == [5, 6] and resumed.text_sent == 2
    fleet.deliver(first, _done("r1", first, [5, 6, 9, 9, 9, 9]))  # late, from the dead one: ignored
    fleet.deliver(first, Progress([("r1", [9], "z", [])]))
    fleet.deliver(second, Progress([("r1", [7], "c", [])]))
    assert sink.next(Streamed) == Streamed([7], "c", [])
    fleet.deliver(second, _done("r1", second, [5, 6, 7, 8, 9, 10]))
    result = sink.result()
    assert result.worker == second and result.output_ids == [5, 6, 7, 8, 9, 10] and result.migrations == 1
    assert len(result.token_times) == 6
    assert any(f"{first} exited (code -9)" in what for _, what in runtime.events)


@pytest.mark.parametrize("on_worker_death", ["migrate", "fail"])
def test_a_request_routed_to_a_worker_gone_before_its_death_is_seen_goes_to_another(
    runtime_of, on_worker_death
):
    """Seen once in a full suite's run: a request sent to a worker killed moments before failed as lost,
    though another worker was live (the runtime learns of a death at its next look at the processes).
    It goes to the live one (on_worker_death: migrate), or fails as lost (fail)."""
    fleet, runtime = runtime_of(on_worker_death=on_worker_death)
    fleet.gone = {"decode-0"}
    sinks = [Sink() for _ in range(4)]
    for i, sink in enumerate(sinks):  # the router spreads them: some are routed to decode-0 first
        runtime.submit(_submit(f"r{i}"), sink)
    if on_worker_death == "fail":
        kinds = [sink.next() for sink in sinks]
        lost = [e.result for e in kinds if isinstance(e, Ended)]
        assert lost and all(r.error_kind == ErrorKind.WORKER_LOST for r in lost)
        return
    for sink in sinks:
        assert sink.next(Routed) == Routed("decode-1")
        name, msg = fleet.next_sent()
        assert name == "decode-1"
        fleet.deliver(name, _done(msg.request_id, name, [7] * 8))
    assert all(sink.result().worker == "decode-1" for sink in sinks)


def test_with_on_worker_death_fail_a_dead_worker_s_requests_end_as_worker_lost(runtime_of):
    fleet, runtime = runtime_of(on_worker_death="fail")
    sink = Sink()
    runtime.submit(_submit(), sink)
    worker, _ = fleet.next_sent()
    fleet.kill(worker)
    result = sink.result()
    assert result.finish_reason == "error" and result.error_kind == ErrorKind.WORKER_LOST
    assert f"worker {worker} exited" in result.error


def test_a_restarted_worker_is_an_event_and_takes_requests_again(runtime_of):
    fleet, runtime = runtime_of({"decode-0": "decode"})
    fleet.kill("decode-0", restart=True)
    sink = Sink()
    runtime.submit(_submit("early"), sink)  # while it is down: no live worker
    assert sink.result().error_kind == ErrorKind.WORKER_LOST
    assert any("decode-0 exited (code -9) (restarting)" in what for _, what in runtime.events)
    fleet.back("decode-0")
    _until(lambda: any(what == "decode-0 back after a restart" for _, what in list(runtime.events)))
    runtime.submit(_submit("later"), sink)
    assert fleet.next_sent()[0] == "decode-0"


def test_a_worker_leaving_the_decode_role_hands_its_requests_on_whatever_on_worker_death_says(runtime_of):
    fleet, runtime = runtime_of(on_worker_death="fail")
    sink = Sink()
    runtime.submit(_submit(), sink)
    first, _ = fleet.next_sent()
    runtime.router.leave(first)  # as an elastic move does before it tells the worker
    fleet.deliver(first, HandedBack(first, ["r1"]))
    second, resumed = fleet.next_sent()
    assert second != first and resumed.request_id == "r1"
    fleet.deliver(second, _done("r1", second, range(8)))
    assert sink.result().migrations == 1


def test_a_request_whose_prefill_worker_died_is_prefilled_again_a_bounded_number_of_times(runtime_of):
    fleet, runtime = runtime_of()
    sink = Sink()
    runtime.submit(_submit(), sink)
    for _ in range(MAX_PREFILL_RETRIES + 1):
        worker, _ = fleet.next_sent()
        lost = Result.failed("r1", ErrorKind.WORKER_LOST, "no live prefill worker", worker)
        lost.prefill_lost = True
        fleet.deliver(worker, lost)
    result = sink.result()
    assert result.error_kind == ErrorKind.WORKER_LOST and runtime.prefill_resent == MAX_PREFILL_RETRIES
    assert result.migrations == 0  # sent again for its prompt: not a migration


def test_a_worker_s_failure_is_an_event_and_its_death_hands_its_requests_on(runtime_of):
    fleet, runtime = runtime_of()
    sink = Sink()
    runtime.submit(_submit(), sink)
    first, _ = fleet.next_sent()
    fleet.deliver(first, Failed(first, "Traceback (most recent call last):\n  ...\nRuntimeError: boom"))
    fleet.kill(first)
    second, _ = fleet.next_sent()
    assert second != first
    assert any(what == f"{first} failed: RuntimeError: boom" for _, what in runtime.events)


def test_refusals_are_typed_a_request_id_in_flight_twice_and_no_live_worker(runtime_of):
    fleet, runtime = runtime_of({"decode-0": "decode"})
    first, again = Sink(), Sink()
    runtime.submit(_submit("same"), first)
    fleet.next_sent()
    runtime.submit(_submit("same"), again)
    twice = again.result()
    assert twice.error_kind == ErrorKind.BAD_REQUEST and "already in flight" in twice.error
    fleet.kill("decode-0")
    assert first.result().error_kind == ErrorKind.WORKER_LOST
    none = Sink()
    runtime.submit(_submit("late"), none)
    assert none.result().error == "no live worker"


def test_a_cancel_before_the_first_token_reaches_the_live_prefill_workers_too(runtime_of):
    """Its prompt may be computing on a prefill worker, and its decode worker may be frozen: the runtime
    tells both. After its first token only the decode worker hears it (the prefill is done)."""
    from serving.router.policy import Router

    router = Router(["decode-0", "decode-1"], prefill_workers=["prefill-0"])
    router.up("prefill-0")  # its Ready came: a live prefill worker
    fleet, runtime = runtime_of(router=router)
    runtime.submit(_submit("r1"), Sink())
    worker, _ = fleet.next_sent()
    runtime.cancel("r1")
    sent = [fleet.next_sent(Cancel), fleet.next_sent(Cancel)]
    assert sorted(name for name, _ in sent) == sorted([worker, "prefill-0"])
    assert {msg.request_id for _, msg in sent} == {"r1"} and sent[0][1].at == sent[1][1].at > 0
    sink = Sink()
    runtime.submit(_submit("r2"), sink)
    worker, _ = fleet.next_sent()
    fleet.deliver(worker, Progress([("r2", [5], "a", [])]))
    sink.next(Streamed)
    runtime.cancel("r2")
    runtime.submit(_submit("r3"), Sink())  # a marker: what the runtime sent before it
    before = []
    while not isinstance((item := fleet.sent.get(timeout=DEADLINE_S))[1], Submit):
        before.append(item)
    assert [(name, msg.request_id) for name, msg in before if isinstance(msg, Cancel)] == [(worker, "r2")]


def test_cancel_goes_to_the_worker_that_has_the_request_now(runtime_of):
    fleet, runtime = runtime_of()
    sink = Sink()
    runtime.submit(_submit(), sink)
    first, _ = fleet.next_sent()
    fleet.kill(first)
    second, _ = fleet.next_sent()
    runtime.cancel("r1")
    where, msg = fleet.next_sent(Cancel)
    assert where == second and msg.request_id == "r1" and msg.at > 0  # when its client went away
    fleet.deliver(second, Result.failed("r1", ErrorKind.CANCELLED, None, second))
    result = sink.result()
    assert result.finish_reason == "abort" and result.error_kind == ErrorKind.CANCELLED


def test_a_silent_worker_s_requests_go_on_elsewhere_and_it_is_told_to_cancel_them(runtime_of):
    fleet, runtime = runtime_of({"decode-0": "decode", "decode-1": "decode"})
    sink = Sink()
    runtime.submit(_submit(), sink)
    worker, _ = fleet.next_sent()
    other = next(n for n in fleet.procs if n != worker)
    runtime.heard[other] = time.monotonic() + 1e6  # it keeps talking; every other worker is silent now
    runtime.silent_after_s = 0.0
    assert fleet.sent.get(timeout=DEADLINE_S) == (worker, Cancel("r1"))  # told, in case it wakes
    again, resumed = fleet.next_sent()
    assert again == other and resumed.request_id == "r1"
    runtime.heard[other] = 0.0  # now it is silent too: nothing is left to take a request
    result = sink.result()
    assert result.error_kind == ErrorKind.WORKER_LOST and f"worker {other} is silent" in result.error


def test_an_exception_in_one_request_s_routing_fails_it_alone(runtime_of, monkeypatch):
    fleet, runtime = runtime_of()
    good, bad = Sink(), Sink()
    real = runtime.router.route_tokens

    def route(request_id, *args, **kwargs):
        if request_id == "bad":
            raise RuntimeError("boom")
        return real(request_id, *args, **kwargs)

    monkeypatch.setattr(runtime.router, "route_tokens", route)
    runtime.submit(_submit("bad"), bad)
    runtime.submit(_submit("good", max_tokens=2), good)
    result = bad.result()
    assert result.error_kind == ErrorKind.INTERNAL and "boom" in result.error
    worker, _ = fleet.next_sent()
    fleet.deliver(worker, _done("good", worker, [1, 2]))
    assert good.result().error is None


def test_an_asked_move_hands_the_worker_s_requests_on_and_its_switch_is_recorded(runtime_of):
    d = DeploymentConfig("e", "disaggregated", num_prefill=1, num_decode=2, planner={"manual": True})
    fleet, runtime = runtime_of(deployment=d, slo=SloConfig())
    sink = Sink()
    runtime.submit(_submit(), sink)
    first, _ = fleet.next_sent()
    runtime.move(first, "prefill")
    _until(lambda: fleet.switching == {first: "prefill"})
    fleet.deliver(first, HandedBack(first, ["r1"]))  # it leaves decoding: its request goes on elsewhere
    second, resumed = fleet.next_sent()
    assert second != first and resumed.request_id == "r1"
    fleet.switched(first, Switched(first, "prefill", 0.25, 0.1))
    _until(lambda: runtime.moves and "seconds" in runtime.moves[0])
    move = runtime.moves[0]
    assert (move["worker"], move["from"], move["to"], move["why"]) == (first, "decode", "prefill", "asked")
    assert (move["seconds"], move["settle_s"]) == (0.25, 0.1)
    assert any(what.startswith(f"{first} serves prefill") for _, what in runtime.events)
    runtime.submit(_submit("later"), Sink())
    assert fleet.next_sent()[0] == second  # the only decode worker left
    assert runtime.router.prefill_workers.count(first) == 1  # and prompts may go to it now


def test_moving_a_worker_needs_an_elastic_deployment(runtime_of):
    _, runtime = runtime_of()
    with pytest.raises(ValueError, match="elastic deployment"):
        runtime.move("decode-0", "prefill")
