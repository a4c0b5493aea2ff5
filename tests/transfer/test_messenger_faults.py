"""A prefill/decode messenger pair over a channel that delays, reorders and duplicates messages and a
backend that drops or repeats notifications, with spoofed messages from another peer, aborts from either
side, deadlines passing and the prefill worker dying and coming back (hypothesis, stateful).

After every step: no write lands in a decode page that its request does not hold pinned right now, and
every request ends at most once. At quiescence: every request ended exactly once, each admitted one
holds exactly the bytes its prefill worker computed in the pages it was sent, and every page and context
slot is free."""

import itertools
import queue
import random
import time
from collections import Counter, deque

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine import LLM, SamplingParams
from engine.disagg import DecodeSide, PrefillSide, decode_messenger, prefill_messenger, shard_spec
from engine.kv.cache import OutOfPages
from tests.kept import keep_outputs
from tests.transfer.messengers import _full_heads
from transfer.backends.local import LocalBackend
from transfer.config import TransferConfig
from transfer.decode import NoFreeSlot
from transfer.protocol import (
    Accepted,
    Ended,
    Endpoint,
    Hello,
    Notif,
    decode_codec,
    prefill_codec,
    wait_hello,
)

PAGES, SLOTS = 96, 8
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
CONFIG = TransferConfig(
    backend="local",
    context_slots=SLOTS,
    handshake_timeout_s=2,
    first_layer_timeout_s=2,
    completion_timeout_s=6,
)
_names = itertools.count()


class _Wire:
    """Messages sent and not yet delivered; the test decides which arrives when (or twice)."""

    def __init__(self):
        self.items: list[bytes] = []

    def put(self, data: bytes) -> None:
        self.items.append(data)


class FaultyPair(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.now = 0.0
        self.decode = LLM("tiny-random", role="decode", page_size=4, num_pages=PAGES, max_num_seqs=8)
        keep_outputs(self.decode)
        self.calls, self.violations = Counter(), []  # (hook, request) -> times; writes that broke the rule
        self.sent, self.landed = {}, {}  # request -> KV the prefill side computed / the decode side got
        decode, calls, landed = self.decode, self.calls, self.landed

        class Sink(DecodeSide):
            def admit(self, request_id, context):
                calls["admit", request_id] += 1
                pages = decode.allocator.pages(request_id)
                landed[request_id] = _full_heads(decode.kv_caches, shard_spec(decode), pages).clone()
                super().admit(request_id, context)

            def fail(self, request_id, error):
                calls["fail", request_id] += 1
                super().fail(request_id, error)

            def free(self, request_id):
                calls["free", request_id] += 1
                super().free(request_id)

        self.dm = decode_messenger(decode, LocalBackend(f"d{next(_names)}"), CONFIG, side=Sink)
        self.dm.clock = lambda: self.now
        self.spoofer = Endpoint(_Wire(), queue.Queue(), decode_codec())  # another prefill peer's channel
        self.dm.add_peer("prefill-1", self.spoofer, wait_hello(self._hello_end("prefill-1"), 1))
        self.ids = itertools.count()
        self.submitted: list[str] = []
        self.pm = None
        self._start_prefill()

    def _hello_end(self, agent):
        """A channel end that holds one Hello of agent (the spoofing peer's)."""
        end = Endpoint(_Wire(), queue.Queue(), decode_codec())
        end.inbox.put(prefill_codec().encode(Hello.of(shard_spec(self.decode), agent)))
        return end

    # ---- the prefill worker: started, killed, restarted ----------------------------------------------

    def _start_prefill(self):
        self.prefill = LLM(
            "tiny-random", role="prefill", page_size=4, num_pages=PAGES, max_num_batched_tokens=24
        )
        prefill, sent, checker = self.prefill, self.sent, self._check_write

        class Source(PrefillSide):
            def release(self, request_id):
                sent[request_id] = _full_heads(prefill.kv_caches, shard_spec(prefill), self.pages(request_id))
                super().release(request_id)

        in_flight = self.in_flight = deque()  # appended on the sender thread, taken on this one

        class Delayed(LocalBackend):
            """Posts land when the test says (`writes_land`), as writes over a network do."""

            def post(self, peer, ops, notif):
                self.check(peer, ops)
                handle = [peer, ops, notif, False]
                in_flight.append((self, handle))
                return handle

            def state(self, handle):
                return "DONE" if handle[3] else "PROC"

            def land(self, handle):
                checker(handle[1], handle[2])
                LocalBackend.post(self, *handle[:3])  # the copy, then the notification
                handle[3] = True

        self.to_prefill, self.to_decode = _Wire(), _Wire()
        self.prefill_end = Endpoint(self.to_decode, queue.Queue(), prefill_codec())
        self.decode_end = Endpoint(self.to_prefill, queue.Queue(), decode_codec())
        self.pm = prefill_messenger(prefill, Delayed(f"p{next(_names)}"), CONFIG, side=Source)
        self.pm.add_peer(self.prefill_end)
        self._deliver_all()
        self.dm.add_peer("prefill-0", self.decode_end, wait_hello(self.decode_end, 1))
        self.alive = True

    def _check_write(self, ops, message):
        """Before a write lands: its pages must be pinned to its live request, and be ones it asked for."""
        kind, rid, seq, *_ = Notif.parse(message)
        p, spec = self.dm.pending.get(rid), self.dm.spec
        if p is None or p.seq != seq or not self.decode.allocator.is_pinned(rid):
            self.violations.append(f"write for {rid} (seq {seq}) whose pages are not held for it")
            return
        page_bytes = 2 * spec.heads_per_rank * spec.run_bytes
        held = set(self.decode.allocator.pages(rid))
        for _, _, region, offset, _ in ops.tolist() if hasattr(ops, "tolist") else ops:
            page = (offset % (spec.num_pages * page_bytes)) // page_bytes
            if region < spec.tp and page not in held:
                self.violations.append(f"write for {rid} into a page it does not hold")
            elif region < spec.tp and page not in p.pages:  # its prefix cache's: shared, never written
                self.violations.append(f"write for {rid} into a page its prefix cache held")

    # ---- rules --------------------------------------------------------------------------------------------

    @rule(length=st.integers(1, 100), seed=st.integers(0, 2**16))
    def submit(self, length, seed):
        g = torch.Generator().manual_seed(seed)
        rid = f"r{next(self.ids)}"
        try:
            self.dm.submit(
                rid, torch.randint(3, 49000, (length,), generator=g).tolist(), PARAMS, peer="prefill-0"
            )
        except (OutOfPages, NoFreeSlot):  # a worker keeps it for later (DecodeFront): nothing was taken
            return
        self.submitted.append(rid)

    def _target(self, data) -> str:
        """A request to disturb: one still in transfer where there is one (where faults can hurt). What is
        still in transfer depends on the sender thread's timing, so the draw is an index of a fixed range
        (a sampled_from over it would change shape from run to run: hypothesis calls that flaky)."""
        options = sorted(self.dm.pending) or self.submitted
        return options[data.draw(st.integers(0, 2**16)) % len(options)]

    @precondition(lambda self: self.submitted)
    @rule(data=st.data())
    def decode_aborts(self, data):
        self.dm.abort(self._target(data), "the client left")

    @precondition(lambda self: self.alive and self.submitted)
    @rule(data=st.data())
    def prefill_aborts(self, data):
        self.pm.abort(self._target(data), "prefill draining")

    @precondition(lambda self: self.alive)
    @rule()
    def prefill_steps(self):
        self.pm.poll()
        if self.prefill.has_unfinished():
            self.prefill.step()
        self._settle()

    @rule()
    def decode_steps(self):
        self.dm.poll()
        if self.decode.has_unfinished():
            self.decode.step()

    @rule(
        to_prefill=st.booleans(), fault=st.sampled_from(["shuffled", "twice", "one-late"]), seed=st.integers()
    )
    def deliver(self, to_prefill, fault, seed):
        """What is on the wire arrives: shuffled, every message twice, or all but one (kept for later)."""
        wire, end = (self.to_prefill, self.prefill_end) if to_prefill else (self.to_decode, self.decode_end)
        items, wire.items = wire.items, []
        if fault == "shuffled":
            random.Random(seed).shuffle(items)
        elif fault == "one-late" and items:
            wire.items.append(items.pop(seed % len(items)))
        for data in items:
            for _ in range(2 if fault == "twice" else 1):
                end.inbox.put(data)

    @rule(count=st.integers(1, 40))
    def writes_land(self, count):
        """The oldest posts in flight complete (their bytes land, then their notification)."""
        self._land(count)

    def _land(self, count=None):
        for _ in range(len(self.in_flight) if count is None else min(count, len(self.in_flight))):
            backend, handle = self.in_flight.popleft()
            backend.land(handle)

    @rule(drop=st.booleans(), which=st.integers(0, 7))
    def notification_fault(self, drop, which):
        """The notifications waiting at the decode side: one is lost, or each arrives twice."""
        inbox = self.dm.backend._inbox
        if drop and inbox:
            del inbox[which % len(inbox)]
        elif not drop:
            inbox.extend(list(inbox))

    @precondition(lambda self: self.submitted)
    @rule(data=st.data(), ended=st.booleans())
    def spoof(self, data, ended):
        """Another (authenticated) prefill peer claims a request it does not own: Ended, Accepted, writes."""
        rid = self._target(data)
        p = self.dm.pending.get(rid)
        seq = p.seq if p is not None else 0
        msg = Ended(rid, seq, "spoofed") if ended else Accepted(rid, seq)
        self.spoofer.inbox.put(prefill_codec().encode(msg))
        self.dm.backend._inbox.append(("prefill-1", Notif("kv", rid, seq, 99, 1).encode()))

    @rule(rounds=st.integers(1, 6))
    def healthy_stretch(self, rounds):
        """A while with no fault: messages arrive in order and both sides step (so requests do finish)."""
        for _ in range(rounds):
            self._deliver_all()
            if self.alive:
                self.prefill_steps()
                self._land()
            self.decode_steps()

    @rule(seconds=st.sampled_from([0.2, 0.5, 2.5]))
    def time_passes(self, seconds):
        self.now += seconds

    @precondition(lambda self: self.alive)
    @rule(dice=st.integers(0, 3))
    def prefill_dies(self, dice):
        if dice:  # a quarter of the draws: dying is rarer than the other faults
            return
        self.pm.close()  # nothing it had queued is posted after this
        self.in_flight.clear()  # nor does anything it had posted land
        self.alive = False
        self.to_prefill.items.clear()
        self.to_decode.items.clear()
        self.dm.peer_dead("prefill-0")
        self.prefill.close()

    @precondition(lambda self: not self.alive)
    @rule()
    def prefill_restarts(self):
        self._start_prefill()

    # ---- checks -------------------------------------------------------------------------------------------

    @invariant()
    def no_write_lands_in_a_page_not_held_for_it(self):
        assert not self.violations, self.violations

    @invariant()
    def every_request_ends_at_most_once(self):
        for rid in self.submitted:
            ends = self.calls["admit", rid] + self.calls["fail", rid]
            assert ends <= 1 and self.calls["free", rid] <= self.calls["fail", rid], rid

    def _settle(self):
        """Let the sender thread post what the step queued (the checks hold under any interleaving)."""
        give_up = time.monotonic() + 2
        while not self.pm._jobs.empty() and time.monotonic() < give_up:
            time.sleep(0.001)
        time.sleep(0.002)

    def _deliver_all(self):
        for wire, end in ((self.to_prefill, self.prefill_end), (self.to_decode, self.decode_end)):
            while wire.items:
                end.inbox.put(wire.items.pop(0))

    def teardown(self):
        """Faults stop; time passes; both sides run until nothing is left; then the final checks."""
        try:
            for _ in range(400):
                self._deliver_all()
                if self.alive:
                    self.prefill_steps()
                    self._land()
                self.decode_steps()
                self.now += 0.5
                quiet = not self.dm.pending and not self.decode.has_unfinished()
                if quiet and (
                    not self.alive or (not self.pm.transfers and not self.prefill.has_unfinished())
                ):
                    break
            assert not self.violations, self.violations
            assert not self.dm.pending and self.decode.allocator.num_free == PAGES
            assert len(self.dm._free_slots) == SLOTS
            assert not self.dm.handoff.keys(), self.dm.handoff.counts()  # every request left its states
            if self.alive:
                assert not self.pm.transfers and self.prefill.allocator.num_free == PAGES
                assert not self.pm.handoff.keys(), self.pm.handoff.counts()
                assert len(self.pm._free_slots) == CONFIG.context_slots
            for rid in self.submitted:
                admitted, failed = self.calls["admit", rid], self.calls["fail", rid]
                out = self.decode.kept.get(rid)
                assert admitted + failed == 1 and out is not None and out.finished, rid
                if admitted and rid in self.sent:  # the bytes it was released with are the ones computed,
                    # in the pages sent: those its prefix cache held are its own (computed in another
                    # batch, or by the decode worker itself: other bits than this prefill's, and never sent)
                    skip = out.num_cached_tokens // 4
                    assert torch.equal(self.landed[rid][:, skip:], self.sent[rid][:, skip:]), rid
        finally:
            if self.alive:
                self.pm.close()
                self.prefill.close()


FaultyPair.TestCase.settings = settings(
    max_examples=15, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)
test_messenger_pair_under_faults = FaultyPair.TestCase


# ---- the faults above, each in the one order that would hurt (the machine above searches; these pin) --


class _Draw:
    """Stands in for hypothesis's data: every draw gives this value (an index: 0 is the only request)."""

    def __init__(self, value):
        self.value = value

    def draw(self, strategy):
        return self.value


def _scenario(fault):
    """A 3-chunk request whose first chunk is posted but not landed when `fault` strikes; then it runs to
    the end with the decode side polling between every landing. The request must finish with the bytes
    the prefill side computed, and no write may land outside the pages held for it."""
    m = FaultyPair()
    try:
        m.submit(length=70, seed=3)
        m._deliver_all()
        m.prefill_steps()  # accepted, first chunk computed and posted (in flight)
        fault(m)
        for _ in range(20):
            m._deliver_all()
            m.prefill_steps()
            m.decode_steps()
            m.writes_land(count=1)
            m.decode_steps()
            m.no_write_lands_in_a_page_not_held_for_it()
    finally:
        m.teardown()
    return m


def test_a_spoofed_ended_frees_nothing_mid_transfer():
    m = _scenario(lambda m: (m.spoof(_Draw(0), ended=True), m.decode_steps()))
    assert m.calls["admit", "r0"] == 1 and m.decode.kept["r0"].finish_reason == "length"


def test_a_spoofed_notification_counts_nothing():
    m = _scenario(lambda m: (m.spoof(_Draw(0), ended=False), m.decode_steps()))
    assert m.calls["admit", "r0"] == 1 and sum(m.dm.dropped.values()) >= 1


def test_notifications_that_arrive_twice_count_once():
    def twice(m):
        m.writes_land(count=1)
        m.notification_fault(drop=False, which=0)
        m.decode_steps()

    m = _scenario(twice)
    assert m.calls["admit", "r0"] == 1


def test_a_duplicated_prefill_request_is_not_taken_twice():
    def duplicate(m):
        m.submit(length=70, seed=4)  # r1: on the wire now
        m.deliver(to_prefill=True, fault="twice", seed=0)
        m.prefill_steps()

    m = _scenario(duplicate)
    assert m.calls["admit", "r0"] == m.calls["admit", "r1"] == 1


def test_an_abort_waits_for_writes_in_flight():
    def abort(m):
        m.decode_aborts(_Draw(0))
        m.decode_steps()

    m = _scenario(abort)
    assert m.calls["fail", "r0"] == 1 and m.calls["free", "r0"] == 1


def test_an_abort_after_the_prefill_side_finished_is_answered():
    """The prefill side has sent everything and forgotten the request, the decode side has not counted it
    yet (its notifications are lost) and aborts: the Abort is answered, so the pages come back."""
    m = FaultyPair()
    try:
        m.submit(length=20, seed=5)
        m._deliver_all()
        m.prefill_steps()
        m._land()
        for _ in range(100):  # the sender thread reaps the landed posts, then poll forgets the request
            m.prefill_steps()
            if not m.pm.transfers:
                break
        assert not m.pm.transfers
        m.dm.backend._inbox.clear()
        m.decode_aborts(_Draw(0))
        for _ in range(3):
            m._deliver_all()
            m.prefill_steps()
            m.decode_steps()
        assert not m.dm.pending and m.calls["fail", "r0"] == m.calls["free", "r0"] == 1
    finally:
        m.teardown()
