"""The interface every transfer engine implements; the messenger never knows which one it has."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np
from torch import Tensor


class WriteOp(NamedTuple):
    """One contiguous copy from a local registered region into a peer's region (offsets in bytes)."""

    local_region: int
    local_offset: int
    remote_region: int
    remote_offset: int
    nbytes: int


def as_ops(ops) -> np.ndarray:
    """Writes as an int64 array [n, 5] in WriteOp's column order (a list of WriteOp, or such an array)."""
    arr = np.asarray(ops, dtype=np.int64)
    return arr.reshape(-1, 5)


class TransferError(RuntimeError):
    """A write could not be posted or failed; the request it belongs to must fail."""


class Backend(ABC):
    """One agent per TP rank, or per worker (transfer/agents.py). Regions are registered once (its rank's KV
    cache, or every rank's, then any buffers);
    a peer learns them from `metadata()`. Writes are one-sided: the initiator posts and polls them, and
    the target learns of each finished post from a notification carrying the initiator's message."""

    name: str
    rank: int | None = None  # the TP rank whose KV it moves (transfer.backends.rank_agents sets it)
    nic: str = ""  # the NIC it runs on ("": the process's devices): agents on one NIC name form a rail

    @abstractmethod
    def register(self, regions: list[Tensor]) -> None: ...

    @abstractmethod
    def metadata(self) -> bytes: ...

    @abstractmethod
    def connect(self, peer_metadata: bytes) -> str:
        """Make a peer reachable; returns its name (what `post` takes)."""

    @abstractmethod
    def post(self, peer: str, ops, notif: bytes) -> object:
        """Start writing ops (a list of WriteOp, or an int64 array [n, 5] of their fields) to peer; the peer
        gets `notif` once all of them have landed. Returns a handle."""

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

    @abstractmethod
    def retire(self) -> None:
        """Close this agent for good with everything in flight: a write it had not handed to the network
        never goes, and nothing more lands in its regions through it (its connections are closed). What
        a rail that stopped moving gets (transfer/prefill.py); `renewed` makes its successor."""

    @abstractmethod
    def renewed(self) -> Backend:
        """A new agent made as this one was (its regions registered again, its rank and NIC; its name this
        one's with a new `~n` suffix). TransferError where it cannot start (its NIC down)."""

    @abstractmethod
    def region_sizes(self, peer: str) -> tuple[list[int], list[int]]:
        """Bytes of each region registered here, and at peer (TransferError if peer is not connected)."""

    def check(self, peer: str, ops) -> None:
        """Refuse (TransferError) writes to peer that would fall outside a registered region."""
        self.check_ops(as_ops(ops), *self.region_sizes(peer))

    def check_ops(self, ops: np.ndarray, local_sizes: list[int], remote_sizes: list[int]) -> None:
        """Refuse a write outside a registered region (a remote one would corrupt another request)."""
        lr, lo, rr, ro, n = ops.T
        regions_ok = (lr >= 0) & (lr < len(local_sizes)) & (rr >= 0) & (rr < len(remote_sizes))
        if not regions_ok.all():
            bad = WriteOp(*ops[np.argmin(regions_ok)].tolist())
            raise TransferError(f"write {bad} names a region that is not registered")
        local_end = np.asarray(local_sizes, dtype=np.int64)[lr]
        remote_end = np.asarray(remote_sizes, dtype=np.int64)[rr]
        ok = (n > 0) & (lo >= 0) & (ro >= 0) & (lo + n <= local_end) & (ro + n <= remote_end)
        if not ok.all():
            bad = WriteOp(*ops[np.argmin(ok)].tolist())
            raise TransferError(f"write {bad} falls outside its registered regions")
