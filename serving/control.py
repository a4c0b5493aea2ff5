"""The runtime's control plane to its workers: the ROUTER socket that accepts only the deployment's keys
(transfer.auth's CURVE), typed messages in and out (messages.py, transfer.wire), and the private
directory its ipc:// sockets live in."""

from __future__ import annotations

import logging
import os
import tempfile

from serving.messages import driver_codec
from transfer.auth import Credentials
from transfer.config import TransferConfig
from transfer.wire import MAX_MESSAGE_BYTES, WireError

log = logging.getLogger(__name__)
_CODEC = driver_codec()


def driver_socket(keys: dict[str, Credentials], run_dir: str, transfer: TransferConfig):
    """The driver's ROUTER socket, bound and accepting only the keyring's workers."""
    import zmq

    from transfer.auth import serve

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    serve(sock, keys["driver"], f"driver:{run_dir}", [n for n in keys if n != "driver"])
    t = transfer
    sock.bind(f"ipc://{run_dir}/driver" if t.control_transport == "ipc" else f"tcp://{t.control_host}:0")
    return sock


def recv_all(sock) -> list[tuple[str, object]]:
    """(worker, message) for every valid message waiting; a frame whose identity is not the worker its
    key belongs to, or that does not decode, is dropped and logged."""
    import zmq

    from transfer.auth import sender

    out = []
    while sock.poll(0, zmq.POLLIN):
        frames = sock.recv_multipart(copy=False)
        name = frames[0].bytes.decode(errors="replace")
        if len(frames) != 2 or sender(frames[1]) != name:
            log.warning("dropped a message whose identity %r is not its sender's", name)
            continue
        try:
            out.append((name, _CODEC.decode(frames[1].bytes)))
        except WireError as e:
            log.warning("from %s: %s", name, e)
    return out


def send_to(sock, name: str, msg) -> bool:
    import zmq

    try:
        sock.send_multipart([name.encode(), _CODEC.encode(msg)], zmq.NOBLOCK)
        return True
    except zmq.ZMQError:  # the worker is gone (ROUTER_MANDATORY) or not taking messages
        return False


IPC_PATH_MAX = 107  # bytes of a unix socket's path (sockaddr_un.sun_path, less its terminator)


def private_dir(names: list[str]) -> str:
    """A new directory (mode 0700: only this user reaches its sockets) for the run's ipc:// sockets, in
    TMPDIR; in /tmp when TMPDIR is so long that a socket's path would pass the kernel's limit."""
    # (+ 8: a decode worker's sockets carry its pid, + 4: an elastic worker's the generation of its messenger)
    longest = max(len(f"{a}-{b}") for a in [*names, "driver"] for b in names) + 1 + 8 + 4
    run_dir = tempfile.mkdtemp(prefix="pdk-")
    if len(run_dir.encode()) + longest > IPC_PATH_MAX:
        os.rmdir(run_dir)
        run_dir = tempfile.mkdtemp(prefix="pdk-", dir="/tmp")
    return run_dir
