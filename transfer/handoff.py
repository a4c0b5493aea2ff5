"""The hand-off's states: where each disaggregated request is on either side, who holds it there, how
long it may stay, and every way out (docs/handoff.md walks one request through them).

One enum per side. Each messenger keeps a `Handoff` of its requests and changes a request's state only
through `Handoff.move`, naming why (a `Cause`): a move that the side's table (`DECODE_MOVES`,
`PREFILL_MOVES`) does not list raises, every move is logged at debug and counted by (from, to, cause),
and the states' sizes are the gauge a worker reports (`/metrics`: pdk_handoff_requests,
pdk_handoff_transitions). A state in `ENDS` is a way out: the request leaves the table (its pages have
gone to their next holder, or are free) and only the count remains.

Decode side (transfer/decode.py's DecodeMessenger; WAITING is serving/decode_front.py's backlog):

    WAITING -> REQUESTED -> ACCEPTED -> LANDING -> DECODING        (its pages now the engine's)
        |          |           |           |
        |          +-----------+-----------+--> FAILED --> FREED | RECOMPUTING   (nothing can land now)
        |                                          +-----> FENCED --> FREED      (peer silent, maybe alive)
        +--> FREED | DECODING | RECOMPUTING        (left before anything was sent)

Prefill side (transfer/prefill.py's PrefillMessenger):

    QUEUED -> COMPUTING -> SENDING -> SENT                         (every write finished; pages free)
       |          |           |
       |          +-----------+--> STOPPING --> ENDED              (no new post; posts in flight finish)
       +--> ENDED                                                  (refused, cancelled, moved away)
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable
from enum import StrEnum
from typing import Generic, TypeVar

log = logging.getLogger(__name__)


class DecodeState(StrEnum):
    WAITING = "waiting"  # in the decode worker's backlog: no pages yet (pages and context slots first)
    REQUESTED = "requested"  # pages pinned, PrefillRequest sent; not accepted yet
    ACCEPTED = "accepted"  # the prefill worker took it; no write has landed yet
    LANDING = "landing"  # writes landing; released once the plan's count and the context write are in
    FAILED = "failed"  # ended (or to be recomputed); its pages stay pinned until nothing can land in them
    FENCED = "fenced"  # failed on a peer that is silent but may live: pages set aside, the id free again
    # ways out
    DECODING = "decoding"  # every write landed (or nothing was missing): the engine runs it
    RECOMPUTING = "recomputing"  # the engine prefills it itself (short, or on_transfer_failure=recompute)
    FREED = "freed"  # ended: its pages free on this side


class PrefillState(StrEnum):
    QUEUED = "queued"  # received; waits for a context slot, or for an earlier owner's transfer to end
    COMPUTING = "computing"  # the engine computes its chunks; each layer's pages go out as it is stored
    SENDING = "sending"  # computed; its last posts (the context write) in flight
    STOPPING = "stopping"  # aborted or failed: nothing new is posted; posts in flight finish first
    # ways out
    SENT = "sent"  # every write finished: its pages free
    ENDED = "ended"  # stopped (or never started): its pages free, the decode side told with an Ended


class Cause(StrEnum):
    """Why a request moved: the transitions counter's label (a fixed set, so the metric stays small)."""

    SUBMITTED = "submitted"  # a decode worker took the request
    SENT = "sent"  # its PrefillRequest went out
    CACHED = "cached"  # its KV is held here already (prefix cache, a tier) or it has one token
    SHORT = "short"  # what is missing is short (deployment.local_prefill_max_tokens): computed here
    BY_LOAD = "by load"  # the router sent it here to prefill: the prefill workers' queue was long
    NO_PEER = "no peer"  # no live prefill worker to ask
    UNREACHABLE = "unreachable"  # the request could not be sent
    ACCEPTED = "accepted"  # the prefill worker took it
    RECEIVED = "received"  # a PrefillRequest arrived (prefill side)
    STARTED = "started"  # the engine took it (prefill side)
    WRITE = "write"  # its first write landed
    LANDED = "landed"  # every write landed
    COMPUTED = "computed"  # its last chunk computed, the context write queued (prefill side)
    POSTED = "posted"  # every write finished (prefill side)
    ABORTED = "aborted"  # its decode worker stopped it (a client gone, a hand-back, an API cancel)
    CANCELLED = "cancelled"  # its client went away (the runtime's cancel, straight to the prefill side)
    DEADLINE = "deadline"  # a stage's deadline passed (transfer.*_timeout_s)
    ERROR = "error"  # the other side or the engine failed it (a refusal, a failed write)
    PEER_SILENT = "peer silent"  # the other side sent nothing for peer_timeout_s
    RAIL_LOST = "rail lost"  # a NIC its writes went over went down: they may be lost in its buffers
    PEER_EXITED = "peer exited"  # the other side's process is gone (or was replaced by a new one)
    PEER_LEFT = "peer left"  # the other side left its role (an elastic worker)
    MOVED = "moved"  # a newer PrefillRequest for it came from another decode worker (prefill side)
    SETTLED = "settled"  # the other side says nothing more can land (its Ended)
    DRAINED = "drained"  # its posts in flight finished (prefill side)


S = TypeVar("S", DecodeState, PrefillState)

_D = DecodeState
# from (None: not held yet) -> the states it may move to
DECODE_MOVES: dict[DecodeState | None, frozenset[DecodeState]] = {
    None: frozenset({_D.WAITING, _D.REQUESTED, _D.DECODING, _D.RECOMPUTING, _D.FREED}),
    _D.WAITING: frozenset({_D.REQUESTED, _D.DECODING, _D.RECOMPUTING, _D.FREED}),
    _D.REQUESTED: frozenset({_D.ACCEPTED, _D.LANDING, _D.FAILED}),
    _D.ACCEPTED: frozenset({_D.LANDING, _D.FAILED}),
    _D.LANDING: frozenset({_D.DECODING, _D.FAILED}),
    _D.FAILED: frozenset({_D.FENCED, _D.FREED, _D.RECOMPUTING}),
    _D.FENCED: frozenset({_D.FREED}),
}
_P = PrefillState
PREFILL_MOVES: dict[PrefillState | None, frozenset[PrefillState]] = {
    None: frozenset({_P.QUEUED, _P.COMPUTING, _P.ENDED}),
    _P.QUEUED: frozenset({_P.COMPUTING, _P.ENDED}),
    _P.COMPUTING: frozenset({_P.SENDING, _P.STOPPING}),
    _P.SENDING: frozenset({_P.SENT, _P.STOPPING}),
    _P.STOPPING: frozenset({_P.ENDED}),
}
ENDS = frozenset({_D.DECODING, _D.RECOMPUTING, _D.FREED, _P.SENT, _P.ENDED})

# who holds a request in each state (the module that moves it on), and what bounds its stay there
# (transfer.config's key, or what it waits for): docs/handoff.md's table
OWNERS: dict[DecodeState | PrefillState, tuple[str, str]] = {
    _D.WAITING: ("serving.decode_front", "pages or a context slot freeing; the request's own deadline"),
    _D.REQUESTED: ("transfer.decode", "handshake_timeout_s"),
    _D.ACCEPTED: ("transfer.decode", "first_layer_timeout_s"),
    _D.LANDING: ("transfer.decode", "completion_timeout_s (from sent)"),
    _D.FAILED: ("transfer.decode", "the peer's Ended, or peer_timeout_s of its silence"),
    _D.FENCED: ("transfer.decode", "the peer's Ended, or its process gone (a write may still land)"),
    _P.QUEUED: ("transfer.prefill", "a context slot, or the earlier transfer's end; peer_timeout_s"),
    _P.COMPUTING: ("transfer.prefill", "layer_timeout_s per layer; peer_timeout_s"),
    _P.SENDING: ("transfer.prefill", "its posts finishing (the backend's); peer_timeout_s"),
    _P.STOPPING: ("transfer.prefill", "its posts finishing (the backend's)"),
}


class Handoff(Generic[S]):
    """One side's requests by state: the only place that side moves a request from state to state.

    Keys are whatever names one transfer on that side (a request id; (request id, seq) where an id can
    be held twice at once). `record` is the side's own data for the request (kept as it moves on)."""

    def __init__(self, side: str, moves: dict[S | None, frozenset[S]]):
        self.side, self.moves = side, moves
        self._state: dict[Hashable, S] = {}
        self.records: dict[Hashable, object] = {}
        self.transitions: Counter[tuple[str, str, str]] = Counter()  # (from, to, cause) -> times

    def __contains__(self, key: Hashable) -> bool:
        return key in self._state

    def __len__(self) -> int:
        return len(self._state)

    def state(self, key: Hashable) -> S | None:
        return self._state.get(key)

    def move(
        self, key: Hashable, to: S, cause: Cause, record: object = None, rename: Hashable = None
    ) -> None:
        """Move key's request to state `to` because of `cause` (record: its data, when it enters the table;
        rename: the key it is held under from now on). A move the side's table does not list raises
        RuntimeError: the hand-off's code went wrong, and nothing is changed."""
        old = self._state.get(key)
        if to not in self.moves.get(old, ()):
            raise RuntimeError(f"{self.side} hand-off: {key!r} cannot move from {old} to {to} ({cause})")
        held = rename if rename is not None else key
        if held != key and held in self._state:
            raise RuntimeError(f"{self.side} hand-off: {held!r} is held already ({self._state[held]})")
        self.transitions[str(old or "new"), str(to), str(cause)] += 1
        log.debug("%s %r: %s -> %s (%s)", self.side, key, old or "new", to, cause)
        record = self.records.pop(key, None) if record is None else record
        self._state.pop(key, None)
        self.records.pop(key, None)
        if to not in ENDS:
            self._state[held], self.records[held] = to, record

    def record(self, key: Hashable, *states: S) -> object | None:
        """key's record while it is in one of states, else None."""
        return self.records[key] if self._state.get(key) in states else None

    def keys(self, *states: S) -> list[Hashable]:
        """The keys in any of states (every key if none is named), oldest move first."""
        return [k for k, s in self._state.items() if not states or s in states]

    def items(self, *states: S) -> list[tuple[Hashable, object]]:
        """(key, record) of the requests in any of states (all if none is named)."""
        return [(k, self.records[k]) for k in self.keys(*states)]

    def counts(self) -> dict[str, int]:
        """Requests in each live state now (every state named, 0 included): the gauge."""
        held = Counter(str(s) for s in self._state.values())
        named = [s for s in self.moves if s is not None]
        named += [s for to in self.moves.values() for s in to if s not in ENDS and s not in named]
        return {str(s): held[str(s)] for s in named}


def handoff_stats(handoffs: list[Handoff]) -> dict[str, dict[str, int]]:
    """What a worker reports of its messengers' hand-offs (serving.messages.Load's handoff and
    handoff_moves): requests per "side.state" now, and moves so far per "side|from|to|cause"."""
    states = {f"{h.side}.{state}": n for h in handoffs for state, n in h.counts().items()}
    moves = {"|".join((h.side, *move)): n for h in handoffs for move, n in h.transitions.items()}
    return {"handoff": states, "handoff_moves": moves}
