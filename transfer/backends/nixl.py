"""NIXL (https://github.com/ai-dynamo/nixl) behind the Backend interface; the only module that imports it.

UCX covers loopback, ConnectX and InfiniBand; LIBFABRIC covers EFA. Progress is driven by polling
(`enable_prog_thread=False`): on few cores UCX's progress thread spins on the core the model needs.
"""

from __future__ import annotations

import gc
import logging
import os
import socket

import numpy as np
from torch import Tensor

from transfer.backends.base import Backend, TransferError, as_ops
from transfer.wire import Codec, Message

ENGINES = ("UCX", "LIBFABRIC")
log = logging.getLogger(__name__)
MEM_TYPES = ("DRAM", "VRAM")


class NixlMetadata(Message):
    """What a peer needs to write into this agent: NIXL's own agent blob and the registered regions."""

    agent: bytes  # nixl_agent.get_agent_metadata(), handed to the peer's NIXL as is
    regions: list[tuple[int, int, int]]  # (address, bytes, device id) of each registered region
    mem_type: str

    def __post_init__(self):
        if self.mem_type not in MEM_TYPES:
            raise ValueError(f"mem_type must be one of {MEM_TYPES}, got {self.mem_type!r}")
        if not self.agent or any(n <= 0 or a < 0 or d < 0 for a, n, d in self.regions):
            raise ValueError("agent metadata is empty or a region has a negative address or no bytes")


_CODEC = Codec(NixlMetadata)


NIXL_PACKAGES = ("nixl_cu12", "nixl_cu13")  # NIXL's builds for CUDA 12 and 13 (same API)


def ucx_environment(devices: str) -> dict[str, str]:
    """The UCX variables an agent on these devices sets (where the user has not set them): the devices
    ('lo': loopback only, 'all': UCX chooses); and for loopback alone, no InfiniBand module, without
    which a process that created a UCX backend crashed at exit on VMs with an IB stack and no IB port.
    On real devices (nixl_devices=mlx5_0:1) InfiniBand must stay: UCX_MODULES is left alone."""
    env = {} if devices == "all" else {"UCX_NET_DEVICES": devices}
    if devices == "lo":
        env["UCX_MODULES"] = "^ib"
    return env


def _nixl():
    import importlib

    for package in NIXL_PACKAGES:
        try:
            return importlib.import_module(f"{package}._api")
        except ImportError:
            continue
    raise ImportError("the 'nixl' transfer backend needs nixl-cu12 or nixl-cu13: pip install '.[nixl]'")


def _interface(name: str) -> bool:
    """Whether name is a network interface of this process's network namespace (/sys may show another's)."""
    try:
        socket.if_nametoindex(name)
    except OSError:
        return False
    return True


class NixlBackend(Backend):
    def __init__(self, name: str, engine: str = "UCX", devices: str = "lo", nic: str | None = None):
        """devices: the network devices UCX may use (UCX_NET_DEVICES: 'lo' keeps it on loopback, 'all'
        lets it choose), read once per process, when its first agent starts UCX. nic: this agent's own
        RDMA device(s) (a DP rank's NIC: transfer.nics_per_rank, e.g. 'mlx5_1:1'), given to NIXL's UCX
        plugin as its device_list, which takes bare HCA names and adds the port itself: so agents in one
        process can each use their own NIC."""
        if engine not in ENGINES:
            raise ValueError(f"NIXL engine must be one of {ENGINES}, got {engine!r}")
        for key, value in ucx_environment(devices).items():  # read once, when UCX loads: set first
            os.environ.setdefault(key, value)
        api = _nixl()
        self.name, self.engine = name, engine
        self._args = (engine, devices, nic)
        self.agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
        params, env = {}, {}
        if nic is not None and engine == "UCX":
            names = [d.split(":")[0].strip() for d in nic.split(",")]
            if all(_interface(n) for n in names):
                # network interfaces (TCP: a netns host's eth0, eth1): the plugin's device_list would add
                # an HCA port to them, so this agent's UCX context reads them from the environment, which
                # UCX reads again for each context it creates
                env["UCX_NET_DEVICES"] = ",".join(names)
            else:
                params["device_list"] = ",".join(names)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            self.agent.create_backend(engine, params)
        except Exception as e:  # nixl raises its own error types
            where = f"NIC {nic!r} (transfer.nics_per_rank)" if nic else f"devices {devices!r} (nixl_devices)"
            raise TransferError(f"NIXL could not start its {engine} backend on {where}: {e}") from e
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self.regions: list[tuple[int, int, int]] = []  # (address, bytes, device id)
        self.mem_type = "DRAM"
        self._tensors: list[Tensor] = []
        self._registered: list = []  # NIXL's descriptor lists of what was registered
        self._peers: dict[str, list[tuple[int, int, int]]] = {}

    def register(self, regions: list[Tensor]) -> None:
        mem_types = {"VRAM" if r.is_cuda else "DRAM" for r in regions}
        if len(mem_types) != 1:
            raise ValueError("register host or device memory, not both, in one call")
        self.mem_type = mem_types.pop()
        self._registered.append(self.agent.register_memory(regions))
        self._tensors += regions  # registered memory must outlive the agent's use of it
        self.regions += [(r.data_ptr(), r.numel() * r.element_size(), r.device.index or 0) for r in regions]
        nbytes = sum(r.numel() * r.element_size() for r in regions)
        log.info(
            "%s: registered %d regions, %d bytes of %s with NIXL",
            self.name,
            len(regions),
            nbytes,
            self.mem_type,
        )

    def metadata(self) -> bytes:
        return _CODEC.encode(NixlMetadata(self.agent.get_agent_metadata(), self.regions, self.mem_type))

    def connect(self, peer_metadata: bytes) -> str:
        try:
            md = _CODEC.decode(peer_metadata)
            peer = self.agent.add_remote_agent(md.agent)
        except Exception as e:  # a malformed blob (WireError) or NIXL refusing the agent in it
            raise TransferError(f"peer metadata refused: {e}") from e
        peer = peer.decode() if isinstance(peer, bytes) else peer
        self._peers[peer] = md.regions
        return peer

    def _descs(self, regions: list[tuple[int, int, int]], region, offset, nbytes):
        """NIXL descriptors (address, bytes, device) for byte ranges of the given regions (arrays)."""
        table = np.asarray(regions, dtype=np.int64).reshape(-1, 3)[region]
        rows = np.stack([table[:, 0] + offset, nbytes, table[:, 2]], axis=1).astype(np.uint64)
        return self.agent.get_xfer_descs(rows, self.mem_type)

    def region_sizes(self, peer: str) -> tuple[list[int], list[int]]:
        remote = self._peers.get(peer)
        if remote is None:
            raise TransferError(f"peer {peer!r} is not connected")
        return [r[1] for r in self.regions], [r[1] for r in remote]

    def post(self, peer: str, ops, notif: bytes) -> object:
        ops = as_ops(ops)
        self.check(peer, ops)
        remote = self._peers[peer]
        local = self._descs(self.regions, ops[:, 0], ops[:, 1], ops[:, 4])
        far = self._descs(remote, ops[:, 2], ops[:, 3], ops[:, 4])
        try:
            handle = self.agent.initialize_xfer("WRITE", local, far, peer, notif)
            state = self.agent.transfer(handle)
        except Exception as e:  # nixl's own errors become this request's transfer error
            raise TransferError(f"NIXL refused a write of {len(ops)} ops to {peer!r}: {e}") from e
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            raise TransferError(f"NIXL refused a write of {len(ops)} ops to {peer!r}")
        return handle

    def state(self, handle: object) -> str:
        try:
            return self.agent.check_xfer_state(handle)
        except Exception as e:
            raise TransferError(f"NIXL lost track of a write: {e}") from e

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

    def retire(self) -> None:
        if self.agent is None:
            return
        self.close()
        for descs in self._registered:
            self.agent.deregister_memory(descs)
        self._registered.clear()
        self.agent = None  # its UCX worker and connections closed: nothing more lands through them
        gc.collect()

    def renewed(self) -> NixlBackend:
        base, _, n = self.name.partition("~")
        engine, devices, nic = self._args
        new = NixlBackend(f"{base}~{int(n or 0) + 1}", engine, devices, nic)
        new.register(self._tensors)
        new.rank, new.nic = self.rank, self.nic
        return new
