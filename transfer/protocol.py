"""What crosses between the two messengers: control messages, and the notification that ends each post.

Control messages travel over a control channel (in-process queues here; pyzmq between processes). KV
bytes travel over the transfer backend, and every post carries the notification
``kind|request|writes`` so the decode side counts what has landed from the data path itself.
"""

from __future__ import annotations

import os
import queue
import socket
import time
from dataclasses import dataclass, field

from transfer.plan import ShardSpec


@dataclass(frozen=True)
class PrefillRequest:
    """Decode -> prefill: compute the KV of these tokens and write it into these pages."""

    request_id: str
    prompt_ids: list[int]  # the prompt except its last token
    dst_pages: list[int]  # decode page ids (the same on every decode rank)
    dst_spec: ShardSpec
    dst_metadata: bytes  # the decode backend's metadata (agent and registered regions)
    context_slot: int  # row of the decode side's context buffer that receives the last hidden state
    seed: int  # picks source replicas in the plan; both sides plan with it


@dataclass(frozen=True)
class Hello:
    """Prefill -> decode, once connected: its shard geometry (the decode side plans with it), and where it
    runs, so that a silent peer on the same host can be told dead (its pages freed) from merely hung."""

    spec: ShardSpec
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)

    def peer_alive(self) -> bool | None:
        """False once the process is gone (or a zombie); None when it runs on another host."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # killed but not yet reaped by its parent
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return True


@dataclass(frozen=True)
class Accepted:
    """Prefill -> decode: the request is queued there (ends the handshake stage)."""

    request_id: str


@dataclass(frozen=True)
class Abort:
    """Decode -> prefill: stop this request. The prefill side answers Ended once nothing is in flight."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class Ended:
    """Prefill -> decode: nothing more will be written for this request."""

    request_id: str
    error: str | None


def notif(kind: str, request_id: str, writes: int) -> bytes:
    return f"{kind}|{request_id}|{writes}".encode()


def parse_notif(msg: bytes) -> tuple[str, str, int]:
    kind, request_id, writes = msg.decode().rsplit("|", 2)
    return kind, request_id, int(writes)


class Endpoint:
    """One end of an in-process control channel (tests and single-process runs)."""

    def __init__(self, outbox: queue.Queue, inbox: queue.Queue):
        self.outbox, self.inbox = outbox, inbox

    def send(self, msg, timeout_s: float = 10.0) -> None:
        self.outbox.put(msg)

    def heartbeat(self) -> None:
        pass  # both ends live in one process

    def peer_silent_for(self) -> float:
        return 0.0

    def receive(self) -> list:
        out = []
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out


def local_channel() -> tuple[Endpoint, Endpoint]:
    """(decode end, prefill end) of an in-process control channel."""
    to_prefill, to_decode = queue.Queue(), queue.Queue()
    return Endpoint(to_prefill, to_decode), Endpoint(to_decode, to_prefill)


def wait_hello(channel, timeout_s: float, alive=lambda: True) -> Hello:
    """The first Hello on channel; TimeoutError after timeout_s or once alive() turns false."""
    give_up = time.monotonic() + timeout_s
    while True:
        for msg in channel.receive():
            if isinstance(msg, Hello):
                return msg
        if time.monotonic() > give_up or not alive():
            raise TimeoutError(f"no Hello from the prefill worker within {timeout_s} s")
        time.sleep(0.01)
