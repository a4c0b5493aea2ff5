"""The server's connections (serving/http/connections.py): a request's arrival as its client counts
it. The caps and deadlines are tested end to end (experiments/test_serve_clients.py and
test_serve_hostile_workers.py)."""

import socket
import time

from serving.http.connections import arrived_in_kernel


class _Transport:
    def __init__(self, sock):
        self.sock = sock

    def get_extra_info(self, key):
        return self.sock if key == "socket" else None


def test_a_request_s_arrival_is_when_its_bytes_reached_the_kernel_not_when_they_were_read():
    """A busy event loop reads a request late; its TTFT counts from when it came (TCP_INFO)."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    try:
        client.sendall(b"POST / HTTP/1.1\r\n")
        sent = time.perf_counter()
        accepted.setblocking(True)
        accepted.recv(1, socket.MSG_PEEK)  # it is there
        time.sleep(0.2)  # the loop is busy elsewhere
        arrived = arrived_in_kernel(_Transport(accepted))
        assert sent - 0.03 <= arrived <= sent + 0.05  # TCP_INFO counts in jiffies (1-10 ms)
    finally:
        for s in (client, accepted, server):
            s.close()


def test_without_a_socket_the_arrival_is_now():
    before = time.perf_counter()
    assert before <= arrived_in_kernel(_Transport(None)) <= time.perf_counter()
