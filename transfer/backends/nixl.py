"""NIXL (https://github.com/ai-dynamo/nixl) behind the Backend interface; the only module that imports it.

UCX covers loopback, ConnectX and InfiniBand; LIBFABRIC covers EFA. Progress is driven by polling
(`enable_prog_thread=False`): on few cores UCX's progress thread spins on the core the model needs.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
from torch import Tensor

from transfer.backends.base import Backend, TransferError, as_ops

# Set before UCX loads: without it, a process that created a UCX backend crashes at exit here.
os.environ.setdefault("UCX_MODULES", "^ib")
ENGINES = ("UCX", "LIBFABRIC")


def _nixl():
    try:
        from nixl_cu12 import _api
    except ImportError as e:
        raise ImportError("the 'nixl' transfer backend needs nixl-cu12: pip install '.[nixl]'") from e
    return _api


class NixlBackend(Backend):
    def __init__(self, name: str, engine: str = "UCX"):
        if engine not in ENGINES:
            raise ValueError(f"NIXL engine must be one of {ENGINES}, got {engine!r}")
        api = _nixl()
        self.name, self.engine = name, engine
        self.agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[engine]))
        if engine not in self.agent.backends:
            raise TransferError(f"NIXL could not start its {engine} backend on this machine")
        self.regions: list[tuple[int, int, int]] = []  # (address, bytes, device id)
        self.mem_type = "DRAM"
        self._tensors: list[Tensor] = []
        self._peers: dict[str, list[tuple[int, int, int]]] = {}

    def register(self, regions: list[Tensor]) -> None:
        mem_types = {"VRAM" if r.is_cuda else "DRAM" for r in regions}
        if len(mem_types) != 1:
            raise ValueError("register host or device memory, not both, in one call")
        self.mem_type = mem_types.pop()
        self.agent.register_memory(regions)
        self._tensors += regions  # registered memory must outlive the agent's use of it
        self.regions += [(r.data_ptr(), r.numel() * r.element_size(), r.device.index or 0) for r in regions]

    def metadata(self) -> bytes:
        return pickle.dumps(
            {"agent": self.agent.get_agent_metadata(), "regions": self.regions, "mem_type": self.mem_type}
        )

    def connect(self, peer_metadata: bytes) -> str:
        md = pickle.loads(peer_metadata)
        peer = self.agent.add_remote_agent(md["agent"])
        peer = peer.decode() if isinstance(peer, bytes) else peer
        self._peers[peer] = md["regions"]
        return peer

    def _descs(self, regions: list[tuple[int, int, int]], region, offset, nbytes):
        """NIXL descriptors (address, bytes, device) for byte ranges of the given regions (arrays)."""
        table = np.asarray(regions, dtype=np.int64).reshape(-1, 3)[region]
        rows = np.stack([table[:, 0] + offset, nbytes, table[:, 2]], axis=1).astype(np.uint64)
        return self.agent.get_xfer_descs(rows, self.mem_type)

    def post(self, peer: str, ops, notif: bytes) -> object:
        remote = self._peers.get(peer)
        if remote is None:
            raise TransferError(f"peer {peer!r} is not connected")
        ops = as_ops(ops)
        self.check_ops(ops, [r[1] for r in self.regions], [r[1] for r in remote])
        local = self._descs(self.regions, ops[:, 0], ops[:, 1], ops[:, 4])
        far = self._descs(remote, ops[:, 2], ops[:, 3], ops[:, 4])
        handle = self.agent.initialize_xfer("WRITE", local, far, peer, notif)
        if self.agent.transfer(handle) == "ERR":
            self.agent.release_xfer_handle(handle)
            raise TransferError(f"NIXL refused a write of {len(ops)} ops to {peer!r}")
        return handle

    def state(self, handle: object) -> str:
        return self.agent.check_xfer_state(handle)

    def release(self, handle: object) -> None:
        self.agent.release_xfer_handle(handle)

    def notifications(self) -> list[tuple[str, bytes]]:
        return [(peer, msg) for peer, msgs in self.agent.get_new_notifs().items() for msg in msgs]

    def disconnect(self, peer: str) -> None:
        if self._peers.pop(peer, None) is not None:
            self.agent.remove_remote_agent(peer)

    def close(self) -> None:
        for peer in list(self._peers):
            self.disconnect(peer)
