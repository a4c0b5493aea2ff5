"""The interface every transfer engine implements; the messenger never knows which one it has."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

from torch import Tensor


class WriteOp(NamedTuple):
    """One contiguous copy from a local registered region into a peer's region (offsets in bytes)."""

    local_region: int
    local_offset: int
    remote_region: int
    remote_offset: int
    nbytes: int


class TransferError(RuntimeError):
    """A write could not be posted or failed; the request it belongs to must fail."""


class Backend(ABC):
    """One agent per worker. Regions are registered once (every TP rank's KV cache, then any buffers);
    a peer learns them from `metadata()`. Writes are one-sided: the initiator posts and polls them, and
    the target learns of each finished post from a notification carrying the initiator's message."""

    name: str

    @abstractmethod
    def register(self, regions: list[Tensor]) -> None: ...

    @abstractmethod
    def metadata(self) -> bytes: ...

    @abstractmethod
    def connect(self, peer_metadata: bytes) -> str:
        """Make a peer reachable; returns its name (what `post` takes)."""

    @abstractmethod
    def post(self, peer: str, ops: list[WriteOp], notif: bytes) -> object:
        """Start writing ops to peer; the peer gets `notif` once all of them have landed. Returns a handle."""

    @abstractmethod
    def state(self, handle: object) -> str:
        """'DONE', 'PROC' or 'ERR'. Polling also drives progress (and the target's notification)."""

    @abstractmethod
    def release(self, handle: object) -> None: ...

    @abstractmethod
    def notifications(self) -> list[tuple[str, bytes]]:
        """(peer, message) for every post that has landed here since the last call."""

    @abstractmethod
    def disconnect(self, peer: str) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def check_ops(self, ops: list[WriteOp], local_sizes: list[int], remote_sizes: list[int]) -> None:
        """Refuse a write outside a registered region (a remote one would corrupt another request)."""
        for op in ops:
            if not (0 <= op.local_region < len(local_sizes) and 0 <= op.remote_region < len(remote_sizes)):
                raise TransferError(f"write {op} names a region that is not registered")
            if (
                op.nbytes <= 0
                or op.local_offset < 0
                or op.remote_offset < 0
                or op.local_offset + op.nbytes > local_sizes[op.local_region]
                or op.remote_offset + op.nbytes > remote_sizes[op.remote_region]
            ):
                raise TransferError(f"write {op} falls outside its registered regions")
