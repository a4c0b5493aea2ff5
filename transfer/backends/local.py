"""In-process copies behind the Backend interface, for single-process tests of the messenger logic."""

from __future__ import annotations

import threading
from collections import deque

import torch
from torch import Tensor

from transfer.backends.base import Backend, TransferError, as_ops
from transfer.wire import Codec, Message, WireError


class LocalMetadata(Message):
    name: str


_CODEC = Codec(LocalMetadata)

_AGENTS: dict[str, LocalBackend] = {}  # every live local agent of this process, by name
_LOCK = threading.Lock()


class LocalBackend(Backend):
    def __init__(self, name: str):
        with _LOCK:
            if name in _AGENTS:
                raise ValueError(f"a local transfer agent named {name!r} already exists")
            _AGENTS[name] = self
        self.name = name
        self.regions: list[Tensor] = []
        self._inbox: deque[tuple[str, bytes]] = deque()
        self._peers: set[str] = set()

    def register(self, regions: list[Tensor]) -> None:
        self.regions += [r.view(-1).view(torch.uint8) for r in regions]

    def metadata(self) -> bytes:
        return _CODEC.encode(LocalMetadata(self.name))

    def connect(self, peer_metadata: bytes) -> str:
        try:
            peer = _CODEC.decode(peer_metadata).name
        except WireError as e:
            raise TransferError(f"peer metadata refused: {e}") from e
        if peer not in _AGENTS:
            raise TransferError(f"no local transfer agent named {peer!r}")
        self._peers.add(peer)
        return peer

    def region_sizes(self, peer: str) -> tuple[list[int], list[int]]:
        target = _AGENTS.get(peer) if peer in self._peers else None
        if target is None:
            raise TransferError(f"peer {peer!r} is not connected")
        return [r.numel() for r in self.regions], [r.numel() for r in target.regions]

    def post(self, peer: str, ops, notif: bytes) -> object:
        ops = as_ops(ops)
        self.check(peer, ops)
        target = _AGENTS[peer]
        for local_region, local_offset, remote_region, remote_offset, nbytes in ops.tolist():
            dst = target.regions[remote_region][remote_offset : remote_offset + nbytes]
            dst.copy_(self.regions[local_region][local_offset : local_offset + nbytes])
        target._inbox.append((self.name, notif))
        return "DONE"

    def state(self, handle: object) -> str:
        return "DONE"

    def release(self, handle: object) -> None:
        pass

    def notifications(self) -> list[tuple[str, bytes]]:
        out = []
        while self._inbox:
            out.append(self._inbox.popleft())
        return out

    def disconnect(self, peer: str) -> None:
        self._peers.discard(peer)

    def close(self) -> None:
        with _LOCK:
            _AGENTS.pop(self.name, None)

    def retire(self) -> None:
        self.close()  # a copy still owed to this name lands nowhere

    def renewed(self) -> LocalBackend:
        base, _, n = self.name.partition("~")
        new = LocalBackend(f"{base}~{int(n or 0) + 1}")
        new.register(self.regions)
        new.rank, new.nic = self.rank, self.nic
        return new
