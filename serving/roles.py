"""An elastic worker's role switches, as methods of serving.worker.Worker (a mixin: Worker is
its only user; self is the Worker).

The runtime's SwitchRole starts a switch: a decode worker hands its requests back (HandedBack: the runtime
resumes them on others), one whose KV is still landing once that transfer has settled; a prefill worker
is told only when every decode worker has Released it (after PeerLeaving, nothing of theirs is in flight
there). Once nothing of the worker's is anywhere, the old role's messenger goes, the engine takes the new
role (LLM.set_role: same weights, KV memory and prefix cache), the new role's messenger comes up, and the
worker says Switched. A decode worker also lets new prefill peers join when they first say Hello.
"""

from __future__ import annotations

import logging
import time

from serving.messages import HandedBack, Released, Switched, SwitchRole
from transfer.handoff import Cause

log = logging.getLogger("serving.worker")  # its lines in the worker's log, as the worker's


class RoleSwitching:
    """Worker's part that moves it between prefill and decode (see the module docstring)."""

    def _close_messenger(self) -> None:
        """Stop this role's messenger: its sender thread, control sockets and transfer agents."""
        channels, agents = list(self.joining.values()), []
        if self.pm is not None:
            self.pm.close()
            channels += self.pm.channels
            agents += self.pm.agents.backends
        if self.dm is not None:
            channels += [p.channel for p in self.dm.peers.values()]
            agents += self.dm.backends  # every DP group's too
        for channel in channels:
            channel.close()
        for agent in agents:
            agent.close()
        self.pm = self.dm = self.front.dm = None
        self.joining.clear()
        self.leaving.clear()

    def _join_and_release(self) -> None:
        """Decode: peers that say Hello for the first time join (an elastic worker now prefilling); a
        leaving peer is Released once nothing of this worker's is in flight there."""
        from transfer.protocol import PROTOCOL_VERSION, Hello

        for peer, channel in list(self.joining.items()):
            for msg in channel.receive():
                if isinstance(msg, Hello) and msg.version == PROTOCOL_VERSION:
                    del self.joining[peer]
                    try:
                        self.dm.add_peer(peer, channel, msg)
                    except ValueError as e:  # its KV would not mean the same here: it is asked nothing
                        log.error("%s: %s", self.spec.name, e)
                        break
                    log.info("%s: prefill worker %s joined", self.spec.name, peer)
                    break
        for peer in [p for p in self.leaving if not self.dm.holds(p)]:
            self.leaving.discard(peer)
            self._send(Released(self.spec.name, peer))
        settled = [rid for rid in self.handing if rid not in self.dm.pending]
        if settled:
            self.handing.difference_update(settled)
            self._send(HandedBack(self.spec.name, settled))

    def _begin_switch(self, msg: SwitchRole) -> None:
        """Leave this role: a decode worker hands every request back now (the runtime resumes them on
        others) and switches once what is in flight has settled; a prefill worker, told only when no
        decode worker sends it more, switches once its prefills are sent."""
        if msg.role == self.role or self.spec.role == "colocated":
            self._send(Switched(self.spec.name, self.role, 0.0))
            return
        self.switch, self.switch_started = msg, time.monotonic()
        log.info("%s: switching from %s to %s", self.spec.name, self.role, msg.role)
        if self.role == "decode":
            handed = list(self.live)
            self.handing = {rid for rid in handed if rid in self.dm.pending}
            for rid in handed:
                self._hand_back(rid)
            self._send(HandedBack(self.spec.name, [rid for rid in handed if rid not in self.handing]))

    def _hand_back(self, request_id: str) -> None:
        """End a request here without a Result (the runtime resumes it elsewhere); its pages free here
        once no transfer can touch them."""
        self.live.pop(request_id)
        for kept in (self.streamed, self.holdback):
            kept.pop(request_id, None)
        self.front.drop(request_id, Cause.ABORTED)
        if request_id in self.dm.pending:
            self.llm.stop(request_id)  # its pages stay until the transfer has settled
            self.dm.abort(request_id, "handed back: its decode worker is switching roles")
        else:
            self.llm.abort(request_id)
        self.dm.forget(request_id)

    def _settled(self) -> bool:
        """Nothing of this worker's is anywhere: no request, no transfer, no prefill."""
        return not (
            self.llm.seqs
            or self.live
            or self.handing
            or self.front.backlog
            or (self.dm is not None and self.dm.pending)
            or (self.pm is not None and self.pm.transfers)
        )

    def _finish_switch(self) -> None:
        """The old role's messenger goes, the engine takes the new role (same weights, cache memory and
        prefix cache), and the new role's messenger comes up; then Switched."""
        msg, self.switch = self.switch, None
        settled = time.monotonic() - self.switch_started
        old, self.role = self.role, msg.role
        self._close_messenger()
        self.llm.set_role(msg.role)
        if msg.role == "prefill":
            self.llm.allocator.events = None  # no router routes to a prefill worker by its cache
        else:
            self.llm.record_cache_events()
        self.generation += 1
        self._connect_messenger(tuple(msg.prefill))
        seconds = time.monotonic() - self.switch_started
        log.info(
            "%s: switched from %s to %s in %.3f s (%.3f s of it waiting for what was in flight)",
            self.spec.name,
            old,
            msg.role,
            seconds,
            settled,
        )
        self._send(Switched(self.spec.name, msg.role, seconds, settled))
