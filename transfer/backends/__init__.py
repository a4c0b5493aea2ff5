"""Transfer engines behind one interface: `nixl` (UCX, LIBFABRIC) and `local` (in-process copies)."""

from transfer.backends.base import Backend, TransferError, WriteOp

BACKENDS = ("nixl", "local")


def make_backend(kind: str, name: str, **kwargs) -> Backend:
    """A backend by config name: 'nixl' (kwargs: engine='UCX' | 'LIBFABRIC') or 'local'."""
    if kind == "nixl":
        from transfer.backends.nixl import NixlBackend

        return NixlBackend(name, **kwargs)
    if kind == "local":
        from transfer.backends.local import LocalBackend

        return LocalBackend(name)
    raise ValueError(f"transfer backend must be one of {BACKENDS}, got {kind!r}")


def agent_for(config, name: str, dp_rank: int = 0) -> Backend:
    """config.backend's agent (a transfer.config.TransferConfig) for a worker's DP group dp_rank: with
    nixl, on the process's nixl_devices and the group's own NIC (nics_per_rank's entry, where given)."""
    if config.backend != "nixl":
        return make_backend(config.backend, name)
    nic = config.nics_per_rank[dp_rank] if config.nics_per_rank else None
    return make_backend("nixl", name, engine=config.nixl_engine, devices=config.nixl_devices, nic=nic)


__all__ = ["BACKENDS", "Backend", "TransferError", "WriteOp", "agent_for", "make_backend"]
