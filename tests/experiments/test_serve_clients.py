"""One client's share of what the server holds for all (issue 56): connections per client address. Clients
come from addresses of their own in 127.0.0.0/8 (every one of them is this machine's loopback), so the
server tells them apart as it would hosts."""

import http.client
import json
import signal
import socket
import time

import pytest

from tests.experiments.hostile import _start

OK = {"model": "tiny-random", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
ATTACKER, VICTIM = "127.0.0.3", "127.0.0.2"


def _post(url: str, source: str) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60, source_address=(source, 0))
    try:
        conn.request("POST", "/v1/completions", json.dumps(OK), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _first_bytes(sock: socket.socket) -> bytes:
    """What the server sent before closing (a refused connection's 503), or b"" if it kept it open."""
    sock.settimeout(0.5)
    try:
        return sock.recv(4096)
    except TimeoutError:
        return b""


@pytest.fixture
def server(tmp_path):
    proc, url = _start(
        tmp_path, "deployment=colocated", "server.max_connections=8", "server.max_connections_per_client=3",
        "server.header_timeout_s=2",
    )  # fmt: skip
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def test_one_client_holding_every_connection_locks_no_one_else_out(server):
    """An attacker opens the whole global cap (8) and reopens each one the server closes: it holds only its
    3; the rest are answered 503 naming server.max_connections_per_client, and another client's
    requests are all served meanwhile (on 359d433: 503 for 48 of 50)."""
    host, port = server.removeprefix("http://").rsplit(":", 1)

    def connect() -> socket.socket:
        return socket.create_connection((host, int(port)), source_address=(ATTACKER, 0))

    held = [connect() for _ in range(8)]
    answers = [_first_bytes(s) for s in held]
    refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
    assert len(refused) == 5 and all(b"server.max_connections_per_client" in a for a in refused)
    served = 0
    for _ in range(10):
        for i, s in enumerate(held):  # whatever the server closed (refused, or past its header deadline)
            s.setblocking(False)
            try:
                gone = s.recv(4096) is not None  # b"": closed; bytes: a refused one's 503
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                s.close()
                held[i] = connect()
        status, body = _post(server, VICTIM)
        assert status == 200, body
        served += 1
    assert served == 10
    for s in held:
        s.close()


def test_a_client_gets_its_share_back_when_its_connections_close(server):
    host, port = server.removeprefix("http://").rsplit(":", 1)
    source = ("127.0.0.4", 0)
    first = [socket.create_connection((host, int(port)), source_address=source) for _ in range(3)]
    extra = socket.create_connection((host, int(port)), source_address=source)
    assert _first_bytes(extra).startswith(b"HTTP/1.1 503")
    extra.close()
    for s in first:
        s.close()
    give_up = time.monotonic() + 60
    while (status := _post(server, "127.0.0.4")[0]) != 200 and time.monotonic() < give_up:
        time.sleep(0.05)  # the server hears the closes a moment later
    assert status == 200
