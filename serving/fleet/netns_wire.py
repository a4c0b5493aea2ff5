"""A link's delay and jitter without netem: the switch's frames carried in user space, each held for its
links' delay (netns.Hosts uses it where the kernel has no sch_netem and a link has delay_us or jitter_us).

It replaces the switch's bridges: this process runs inside the switch's namespace, holds a packet socket on
each host's port there, and forwards every frame a host sends to the port its destination MAC was last seen
on (every other port of that NIC index while unknown, and for broadcast and multicast), as a learning bridge
does, after holding it for the delay of the two links it crosses (sender's and receiver's), each drawn as
delay + uniform(-jitter, +jitter), at least 0, as netem draws it: frames with jitter overtake one another. The
rate stays tbf's on both sides of each link, and loss the eBPF classifier's; this only delays.

Frames keep their segmentation offload (PACKET_VNET_HDR): a TCP burst of up to 64 KiB crosses as one frame,
segmented by the port that sends it on, so the wire holds a few thousand frames a second, not a hundred
thousand. A frame that finds its port's queue full is dropped (ENOBUFS), as a switch drops it.

Standard library only, run as a script (`python netns_wire.py ...`): it prints `ready` once every socket is
bound, and exits when its owner (--owner pid) is gone or on SIGTERM; netns.remove kills it with the switch.
Nothing here reads a frame past its two MAC addresses.
"""

from __future__ import annotations

import argparse
import errno
import heapq
import os
import random
import selectors
import signal
import socket
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET, PACKET_VNET_HDR, PACKET_IGNORE_OUTGOING = 263, 15, 23
VNET_HDR = 10  # struct virtio_net_hdr before each frame
FRAME = VNET_HDR + 65536 + 64  # the largest offloaded frame and its header


class Wire:
    def __init__(self, ports: list[str], delay_us: int, jitter_us: int, seed: int = 0):
        """ports: the switch-side devices, each `h<host>n<nic>`; frames cross only between the same nic."""
        self.delay, self.jitter = delay_us / 1e6, jitter_us / 1e6
        self.random = random.Random(seed)
        self.sockets: dict[str, socket.socket] = {}
        self.group = {port: port.rsplit("n", 1)[1] for port in ports}  # a port's NIC index: its bridge
        self.seen: dict[tuple[str, bytes], str] = {}  # (nic, MAC) -> the port it was last seen on
        self.held: list[tuple[float, int, str, bytes]] = []  # (due, order, port, frame): a heap
        self.order = 0
        self.forwarded = self.dropped = 0

    def bind(self) -> None:
        """A packet socket on each port, taking frames with their offload header, not those it sends."""
        for port in self.group:
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
            s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)  # not the frames this sends
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            s.bind((port, ETH_P_ALL))
            s.setblocking(False)
            self.sockets[port] = s

    def _link(self) -> float:
        """One link's delay for one frame: delay + uniform(-jitter, jitter), at least 0."""
        if not self.jitter:
            return self.delay
        return max(0.0, self.delay + self.random.uniform(-self.jitter, self.jitter))

    def receive(self, port: str, frame: bytes, now: float) -> None:
        """Learn where the sender is, and hold the frame for each port it goes out on."""
        dst, src = frame[VNET_HDR : VNET_HDR + 6], frame[VNET_HDR + 6 : VNET_HDR + 12]
        nic = self.group[port]
        self.seen[(nic, src)] = port
        known = None if dst[0] & 1 else self.seen.get((nic, dst))  # broadcast and multicast: flood
        if known == port:
            return  # for the sender's own segment
        outs = [known] if known else [p for p in self.group if self.group[p] == nic and p != port]
        sent_at = now + self._link()  # the sender's link, once
        for out in outs:
            self.order += 1
            heapq.heappush(self.held, (sent_at + self._link(), self.order, out, frame))

    def send_due(self, now: float) -> float | None:
        """Send every frame whose time has come; the seconds until the next one (None: nothing held)."""
        while self.held and self.held[0][0] <= now:
            _, _, port, frame = heapq.heappop(self.held)
            try:
                self.sockets[port].send(frame)
                self.forwarded += 1
            except OSError:  # ENOBUFS / EAGAIN: the port's queue (tbf) is full; ENETDOWN: the NIC is down
                self.dropped += 1
        return self.held[0][0] - now if self.held else None

    def serve(self, owner: int | None) -> None:
        selector = selectors.DefaultSelector()
        for port, s in self.sockets.items():
            selector.register(s, selectors.EVENT_READ, port)
        buf = bytearray(FRAME)
        view = memoryview(buf)
        checked = time.monotonic()
        while True:
            wait = self.send_due(time.monotonic())
            wait = 1.0 if wait is None else min(wait, 1.0)
            ready = selector.select(wait if wait >= 0.002 else 0)  # epoll waits whole milliseconds
            if not ready and wait < 0.002:
                time.sleep(wait)  # a finer wait for the next frame's time, short enough to hold arrivals
            for key, _ in ready:
                s, now = key.fileobj, time.monotonic()
                while True:  # everything waiting on this socket
                    try:
                        n = s.recv_into(buf)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError as e:
                        if e.errno == errno.ENETDOWN:  # its host's NIC went down (a fault): up again later
                            break
                        return  # the port went away: the switch is being deleted
                    if n > VNET_HDR + 12:
                        self.receive(key.data, bytes(view[:n]), now)
            if owner and time.monotonic() - checked > 1.0:
                checked = time.monotonic()
                try:
                    os.kill(owner, 0)
                except ProcessLookupError:
                    return
                except PermissionError:
                    pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ports", nargs="+")
    parser.add_argument("--delay-us", type=int, default=0)
    parser.add_argument("--jitter-us", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--owner", type=int, default=None, help="exit once this pid is gone")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    wire = Wire(args.ports, args.delay_us, args.jitter_us, args.seed)
    wire.bind()
    print("ready", flush=True)
    try:
        wire.serve(args.owner)
    finally:
        print(f"forwarded {wire.forwarded} dropped {wire.dropped}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
