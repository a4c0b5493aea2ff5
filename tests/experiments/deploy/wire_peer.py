"""Two ends of a TCP connection between hosts (tests/experiments/deploy/test_netns_wire.py): `serve ADDR`
echoes ten one-byte messages, then counts the bytes that follow and answers with the count; `call ADDR N`
prints the ten round trips (seconds) on one line and the count the server received on the next."""

import socket
import sys
import time

PORT = 5101


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
    conn.sendall(b"\0" * nbytes)
    conn.shutdown(socket.SHUT_WR)
    print(" ".join(f"{r:.6f}" for r in rtts))
    print(conn.recv(100).decode())


if __name__ == "__main__":
    {"serve": lambda: serve(sys.argv[2]), "call": lambda: call(sys.argv[2], int(sys.argv[3]))}[sys.argv[1]]()
