"""An elastic worker's move between prefill and decode (serving.worker.Worker's `switch`).

The runtime's SwitchRole starts a move: a decode worker hands its requests back (HandedBack: the runtime
resumes them on others), one whose KV is still landing once that transfer has settled; a prefill worker
is told only when every decode worker has Released it (after PeerLeaving, nothing of theirs is in flight
there). Once nothing of the worker's is anywhere, the old role's messenger goes, the engine takes the new
role (LLM.set_role: same weights, KV memory and prefix cache), the new role's messenger comes up, and the
worker says Switched.
"""

from __future__ import annotations

import logging
import time

from serving.messages import HandedBack, Released, Switched, SwitchRole
from transfer.handoff import Cause

log = logging.getLogger("serving.worker")  # its lines in the worker's log, as the worker's


class RoleSwitch:
    """A worker's move to its other role, and the peers leaving the prefill role that it releases."""

    def __init__(self, worker):
        self.worker = worker  # serving.worker.Worker: its messengers, engine, requests and socket
        self.msg: SwitchRole | None = None  # the move under way
        self.started = 0.0
        self.leaving: set[str] = set()  # prefill peers leaving that role (PeerLeaving), until Released
        # handed back once their transfer has settled (their prefill worker still holds them until then:
        # resumed at once, they would meet themselves there)
        self.handing: set[str] = set()

    @property
    def under_way(self) -> bool:
        return self.msg is not None

    def begin(self, msg: SwitchRole) -> None:
        """Leave this role: a decode worker hands every request back now (the runtime resumes them on
        others) and switches once what is in flight has settled; a prefill worker, told only when no
        decode worker sends it more, switches once its prefills are sent."""
        w = self.worker
        if msg.role == w.role or not w.spec.role.switchable:
            w._send(Switched(w.spec.name, w.role, 0.0))
            return
        self.msg, self.started = msg, time.monotonic()
        log.info("%s: switching from %s to %s", w.spec.name, w.role, msg.role)
        if w.role.receives_kv:
            handed = list(w.live)
            self.handing = {rid for rid in handed if rid in w.dm.pending}
            for rid in handed:
                self._hand_back(rid)
            w._send(HandedBack(w.spec.name, [rid for rid in handed if rid not in self.handing]))

    def tend(self) -> None:
        """Decode: a leaving peer is Released once nothing of this worker's is in flight there; handed-back
        requests whose transfer has settled go back to the runtime."""
        w = self.worker
        for peer in [p for p in self.leaving if not w.dm.holds(p)]:
            self.leaving.discard(peer)
            w._send(Released(w.spec.name, peer))
        settled = [rid for rid in self.handing if rid not in w.dm.pending]
        if settled:
            self.handing.difference_update(settled)
            w._send(HandedBack(w.spec.name, settled))

    def _hand_back(self, request_id: str) -> None:
        """End a request here without a Result (the runtime resumes it elsewhere); its pages free here
        once no transfer can touch them."""
        w = self.worker
        w.live.pop(request_id)
        for kept in (w.streamed, w.holdback):
            kept.pop(request_id, None)
        w.front.drop(request_id, Cause.ABORTED)
        if request_id in w.dm.pending:
            w.llm.core.stop(request_id)  # its pages stay until the transfer has settled
            w.dm.abort(request_id, "handed back: its decode worker is switching roles")
        else:
            w.llm.abort(request_id)
        w.dm.forget(request_id)

    def settled(self) -> bool:
        """Nothing of this worker's is anywhere: no request, no transfer, no prefill."""
        w = self.worker
        return not (
            w.llm.core.seqs
            or w.live
            or self.handing
            or w.front.backlog
            or (w.dm is not None and w.dm.pending)
            or (w.pm is not None and w.pm.transfers)
        )

    def finish(self) -> None:
        """The old role's messenger goes, the engine takes the new role (same weights, cache memory and
        prefix cache), and the new role's messenger comes up; then Switched."""
        w, msg, self.msg = self.worker, self.msg, None
        settled = time.monotonic() - self.started
        old, w.role = w.role, msg.role
        w._close_messenger()
        self.leaving.clear()
        w.llm.set_role(msg.role)
        if msg.role.sends_kv:
            w.llm.allocator.events = None  # no router routes to a prefill worker by its cache
        else:
            w.llm.front.record_cache_events()
        w.generation += 1
        w._connect_messenger(tuple(msg.prefill))
        seconds = time.monotonic() - self.started
        log.info(
            "%s: switched from %s to %s in %.3f s (%.3f s of it waiting for what was in flight)",
            w.spec.name,
            old,
            msg.role,
            seconds,
            settled,
        )
        w._send(Switched(w.spec.name, msg.role, seconds, settled))
