"""What crosses between the two messengers: control messages, and the notification that ends each post.

Control messages travel over a control channel (in-process queues here; pyzmq between processes). KV
bytes travel over the transfer backend, and every post carries the notification
``kind|request|writes`` so the decode side counts what has landed from the data path itself.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import time
from functools import cache
from typing import NamedTuple

from transfer.agents import Rails, check_rails, default_rails
from transfer.plan import ShardSpec
from transfer.wire import Codec, Message, WireError

log = logging.getLogger(__name__)

# in every Hello; a peer of another version is refused (5: identity digests, cancelled_at; 6: rails)
PROTOCOL_VERSION = 7
MAX_PROMPT_TOKENS = 1 << 22


def check_request_id(request_id: str) -> None:
    if not 0 < len(request_id) <= 256:
        raise ValueError(f"request_id must be 1 to 256 characters, got {len(request_id)}")


def check_request(request_id: str, prompt_ids: list[int]) -> None:
    """What every message that carries a request checks of it (the engine checks the ids themselves)."""
    check_request_id(request_id)
    if not 0 < len(prompt_ids) <= MAX_PROMPT_TOKENS:
        raise ValueError(f"prompt_ids must hold 1 to {MAX_PROMPT_TOKENS} tokens, got {len(prompt_ids)}")


@cache
def _machine() -> str:
    """This process's host as liveness needs it: hostname, boot and pid namespace (containers on one host
    share a hostname, and a pid means nothing outside its namespace)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        boot, pidns = "", 0
    return f"{socket.gethostname()}/{boot}/{pidns}"


class PrefillRequest(Message):
    """Decode -> prefill: compute the KV of these tokens and write it into these pages."""

    request_id: str
    prompt_ids: list[int]  # the prompt except its last token
    dst_pages: list[int]  # decode page ids (the same on every decode rank)
    dst_spec: ShardSpec
    dst_metadata: list[bytes]  # the decode side's agents' metadata (agent and registered regions): one per
    # decode TP rank, one per rank and NIC (dst_rails says which), or one for every rank (transfer.agents)
    context_slot: int  # row of the decode side's context buffer that receives the last hidden state
    seq: int  # the decode worker's number for this request, larger than any it sent before: every reply
    # and notification carries it, so a stale or duplicated message never counts for a later request of
    # the same id, and a request that arrives after its own Abort is dropped. Also seeds the plan's
    # replica rotation (both sides plan with it)
    skip_pages: int = 0  # the decode side holds these leading pages already (its prefix cache): write
    # only dst_pages[skip_pages:]
    cache_salt: str = ""  # the request's (the prefill side names and looks up its pages with it too)
    client: list[str] = []  # who it is for (digests): the prefill side admits by each client's share too
    dst_rails: list[tuple[int, str]] = []  # (TP rank, NIC) of each dst_metadata agent; [] names no NICs

    def __post_init__(self):
        check_request(self.request_id, self.prompt_ids)
        need = -(-len(self.prompt_ids) // self.dst_spec.page_size)
        if len(self.dst_pages) != need:
            raise ValueError(
                f"dst_pages holds {len(self.dst_pages)} pages; {len(self.prompt_ids)} tokens at page_size "
                f"{self.dst_spec.page_size} need {need}"
            )
        if not 0 <= self.skip_pages < need:
            raise ValueError(f"skip_pages must be in [0, {need}) (at least one page is written)")
        if any(not 0 <= p < self.dst_spec.num_pages for p in self.dst_pages):
            raise ValueError(f"dst_pages must be in [0, {self.dst_spec.num_pages}) (the decode cache)")
        if len(set(self.dst_pages)) != len(self.dst_pages):
            raise ValueError("dst_pages names a page twice")
        if self.context_slot < 0 or not 0 <= self.seq < 1 << 63:
            raise ValueError("context_slot must be >= 0 and seq in [0, 2**63)")
        if len(self.cache_salt) > 256:
            raise ValueError("cache_salt holds at most 256 characters")
        if len(self.client) > 2 or not all(0 < len(c) <= 64 for c in self.client):
            raise ValueError("client holds at most 2 names of 1-64 characters")
        if self.dst_rails:
            check_rails(self.dst_rails, len(self.dst_metadata), self.dst_spec.tp, "dst_rails")
        elif len(self.dst_metadata) not in (1, self.dst_spec.tp):
            raise ValueError(
                f"dst_metadata holds {len(self.dst_metadata)} agents' metadata; one per decode TP rank "
                f"({self.dst_spec.tp}) or one"
            )

    @property
    def held_tokens(self) -> int:
        """Leading prompt tokens the decode side holds already (skip_pages of its pages): never sent."""
        return self.skip_pages * self.dst_spec.page_size

    @property
    def rails(self) -> Rails:
        """The decode side's agents as (rank, NIC)."""
        return list(self.dst_rails) or default_rails(len(self.dst_metadata), self.dst_spec.tp)


class Hello(Message):
    """Prefill -> decode, once connected: its shard geometry (the decode side plans with it), its transfer
    agents' names (one per TP rank, or one for all: the only senders whose notifications count), and
    where it runs, so that a silent peer on the same machine can be told dead (its pages freed) from
    merely hung."""

    spec: ShardSpec
    agents: list[str]
    version: int = PROTOCOL_VERSION
    machine: str = ""
    pid: int = 0
    rails: list[tuple[int, str]] = []  # (TP rank, NIC) of each agent; [] names no NICs

    def __post_init__(self):
        if not all(self.agents) or len(set(self.agents)) != len(self.agents):
            raise ValueError(f"a Hello names each agent once, none empty, got {self.agents}")
        if self.rails:
            check_rails(self.rails, len(self.agents), self.spec.tp, "a Hello")
        elif len(self.agents) not in (1, self.spec.tp):
            raise ValueError(
                f"a Hello names one agent per TP rank ({self.spec.tp}) or one, got {self.agents}"
            )

    @staticmethod
    def of(spec: ShardSpec, agents: str | list[str], rails: Rails | None = None) -> Hello:
        agents = [agents] if isinstance(agents, str) else list(agents)
        return Hello(spec, agents, PROTOCOL_VERSION, _machine(), os.getpid(), list(rails or []))

    def peer_alive(self) -> bool | None:
        """False once the process is gone (or a zombie); None when it runs on another machine (or in
        another pid namespace), where this process cannot tell."""
        if not self.machine or self.machine != _machine() or self.pid <= 0:
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


class Accepted(Message):
    """Prefill -> decode: the request is queued there (ends the handshake stage)."""

    request_id: str
    seq: int


class Abort(Message):
    """Decode -> prefill: stop this request. The prefill side answers Ended once nothing is in flight,
    and at once for a request it does not hold (finished, refused or never seen)."""

    request_id: str
    seq: int
    reason: str
    # when its client went away (time.time() on the runtime's host; 0: not a client's cancel): the
    # prefill side counts the prompt tokens it computed for it more than one step later
    cancelled_at: float = 0.0


class Ended(Message):
    """Prefill -> decode: nothing more will be written for this request."""

    request_id: str
    seq: int
    error: str | None
    # decode agents a stuck post of it went to (then moved to another rail): renewed before its pages go
    stuck: list[str] = []

    def __post_init__(self):
        if len(self.stuck) > 64 or not all(0 < len(name) <= 300 for name in self.stuck):
            raise ValueError("stuck names at most 64 agents of 1-300 characters")


class Posted(Message):
    """Prefill -> decode, where a rank has several rails: every post of this request finished on this side,
    each decode agent's post numbers. Over TCP a post finishes once the kernel holds it, so a NIC lost
    after that loses writes no post of this side waits for: the decode side, missing some of them past
    transfer.rail_timeout_s, renews the agents they went to (and the request is sent again)."""

    request_id: str
    seq: int
    posts: dict[str, list[int]]  # decode agent -> the numbers of the posts that went to it

    def __post_init__(self):
        check_request_id(self.request_id)
        if len(self.posts) > 64 or not all(0 < len(name) <= 300 for name in self.posts):
            raise ValueError("posts names at most 64 agents of 1-300 characters")
        if sum(len(numbers) for numbers in self.posts.values()) > MAX_POSTS:
            raise ValueError(f"posts lists at most {MAX_POSTS} posts")


MAX_POSTS = 1 << 20  # a request's posts (at most 1 MiB each: a TiB of KV)
TO_PREFILL = (PrefillRequest, Abort)  # what a prefill worker's channel decodes
TO_DECODE = (Hello, Accepted, Ended, Posted)


def prefill_codec() -> Codec:
    return Codec(*TO_PREFILL)


def decode_codec() -> Codec:
    return Codec(*TO_DECODE)


class Notif(NamedTuple):
    """What ends each post: whose request (id and seq), the post's number within it (so a duplicate
    counts once), how many writes it carried, and for a post sent again over another rail, the decode
    agent the first one went to (its connection may still deliver: that agent is renewed before the
    request is released)."""

    kind: str  # kv | ctx
    request_id: str
    seq: int
    post: int
    writes: int
    stuck: str = ""  # the decode agent a stuck post of this number went to ("": none)

    def encode(self) -> bytes:
        return f"{self.kind}|{self.stuck}|{self.request_id}|{self.seq}|{self.post}|{self.writes}".encode()

    @staticmethod
    def parse(msg: bytes) -> Notif:
        """ValueError for anything that is not a notification."""
        try:
            kind, stuck, rest = msg.decode().split("|", 2)
            request_id, *numbers = rest.rsplit("|", 3)
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"not a transfer notification: {msg[:64]!r}") from e
        if kind not in ("kv", "ctx") or len(numbers) != 3 or not all(n.isdigit() for n in numbers):
            raise ValueError(f"not a transfer notification: {msg[:64]!r}")
        if len(stuck) > 300:
            raise ValueError(f"not a transfer notification: {msg[:64]!r}")
        check_request_id(request_id)
        return Notif(kind, request_id, *map(int, numbers), stuck)


class Endpoint:
    """One end of an in-process control channel (tests and single-process runs). Messages cross as bytes
    through the same codec as over a socket, so what a test injects is decoded as a real peer's would be."""

    def __init__(self, outbox: queue.Queue, inbox: queue.Queue, codec: Codec):
        self.outbox, self.inbox, self.codec = outbox, inbox, codec

    def send(self, msg, timeout_s: float = 10.0) -> None:
        self.outbox.put(self.codec.encode(msg))

    def heartbeat(self) -> None:
        pass  # both ends live in one process

    def peer_silent_for(self) -> float:
        return 0.0

    def receive(self) -> list:
        out = []
        while True:
            try:
                data = self.inbox.get_nowait()
            except queue.Empty:
                return out
            try:
                out.append(self.codec.decode(data))
            except WireError as e:
                log.warning("control channel: %s", e)


def local_channel() -> tuple[Endpoint, Endpoint]:
    """(decode end, prefill end) of an in-process control channel."""
    to_prefill, to_decode = queue.Queue(), queue.Queue()
    return Endpoint(to_prefill, to_decode, decode_codec()), Endpoint(to_decode, to_prefill, prefill_codec())


def wait_hello(channel, timeout_s: float, alive=lambda: True) -> Hello:
    """The first Hello on channel; TimeoutError after timeout_s or once alive() turns false, ValueError
    for a peer that speaks another protocol version."""
    give_up = time.monotonic() + timeout_s
    while True:
        for msg in channel.receive():
            if isinstance(msg, Hello):
                if msg.version != PROTOCOL_VERSION:
                    raise ValueError(
                        f"the prefill worker speaks protocol version {msg.version}; this one speaks "
                        f"{PROTOCOL_VERSION}: run one version of pdkernels on both"
                    )
                return msg
        if time.monotonic() > give_up or not alive():
            raise TimeoutError(f"no Hello from the prefill worker within {timeout_s} s")
        time.sleep(0.01)
