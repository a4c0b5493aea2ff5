"""Starting the Mooncake Store's processes (transfer/backends/mooncake.py): a port taken between our pick
and the store's bind is never mistaken for the store, and the store starts again on other ports; a store
that cannot start says why, from its own log, and leaves no process behind."""

import logging
import os
import socket
import subprocess
import sys

import pytest

import transfer.backends.mooncake as mooncake
from tests import needs

needs.nixl()


@pytest.fixture
def lose_memory_port(monkeypatch):
    """lose_memory_port(tries): on those tries (1, 2, ...) this test binds and listens on the memory
    process's port (each try's fourth pick) before the store does: the window between free_port and
    the store's bind, lost to another process."""
    picks, held, tries = [], [], set()
    pick = mooncake.free_port

    def free_port(host):
        port = pick(host)
        picks.append(port)
        if len(picks) % 4 == 0 and len(picks) // 4 in tries:
            s = socket.socket()
            s.bind((host, port))
            s.listen()
            held.append(s)
        return port

    monkeypatch.setattr(mooncake, "free_port", free_port)
    yield lambda *lost: tries.update(lost) or held
    for s in held:
        s.close()


def test_only_the_process_holding_a_listening_socket_listens_on_its_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert mooncake._listens(os.getpid(), port)
        waits = [sys.executable, "-c", "import sys; sys.stdin.read()"]
        child = subprocess.Popen(waits, stdin=subprocess.PIPE)
        try:
            assert not mooncake._listens(child.pid, port)  # the port listens, but not on child's socket
        finally:
            child.communicate(b"")
    assert not mooncake._listens(os.getpid(), port)  # closed
    assert not mooncake._listens(child.pid, port)  # no such process now


def test_a_store_whose_memory_port_was_taken_starts_again_on_other_ports(tmp_path, lose_memory_port, caplog):
    held = lose_memory_port(1)
    with caplog.at_level(logging.WARNING, logger=mooncake.__name__):
        store = mooncake.StoreProcesses("127.0.0.1", 16 << 20, str(tmp_path))
    try:
        assert len(held) == 1 and store.alive() and len(store.procs) == 3
        memory = store.procs[-1]
        assert not mooncake._listens(memory.pid, held[0].getsockname()[1])
        retry = [r.getMessage() for r in caplog.records if "starting the store again" in r.getMessage()]
        assert len(retry) == 1 and "memory exited at start (code 1)" in retry[0]
        assert "store-memory.log" in retry[0]
    finally:
        store.stop()
    assert not store.procs and memory.poll() is not None


def test_a_store_that_never_starts_says_why_and_leaves_nothing_running(
    tmp_path, lose_memory_port, monkeypatch
):
    monkeypatch.setattr(mooncake, "STARTS", 1)
    lose_memory_port(1)
    started = []
    popen = subprocess.Popen

    def spy(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(mooncake.subprocess, "Popen", spy)
    with pytest.raises(mooncake.ExitedAtStart, match=r"memory exited at start \(code 1\); its log") as e:
        mooncake.StoreProcesses("127.0.0.1", 16 << 20, str(tmp_path))
    with open(tmp_path / "store-memory.log") as f:
        last = f.read().strip().splitlines()[-1]
    assert last[-100:] in str(e.value)  # the log's own last line: why it exited
    assert len(started) == 3 and all(p.poll() is not None for p in started)  # none left running
