"""The switch's user-space wire (serving/fleet/netns_wire.py), which delays links where the kernel has no
netem: it forwards as a learning bridge, holds each frame for its two links' delay, draws jitter as netem
does, and drops what a full port refuses; across two hosts, a TCP round trip takes at least the four links'
delay and the bytes arrive intact."""

import os

import pytest

from experiments.bench.link_probe import probe
from serving.fleet import netns
from serving.fleet.netns import Hosts, Link
from serving.fleet.netns_wire import VNET_HDR, Wire

A, B, C = (bytes([2, 0, 0, 0, 0, i]) for i in (1, 2, 3))
BROADCAST = b"\xff" * 6


def _frame(dst: bytes, src: bytes, body: bytes = b"") -> bytes:
    return b"\0" * VNET_HDR + dst + src + b"\x08\x00" + body


class _Port:
    def __init__(self, full: bool = False):
        self.sent, self.full = [], full

    def send(self, frame: bytes) -> int:
        if self.full:
            raise OSError(105, "No buffer space available")
        self.sent.append(frame)
        return len(frame)


def _wire(delay_us=1000, jitter_us=0, full=()) -> Wire:
    wire = Wire(["h0n0", "h1n0", "h2n0", "h0n1", "h1n1"], delay_us, jitter_us, seed=1)
    wire.sockets = {port: _Port(port in full) for port in wire.group}
    return wire


def _sent(wire: Wire) -> dict[str, int]:
    return {port: len(s.sent) for port, s in wire.sockets.items() if s.sent}


def test_it_floods_until_it_has_seen_the_destination_then_sends_to_its_port_only():
    wire = _wire()
    wire.receive("h0n0", _frame(B, A), now=0.0)  # B not yet seen: every other port of NIC 0
    wire.send_due(1.0)
    assert _sent(wire) == {"h1n0": 1, "h2n0": 1}  # NIC 1's ports are another bridge
    wire.receive("h1n0", _frame(A, B), now=1.0)  # A was seen on h0n0
    wire.receive("h0n0", _frame(B, A), now=1.0)  # and now B on h1n0
    wire.send_due(2.0)
    assert _sent(wire) == {"h1n0": 2, "h2n0": 1, "h0n0": 1}
    wire.receive("h2n0", _frame(BROADCAST, C), now=2.0)  # broadcast: everyone else on NIC 0
    wire.send_due(3.0)
    assert _sent(wire) == {"h1n0": 3, "h2n0": 1, "h0n0": 2}


def test_a_frame_is_held_for_both_links_delay():
    wire = _wire(delay_us=1000)
    wire.receive("h1n0", _frame(A, B), now=0.0)  # flooded: A unseen
    wire.receive("h0n0", _frame(B, A), now=0.0)  # to h1n0 only
    assert wire.send_due(0.0019) == pytest.approx(0.0001)  # two links of 1 ms each
    assert not _sent(wire)
    assert wire.send_due(0.002) is None
    assert _sent(wire) == {"h0n0": 1, "h2n0": 1, "h1n0": 1}


def test_jitter_spreads_delays_as_netem_draws_them_and_reorders_frames():
    wire = _wire(delay_us=10_000, jitter_us=5_000)
    wire.receive("h1n0", _frame(A, B), now=0.0)  # learn both
    wire.receive("h0n0", _frame(B, A), now=0.0)
    wire.send_due(1.0)
    wire.sockets["h1n0"].sent.clear()
    for i in range(400):
        wire.receive("h0n0", _frame(B, A, i.to_bytes(2, "big")), now=i * 1e-4)
    held = sorted(wire.held, key=lambda h: h[1])  # in the order received
    delays = [due - i * 1e-4 for i, (due, _, _, _) in enumerate(held)]
    assert min(delays) >= 0.010 - 1e-9 and max(delays) <= 0.030 + 1e-9  # two links of 10 +- 5 ms
    assert max(delays) - min(delays) > 0.012  # spread over most of the range
    wire.send_due(10.0)
    order = [int.from_bytes(f[-2:], "big") for f in wire.sockets["h1n0"].sent]
    assert sorted(order) == list(range(400)) and order != sorted(order)  # all there, overtaken


def test_a_full_port_drops_the_frame_and_the_wire_goes_on():
    wire = _wire(delay_us=0)
    wire.receive("h1n0", _frame(A, B), now=0.0)
    wire.receive("h2n0", _frame(A, C), now=0.0)
    wire.sockets["h0n0"] = _Port(full=True)
    wire.send_due(0.0)
    assert (wire.forwarded, wire.dropped) == (2, 2)  # to h0n0 dropped, the floods to the others sent


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)")
def test_two_hosts_joined_by_the_wire_see_the_delay_and_their_bytes():
    """The wire where netem would be (chosen here, whatever the kernel has): a TCP echo's round trip
    crosses four links of 5 ms, so it takes at least 20 ms; 4 MB arrive whole; closing leaves no
    namespace and no wire running."""
    with Hosts(2, Link("200mbit", delay_us=5000), subnet=44, delay_by="wire") as hosts:
        assert hosts.delay_by == "wire"
        rtts, received, _ = probe(hosts, 4 << 20)
        assert min(rtts) >= 0.020
        assert received == 4 << 20
        assert hosts.counters(0)[0] >= 4 << 20  # it crossed host 0's NIC
        wire = hosts._wire
    assert wire.poll() is not None
    assert not [n for n in netns.namespaces() if n in (*hosts.names, hosts.switch)]
