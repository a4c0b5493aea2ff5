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


def agent_for(config, name: str, rank: int = 0) -> Backend:
    """config.backend's agent (a transfer.config.TransferConfig) for a worker's rank (DP group g's TP rank t
    is rank g * tp + t): with nixl, on the process's nixl_devices and the rank's own NIC (nics_per_rank's
    entry, where given)."""
    if config.backend != "nixl":
        return make_backend(config.backend, name)
    nic = config.nics_per_rank[rank] if config.nics_per_rank else None
    return make_backend("nixl", name, engine=config.nixl_engine, devices=config.nixl_devices, nic=nic)


def rank_agents(config, name: str, tp: int, dp_rank: int = 0) -> list[Backend]:
    """One agent per TP rank of DP group dp_rank (transfer.agents): rank 0's named name, rank t's
    name-tp<t>, each on its rank's NIC."""
    return [agent_for(config, name if t == 0 else f"{name}-tp{t}", dp_rank * tp + t) for t in range(tp)]


__all__ = ["BACKENDS", "Backend", "TransferError", "WriteOp", "agent_for", "make_backend", "rank_agents"]
