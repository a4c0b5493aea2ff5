"""The HTTP server's connections, bounded (uvicorn's h11 protocol, two limits added):

- a header deadline: a connection must send a whole request line and headers within header_timeout_s
  of connecting, or of its previous response's end, else it is closed. uvicorn times only the gap
  between the requests of a kept-alive connection, and a byte of a header cancels that: 600 slowloris
  connections (a header line every few seconds) and 600 that never sent a byte were held open for as
  long as their clients liked;
- a connection cap: at max_connections open at once, the connection that has waited longest for its
  next request (kept alive, or opened and silent) is closed to let a new one in, as nginx reuses idle
  keep-alive connections: nine addresses holding 64 idle sockets each (576 > 512) had another client's
  new connections refused for 39 of 40 tries. Only when none is idle is a new connection answered 503
  (OpenAI's error shape, Retry-After) at once, before anything of it is parsed, and its sending side
  shut; what it sends then is read and dropped for at most LINGER_S and LINGER_BYTES before it is closed
  (a lingering close, as nginx's: closed while the client still sent its request, the kernel answered its
  bytes with a reset, and the client saw a broken pipe instead of the 503);
- a cap per client address (max_connections_per_client, below max_connections): one client that opened
  every connection and reopened each one the header deadline closed held the whole cap, and another
  client's requests got 503 for 48 of 50 over 25 s. At its own cap a client's own idlest connection makes
  way for its new one; past it, with none idle, it is refused the same way, and the rest of the cap stays
  for others. Only accepted connections count towards either cap: counted, the refused ones lingering
  their second kept the whole cap full for a client that reopened them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections import Counter

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

RETRY_AFTER_S = 1
ARRIVED = "pdk_arrived"  # the request scope's state key: perf_counter when the request began to arrive
# Linux's struct tcp_info: 8 bytes of u8 fields, then u32 rto, ato, snd_mss, rcv_mss, unacked, sacked,
# lost, retrans, fackets, last_data_sent, last_ack_sent, last_data_recv (ms since the last data came)
LAST_DATA_RECV_OFFSET, TCP_INFO_BYTES = 8 + 11 * 4, 104
LINGER_S, LINGER_BYTES = 1.0, 1 << 16  # how long and how much a refused connection is read and dropped


def _busy_response(message: str) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "service_unavailable",
                "param": None,
                "code": "service_unavailable",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"retry-after: {RETRY_AFTER_S}\r\nconnection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


BUSY = _busy_response("too many connections are open (server.max_connections); retry shortly")
BUSY_CLIENT = _busy_response(
    "too many connections are open from this address (server.max_connections_per_client); retry shortly"
)


def arrived_in_kernel(transport: asyncio.Transport) -> float:
    """perf_counter when the socket's latest data reached the kernel (TCP_INFO's tcpi_last_data_recv, in
    ms), not when the event loop got to read it: a busy loop read a burst of new requests 200 ms after
    their clients had sent them (what their TTFT counts). Now where TCP_INFO is not to be had."""
    now = time.perf_counter()
    sock = transport.get_extra_info("socket")
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
        (ago_ms,) = struct.unpack_from("I", info, LAST_DATA_RECV_OFFSET)
    except (AttributeError, OSError, struct.error):
        return now
    return now - ago_ms / 1000 if ago_ms < 60_000 else now


def guarded_h11(header_timeout_s: float, max_connections: int, per_client: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with these limits (uvicorn.Config(http=...))."""
    open_from: Counter[str] = Counter()  # accepted connections open, by client address
    idle: dict[H11Protocol, float] = {}  # open connections between requests -> since when (oldest first)

    class Guarded(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _refused: int | None = None  # over the cap: the bytes it may still send, read and dropped
        _address: str | None = None  # counted in open_from while open
        _began: float | None = None  # perf_counter of the first bytes of the request being read

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
            if open_from[address] >= per_client and not self._evict(address):
                self._refuse(transport, BUSY_CLIENT)
                return
            if open_from.total() >= max_connections and not self._evict(None):
                self._refuse(transport, BUSY)  # refused ones linger a moment, not counted
                return
            open_from[address] += 1
            self._address = address
            self._idle()
            self._arm()

        def _evict(self, address: str | None) -> bool:
            """Close the connection that has waited longest for its next request (of address's, or
            anyone's): a client's kept-alive socket costs it a reconnect, not another client its turn.
            Whether one was closed."""
            oldest = next((c for c in idle if address is None or c._address == address), None)
            if oldest is None:
                return False
            oldest._close_idle()
            return True

        def _close_idle(self) -> None:
            self._disarm()
            idle.pop(self, None)
            if self._address is not None:  # counted out now: its close is heard a moment later
                open_from[self._address] -= 1
                if not open_from[self._address]:
                    del open_from[self._address]
                self._address = None
            self.transport.close()

        def _idle(self) -> None:
            idle.pop(self, None)
            idle[self] = time.monotonic()  # last: the order is the order they went idle

        def _refuse(self, transport: asyncio.Transport, response: bytes) -> None:
            """Answer 503 at once, shut the sending side, and close after a lingering read."""
            transport.write(response)
            if transport.can_write_eof():
                transport.write_eof()
            self._refused = LINGER_BYTES
            self.loop.call_later(LINGER_S, transport.close)

        def data_received(self, data: bytes) -> None:
            if self._refused is not None:  # never parsed
                self._refused -= len(data)
                if self._refused < 0:
                    self.transport.close()
                return
            idle_before = self.conn.their_state is h11.IDLE  # between requests: these begin the next one
            if idle_before and self._began is None:  # when it arrived, as its client counts
                self._began = arrived_in_kernel(self.transport)
            super().data_received(data)
            if idle_before and self.conn.their_state is not h11.IDLE:  # its request line and headers are in:
                self._disarm()  # busy until its response is complete (a trickle of headers stays evictable)
                idle.pop(self, None)
                scope = getattr(self, "scope", None)
                if scope is not None:  # the route reads it (serving.http.routes: arrived_at)
                    scope.setdefault("state", {})[ARRIVED] = self._began
                self._began = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._idle()
                self._arm()  # the next request's headers are due too (a byte of them stops keep-alive)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            idle.pop(self, None)
            if self._address is not None:
                open_from[self._address] -= 1
                if not open_from[self._address]:
                    del open_from[self._address]
                self._address = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return Guarded
