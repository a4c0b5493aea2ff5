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


def agents_for(config, name: str, rank: int = 0) -> list[Backend]:
    """config.backend's agents (a transfer.config.TransferConfig) for a worker's rank (DP group g's TP rank
    t is rank g * tp + t): with nixl, one on each of the rank's NICs (nics_per_rank's entry, comma-separated:
    the rank's rails, named name-nic<k> where there are several), or one on the process's nixl_devices."""
    if config.backend != "nixl":
        return [make_backend(config.backend, name)]
    nics = [n.strip() for n in config.nics_per_rank[rank].split(",")] if config.nics_per_rank else [None]
    agents = []
    for k, nic in enumerate(nics):
        agent = make_backend(
            "nixl",
            name if len(nics) == 1 else f"{name}-nic{k}",
            engine=config.nixl_engine,
            devices=config.nixl_devices,
            nic=nic,
        )
        agent.nic = nic or ""
        agents.append(agent)
    return agents


def rank_agents(config, name: str, tp: int, dp_rank: int = 0) -> list[Backend]:
    """The agents of each TP rank of DP group dp_rank, in rank order (transfer.agents): rank 0's named
    name, rank t's name-tp<t>, each on its rank's NIC(s)."""
    out = []
    for t in range(tp):
        for agent in agents_for(config, name if t == 0 else f"{name}-tp{t}", dp_rank * tp + t):
            agent.rank = t
            out.append(agent)
    return out


__all__ = ["BACKENDS", "Backend", "TransferError", "WriteOp", "agents_for", "make_backend", "rank_agents"]
