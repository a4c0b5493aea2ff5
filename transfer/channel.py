"""The control channel between two messengers across processes: a pyzmq PAIR socket with heartbeats.

Messages are pickled protocol dataclasses. Each end sends a heartbeat every HEARTBEAT_S while it polls,
so the other end can tell a dead or hung peer (`peer_silent_for`) from a slow one.
"""

from __future__ import annotations

import pickle
import time

import zmq

HEARTBEAT_S = 0.2
_PING = b"ping"


class ZmqEndpoint:
    """One end of a PAIR socket. The end that speaks first should connect: messages sent to a bound end
    before its peer connects cannot be queued (send waits up to its timeout), a connecting end's can."""

    def __init__(self, address: str, bind: bool):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        if bind:
            self._sock.bind(address)
        else:
            self._sock.connect(address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)  # with the port chosen for ":0"
        self._last_seen = time.monotonic()
        self._last_ping = 0.0

    def send(self, msg, timeout_s: float = 10.0) -> None:
        """Send a message; raise TimeoutError if the peer cannot take it within timeout_s."""
        if not self._sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
            raise TimeoutError(f"control channel: the peer took no message for {timeout_s} s")
        self._sock.send(pickle.dumps(msg), zmq.NOBLOCK)

    def receive(self) -> list:
        """Every message waiting now (heartbeats only refresh the peer's last-seen time)."""
        self.heartbeat()
        out = []
        while self._sock.poll(0):
            data = self._sock.recv()
            self._last_seen = time.monotonic()
            if data != _PING:
                out.append(pickle.loads(data))
        return out

    def heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_ping >= HEARTBEAT_S:
            try:
                self._sock.send(_PING, zmq.NOBLOCK)
            except zmq.Again:  # no peer connected yet, or it stopped reading: its silence tells
                pass
            self._last_ping = now

    def peer_silent_for(self) -> float:
        return time.monotonic() - self._last_seen

    def close(self) -> None:
        self._sock.close()
