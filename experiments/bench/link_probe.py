"""What a shaped link between two netns hosts does to TCP: ten one-byte round trips, then a bulk send.

    python -m experiments.bench.link_probe --rate 1gbit --delay-us 1000 [--jitter-us 0] [--mbytes 200]
        [--delay-by auto|netem|wire]

builds two hosts (serving/fleet/netns.py; root), serves on host 1 and calls from host 0, and prints
the round trips (a round trip crosses four links: each host's, both ways), the bulk rate, and what
delayed the links (netem or the switch's user-space wire, netns_wire). The two ends are this module too:
`serve ADDR` echoes ten bytes, then counts what follows and answers with the count; `call ADDR N` prints
the round trips (seconds) on one line and the count the server received on the next.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

PORT = 5101
ROOT = Path(__file__).resolve().parents[2]


def serve(address: str) -> None:
    server = socket.create_server((address, PORT))
    print("listening", flush=True)
    conn, _ = server.accept()
    for _ in range(10):
        conn.sendall(conn.recv(1))
    received = 0
    while chunk := conn.recv(1 << 20):
        received += len(chunk)
    conn.sendall(str(received).encode())
    conn.close()


def call(address: str, nbytes: int) -> None:
    conn = socket.create_connection((address, PORT), timeout=60)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(10):
        start = time.monotonic()
        conn.sendall(b"x")
        assert conn.recv(1) == b"x"
        rtts.append(time.monotonic() - start)
    start = time.monotonic()
    conn.sendall(b"\0" * nbytes)
    conn.shutdown(socket.SHUT_WR)
    received = conn.recv(100).decode()
    print(" ".join(f"{r:.6f}" for r in rtts))
    print(received, f"{time.monotonic() - start:.6f}")


def probe(hosts, nbytes: int) -> tuple[list[float], int, float]:
    """(round trips s, bytes the server received, bulk seconds) between hosts 0 and 1."""
    me = [sys.executable, "-m", "experiments.bench.link_probe"]
    server = hosts.run(1, [*me, "serve", hosts.address(1)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "listening":
            raise RuntimeError("the probe's server did not start")
        done = subprocess.run(
            hosts.command(0, [*me, "call", hosts.address(1), str(nbytes)]),
            cwd=ROOT, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"the probe's call failed: {done.stderr[-2000:]}")
    finally:
        server.wait(timeout=60)
    rtts, bulk = done.stdout.splitlines()[:2]
    received, seconds = bulk.split()
    return [float(r) for r in rtts.split()], int(received), float(seconds)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("serve", "call"):
        serve(argv[1]) if argv[0] == "serve" else call(argv[1], int(argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--delay-us", type=int, default=0)
    parser.add_argument("--jitter-us", type=int, default=0)
    parser.add_argument("--mbytes", type=int, default=100)
    parser.add_argument("--delay-by", default="auto", choices=["auto", "netem", "wire"])
    parser.add_argument("--subnet", type=int, default=60)
    args = parser.parse_args(argv)
    from serving.fleet.netns import Hosts, Link

    link = Link(args.rate, delay_us=args.delay_us, jitter_us=args.jitter_us)
    with Hosts(2, link, subnet=args.subnet, delay_by=args.delay_by) as hosts:
        rtts, received, seconds = probe(hosts, args.mbytes << 20)
        print(
            f"link {args.rate}, {args.delay_us} us +- {args.jitter_us} us a link, delayed by {hosts.delay_by}"
        )
        print("round trips ms:", " ".join(f"{r * 1e3:.1f}" for r in rtts))
        print(f"bulk: {received:,} bytes in {seconds:.2f} s = {received * 8 / seconds / 1e6:.1f} Mbit/s")


if __name__ == "__main__":
    main()
