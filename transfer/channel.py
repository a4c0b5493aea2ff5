"""The control channel between two messengers across processes: an authenticated pyzmq PAIR socket.

One socket per pair of workers. The bound end is a CURVE server that accepts only its one known peer's
key (transfer.auth), so a stranger that connects first is refused instead of taking the pair. Messages
are typed structs (transfer.protocol) decoded by the channel's strict codec; a frame that does not
decode is dropped and counted. Each end sends an empty heartbeat frame every HEARTBEAT_S while it polls,
so the other end can tell a dead or hung peer (`peer_silent_for`) from a slow one.
"""

from __future__ import annotations

import logging
import time

import zmq

from transfer.auth import Credentials, connect_as, serve
from transfer.wire import MAX_MESSAGE_BYTES, Codec, WireError

log = logging.getLogger(__name__)
HEARTBEAT_S = 0.2
_PING = b""


class ZmqEndpoint:
    """One end of a PAIR socket to the member `peer`, decoding with `codec`. The end that speaks first
    should connect: messages sent to a bound end before its peer connects cannot be queued (send waits
    up to its timeout), a connecting end's can."""

    def __init__(self, address: str, bind: bool, creds: Credentials, peer: str, codec: Codec):
        self.peer, self.codec = peer, codec
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if bind:
            serve(self._sock, creds, f"{creds.name}<-{peer}", [peer])
            self._sock.bind(address)
        else:
            connect_as(self._sock, creds, peer)
            self._sock.connect(address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)  # with the port chosen for ":0"
        self._last_seen = time.monotonic()
        self._last_ping = 0.0

    def send(self, msg, timeout_s: float = 10.0) -> None:
        """Send a message; raise TimeoutError (having sent nothing) if the peer cannot take it in time."""
        if not self._sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
            raise TimeoutError(f"control channel: {self.peer} took no message for {timeout_s} s")
        self._sock.send(self.codec.encode(msg), zmq.NOBLOCK)

    def receive(self) -> list:
        """Every valid message waiting now (heartbeats only refresh the peer's last-seen time)."""
        self.heartbeat()
        out = []
        while self._sock.poll(0):
            data = self._sock.recv()
            self._last_seen = time.monotonic()
            if data == _PING:
                continue
            try:
                out.append(self.codec.decode(data))
            except WireError as e:
                log.warning("control channel from %s: %s", self.peer, e)
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
