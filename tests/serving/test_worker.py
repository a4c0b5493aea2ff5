"""The worker process's own parts (its role loops run in tests/experiments' end-to-end jobs)."""

import os
from types import SimpleNamespace

import zmq

from serving.worker import listen_address
from transfer.auth import keyring
from transfer.channel import ZmqEndpoint
from transfer.config import TransferConfig
from transfer.plan import ShardSpec
from transfer.protocol import Hello, decode_codec, prefill_codec, wait_hello

SPEC = ShardSpec(tp=1, num_kv_heads=2, num_layers=2, num_pages=8, page_size=4, head_dim=8, itemsize=4)


def _reconnects(monitor) -> bool:
    """Whether the old socket reaches a listener on its own: True once it connects, False after two
    failed tries reported past this call (the first may have set out before it; the second set out
    after)."""
    while monitor.poll(0):  # what happened before
        monitor.recv_multipart()
    failed = 0
    while failed < 2:
        kind = int.from_bytes(monitor.recv_multipart()[0][:2], "little")
        if kind == zmq.EVENT_CONNECTED:
            return True
        failed += kind == zmq.EVENT_CONNECT_RETRIED
    return False


def test_a_restarted_decode_worker_listens_where_its_predecessors_prefill_socket_cannot_reach(
    tmp_path, monkeypatch
):
    """A decode worker's restarted process binds a path of its own: the prefill worker's socket to the
    dead process cannot reconnect to it, and the new socket's Hello arrives. On the old shared path the
    old socket reconnected first whenever the prefill worker was busy, the PAIR socket dropped the new
    socket's Hello, and the restarted worker waited for it (a CI run: the restart never came back)."""
    creds = keyring(["decode-0", "prefill-0"])
    spec = SimpleNamespace(name="decode-0", run_dir=str(tmp_path), transfer=TransferConfig())
    assert spec.transfer.control_transport == "ipc"
    first = ZmqEndpoint(
        listen_address(spec, "prefill-0"), True, creds["decode-0"], "prefill-0", decode_codec()
    )
    old = ZmqEndpoint(first.address, False, creds["prefill-0"], "decode-0", prefill_codec())
    hello = Hello.of(SPEC, "prefill-0-agent")
    old.send(hello)
    assert wait_hello(first, timeout_s=30).agents == ["prefill-0-agent"]
    monitor = old._sock.get_monitor_socket()
    first.close()  # the decode worker dies (its socket file stays, as after SIGKILL)
    monkeypatch.setattr(os, "getpid", lambda: 4_194_303)  # its restart: another process
    again = listen_address(spec, "prefill-0")
    second = ZmqEndpoint(again, True, creds["decode-0"], "prefill-0", decode_codec())
    try:
        # the old socket tries its peer again: it must find no listener (before: the restarted one)
        assert not _reconnects(monitor)
        new = ZmqEndpoint(second.address, False, creds["prefill-0"], "decode-0", prefill_codec())
        new.send(hello)
        old.close()  # the prefill worker lets the old channel go once it has the new one
        assert wait_hello(second, timeout_s=30).agents == ["prefill-0-agent"]
        new.close()
    finally:
        monitor.close()
        second.close()
