"""The transfer layer's settings: which engine, how long each stage of a request may take, what failing does.

Every wait in the messenger is bounded by one of these. The hydra config (`conf/transfer/`) maps onto
this dataclass one to one; a wrong value fails here, naming the field and what it allows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

BACKENDS = ("nixl", "local")
NIXL_ENGINES = ("UCX", "LIBFABRIC")
FAILURE_POLICIES = ("fail", "recompute")
CONTROL_TRANSPORTS = ("ipc", "tcp")
SEND_MODES = ("layer", "chunk", "request")


@dataclass(frozen=True)
class TransferConfig:
    backend: str = "nixl"  # nixl (real transfers, across processes) | local (in-process copies, tests)
    nixl_engine: str = "UCX"  # UCX: loopback, ConnectX, InfiniBand | LIBFABRIC: EFA
    nixl_devices: str = "lo"  # network devices UCX may use (UCX_NET_DEVICES, e.g. mlx5_0:1,eth0) | all
    control_transport: str = "ipc"  # ipc: sockets in the run's private directory (one host) | tcp
    control_host: str = "127.0.0.1"  # the interface tcp control sockets bind to
    handshake_timeout_s: float = 10.0  # PrefillRequest sent -> the prefill worker accepted it
    first_layer_timeout_s: float = 60.0  # accepted -> the first write landed (queueing there counts)
    completion_timeout_s: float = 300.0  # PrefillRequest sent -> every write landed
    layer_timeout_s: float = 60.0  # prefill side: a forward pass's layer must be done within this
    peer_timeout_s: float = 10.0  # silent (no heartbeat) this long: lost. Heartbeats go out between forward
    # passes, so this must outlast the longest pass of either worker
    # a rail (one of a rank's NICs, where it has several) whose posts have finished nothing for this long,
    # past what its measured rate needs for the bytes in flight, is taken down: its posts go again over
    # the rank's other rails, and it is tried again after a back-off (this, doubling up to 30 s). A post
    # carries at most 1 MiB: this must outlast 1 MiB on one rail (0.8 s at 10 Mbit/s)
    rail_timeout_s: float = 2.0
    # when the prefill side posts a request's KV: layer (each layer's pages as soon as the forward pass has
    # stored them, while it computes the next: the design) | chunk (a pass's pages, every layer, once the
    # pass ends) | request (all of its pages once its last chunk is computed: no overlap with compute)
    send_mode: str = "layer"
    on_transfer_failure: str = "fail"  # fail: end the request with the error | recompute: prefill it locally
    context_slots: int = 64  # requests in flight per decode worker (rows of its context buffer)
    # a worker has NIXL agents per rank: DP group g's TP rank t on entry g * tp + t (RDMA device names,
    # e.g. mlx5_1:1, NIXL's UCX device_list, or network interfaces: each rank sends or receives on its own
    # NICs; several, comma-separated, make an agent on each, a rail its writes are striped over); empty:
    # every agent on nixl_devices
    nics_per_rank: tuple[str, ...] = ()

    def __post_init__(self):
        choices = {
            "backend": BACKENDS,
            "nixl_engine": NIXL_ENGINES,
            "on_transfer_failure": FAILURE_POLICIES,
            "control_transport": CONTROL_TRANSPORTS,
            "send_mode": SEND_MODES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"transfer.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s") and not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"transfer.{f.name} must be a number of seconds > 0, got {value!r}")
        for name in ("nixl_devices", "control_host"):
            if not (isinstance(getattr(self, name), str) and getattr(self, name)):
                raise ValueError(f"transfer.{name} must be a non-empty string, got {getattr(self, name)!r}")
        if not (isinstance(self.context_slots, int) and self.context_slots > 0):
            raise ValueError(f"transfer.context_slots must be an integer > 0, got {self.context_slots!r}")
        nics = self.nics_per_rank
        if isinstance(nics, str) or not all(isinstance(n, str) and n for n in nics):
            raise ValueError(
                f"transfer.nics_per_rank must be a list of device names (one per rank), got {nics!r}"
            )
        object.__setattr__(self, "nics_per_rank", tuple(nics))
