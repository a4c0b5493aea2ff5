"""Every way out of every hand-off state (transfer/handoff.py), on two real engines over the local backend.

Each case drives one request into a state on one side, then applies one exit (the client goes, the API
cancels, a worker dies or freezes, the link goes down, a write never lands, the peer never answers the
first message), heals what can heal, and checks that the request ended once, every page and context slot
on each surviving side is free, neither side's hand-off holds anything, and the pair still serves. The
pairs are docs/handoff.md's table."""

import time
from dataclasses import replace

import pytest

from engine import LLM
from tests.kept import finished
from tests.transfer.messengers import GREEDY, PAGES, _close, _local_pair
from transfer.decode import IN_FLIGHT
from transfer.handoff import Cause, DecodeState, Handoff, PrefillState, handoff_stats

D, P = DecodeState, PrefillState
PROMPT = list(range(100, 160))  # 59 tokens to send: three 24-token chunks
STATES = [D.WAITING, D.REQUESTED, D.ACCEPTED, D.LANDING, D.FAILED, D.FENCED]
STATES += [P.QUEUED, P.COMPUTING, P.SENDING, P.STOPPING]
EXITS = [
    "client gone",
    "API cancel",
    "prefill dies",
    "prefill freezes",
    "decode dies",
    "decode freezes",
    "link down",
    "write never lands",
    "no answer to the first message",
]
# where the request has had its answer already, a first message that goes unanswered cannot happen
ANSWERED = {D.ACCEPTED, D.LANDING, D.FAILED, D.FENCED, P.COMPUTING, P.SENDING, P.STOPPING}
CASES = [(s, e) for s in STATES for e in EXITS if not (e == EXITS[-1] and s in ANSWERED)]


def _silent(channel) -> None:
    channel.peer_silent_for = lambda: 3600.0  # as if no heartbeat came for an hour


def _heard(channel) -> None:
    channel.__dict__.pop("peer_silent_for", None)
    channel.__dict__.pop("receive", None)


def _lose_notifications(dm) -> None:
    """Writes land, but their notifications are lost: the decode side never counts them."""
    for backend in dm.backends:
        notifications = backend.notifications
        backend.notifications = lambda n=notifications: (n(), [])[1]


class _Pair:
    """Both sides, each up or dead, polling or frozen; faults are patched in and healed."""

    def __init__(self, tag: str):
        self.prefill = LLM(
            "tiny-random", role="prefill", page_size=4, num_pages=PAGES, max_num_batched_tokens=24
        )
        self.decode = LLM("tiny-random", role="decode", page_size=4, num_pages=PAGES)
        self.pm, self.dm = _local_pair(self.prefill, self.decode, tag)
        self.prefill_up = self.decode_up = self.prefill_polls = self.decode_polls = True
        self.waiting = False  # the request waits in the decode worker's backlog (sent on its next turn)
        self.cancelled = False  # ... and left from there, before anything was sent
        self.slots = self.pm._free_slots
        self.config = self.dm.config

    @property
    def to_prefill(self):
        return self.pm.channels[0]

    @property
    def to_decode(self):
        return self.dm.peers["prefill-0"].channel

    def turn(self) -> None:
        if self.prefill_up and self.prefill_polls:
            self.pm.poll()
            if self.prefill.has_unfinished():
                self.prefill.step()
        if self.decode_up and self.decode_polls:
            if self.waiting and not self.cancelled:  # the backlog's turn (serving/decode_front.py)
                self.waiting = False
                self.dm.submit("r", PROMPT, GREEDY)
            self.dm.poll()
            if self.decode.has_unfinished():
                self.decode.step()

    def until(self, done, what: str, timeout_s: float = 30.0) -> None:
        give_up = time.monotonic() + timeout_s
        while not done():
            self.turn()
            assert time.monotonic() < give_up, (
                f"{what}: decode {self.dm.handoff.counts()}, prefill {self.pm.handoff.counts()}"
            )

    def heal(self) -> None:
        """Every fault ends (a dead process stays dead)."""
        self.prefill_polls = self.decode_polls = True
        for channel in (self.to_prefill, self.to_decode):
            _heard(channel)
        for backend in self.dm.backends:
            backend.__dict__.pop("notifications", None)
        self.dm.config = self.config
        self.pm._free_slots = self.slots

    def settled(self) -> bool:
        decode = not self.decode_up or (
            (self.cancelled or finished(self.decode, "r"))
            and not self.dm.handoff.keys()
            and not self.decode.has_unfinished()
        )
        prefill = not self.prefill_up or (
            not self.pm.handoff.keys() and not self.pm.transfers and not self.prefill.has_unfinished()
        )
        return decode and prefill


def _poll_until(dm, state) -> None:
    """Only the decode side polls (the prefill side does nothing more) until "r" is in state."""
    give_up = time.monotonic() + 30
    while dm.handoff.state("r") is not state:
        dm.poll()
        assert time.monotonic() < give_up, dm.handoff.counts()


def _drive(pair: _Pair, state) -> None:
    """Bring request "r" into state (on its side), without any fault."""
    dm, pm, prefill = pair.dm, pair.pm, pair.prefill
    if state is D.WAITING:
        dm.wait("r")
        pair.waiting = True
        return
    if state is P.QUEUED:
        pm._free_slots = []  # every context slot of the prefill side in use
    dm.submit("r", PROMPT, GREEDY)
    if state is D.REQUESTED:
        return
    pm.poll()  # accepted (or queued)
    if state is P.QUEUED:
        return
    if state is D.ACCEPTED:
        _poll_until(dm, D.ACCEPTED)
        return
    prefill.step()  # one chunk of three computed, its pages posted
    if state in (D.LANDING, D.FAILED, D.FENCED):
        _poll_until(dm, D.LANDING)
    if state is D.FAILED:
        dm.abort("r", "aborted by the decode worker")  # its pages wait for the prefill side's Ended
    elif state is D.FENCED:
        _silent(pair.to_decode)
        dm.poll()  # failed, and set aside: the silent peer may still write
    elif state is P.SENDING:
        while prefill.has_unfinished():
            prefill.step()  # computed: its context write queued, no poll since
    elif state is P.STOPPING:
        pm.abort("r", "prefill worker draining")


def _exit(pair: _Pair, exit: str) -> None:
    dm, pm = pair.dm, pair.pm
    if exit in ("client gone", "API cancel"):
        if exit == "API cancel":  # the runtime tells every live prefill worker too
            pm.cancel("r", time.time())
        if dm.handoff.state("r") is D.WAITING:
            dm.leave("r", Cause.CANCELLED)
            pair.cancelled = True
        elif "r" in dm.pending:
            dm.abort("r", "aborted: the client went away", cancelled_at=time.time())
        elif pair.decode.front.holds("r"):
            pair.decode.abort("r")
    elif exit == "prefill dies":
        pair.prefill_up = False
        pm.close()
        dm.peer_dead("prefill-0")
    elif exit == "prefill freezes":
        pair.prefill_polls = False
        _silent(pair.to_decode)
        for _ in range(3):
            pair.turn()
    elif exit in ("decode dies", "decode freezes"):  # the prefill side reads what was sent, then silence
        pair.decode_up = exit == "decode freezes"
        pair.decode_polls = False
        _silent(pair.to_prefill)
        for _ in range(3):
            pair.turn()
        pair.until(lambda: not pm.handoff.keys(), "prefill saw the silence")
    elif exit == "link down":  # silence both ways; messages wait in the sockets, writes' notices are lost
        for channel in (pair.to_prefill, pair.to_decode):
            _silent(channel)
            channel.receive = lambda: []
        _lose_notifications(dm)
        for _ in range(3):
            pair.turn()
        pair.until(lambda: dm.handoff.state("r") not in (D.WAITING, *IN_FLIGHT), "decode saw the silence")
    elif exit == "write never lands":
        _lose_notifications(dm)
        dm.config = replace(dm.config, first_layer_timeout_s=1e-6, completion_timeout_s=1e-6)
        pair.until(lambda: dm.handoff.state("r") not in (D.WAITING, *IN_FLIGHT), "deadline")
    else:  # no answer to the first message: the prefill worker reads nothing (its heartbeats still come)
        pair.prefill_polls = False
        dm.config = replace(dm.config, handshake_timeout_s=1e-6)
        pair.until(lambda: dm.handoff.state("r") not in (D.WAITING, D.REQUESTED), "handshake deadline")


@pytest.mark.parametrize("state, exit", CASES, ids=[f"{s.__class__.__name__[:-5]}.{s}-{e}" for s, e in CASES])
def test_every_exit_of_every_state_frees_what_it_held(request, state, exit):
    pair = _Pair(request.node.name)
    try:
        _drive(pair, state)
        side = pair.dm if isinstance(state, DecodeState) else pair.pm
        assert [side.handoff.state(k) for k in side.handoff.keys()] == [state], side.handoff.counts()
        _exit(pair, exit)
        pair.heal()
        pair.until(pair.settled, f"{state} / {exit}")
        if pair.decode_up:
            out = pair.decode.kept.get("r")
            assert pair.cancelled or (out is not None and out.finished), "the request did not end"
            assert pair.decode.allocator.num_free == PAGES and len(pair.dm._free_slots) == len(
                pair.dm.groups[0].context
            )
        if pair.prefill_up:
            assert pair.prefill.allocator.num_free == PAGES and len(pair.pm._free_slots) == len(
                pair.pm.context
            )
        if pair.decode_up and pair.prefill_up:  # the pair still serves
            pair.dm.forget("r")
            pair.decode.core.forget("r")
            pair.turn()  # the decode side hears its peer again (a lost peer is asked nothing)
            pair.dm.submit("after", list(range(300, 340)), GREEDY)
            pair.until(lambda: finished(pair.decode, "after") and pair.settled(), "a later request")
            assert pair.decode.output("after").finish_reason == "length", pair.decode.output("after").error
    finally:
        if pair.prefill_up:
            _close(pair.pm, pair.dm)


def test_a_move_the_table_does_not_list_raises_and_changes_nothing():
    handoff = Handoff("decode", {None: frozenset({D.REQUESTED}), D.REQUESTED: frozenset({D.FAILED})})
    handoff.move("r", D.REQUESTED, Cause.SENT, record="pending")
    with pytest.raises(RuntimeError, match="cannot move from requested to decoding"):
        handoff.move("r", D.DECODING, Cause.LANDED)
    assert handoff.state("r") is D.REQUESTED and handoff.records["r"] == "pending"
    handoff.move("r", D.FAILED, Cause.DEADLINE)
    assert handoff.transitions == {("new", "requested", "sent"): 1, ("requested", "failed", "deadline"): 1}
    handoff.move("s", D.REQUESTED, Cause.SENT)
    with pytest.raises(RuntimeError, match="'r' is held already"):
        handoff.move("s", D.FAILED, Cause.DEADLINE, rename="r")  # fenced under a name in use
    assert handoff.state("s") is D.REQUESTED and handoff.state("r") is D.FAILED
    handoff.move("s", D.FAILED, Cause.DEADLINE)
    stats = handoff_stats([handoff])
    assert stats["handoff"] == {"decode.requested": 0, "decode.failed": 2}
    assert stats["handoff_moves"] == {"decode|new|requested|sent": 2, "decode|requested|failed|deadline": 2}


def test_a_request_id_held_on_the_decode_side_is_refused_again_until_it_leaves(pair):
    prefill, decode, pm, dm = pair
    dm.submit("r", PROMPT, GREEDY)
    with pytest.raises(ValueError, match="already requested"):
        dm.submit("r", PROMPT, GREEDY)  # sent twice: refused before anything is taken
    with pytest.raises(ValueError, match="still requested"):
        dm.wait("r")
    assert decode.allocator.num_free == PAGES - 15
