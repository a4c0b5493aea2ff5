"""A worker side's transfer agents: one per TP rank, or one for every rank.

A TP worker's ranks each have a NIXL agent of their own (in the lead's process, which maps every rank's
KV): agent r registers only rank r's KV region, and agent 0 also the context buffer, so rank r's bytes
go out (or come in) on rank r's NIC (`transfer.nics_per_rank`), as each DP group's agent does. One agent
for every rank (the local backend's in-process tests, or a worker of one rank) registers all regions,
rank r's as region r. A peer learns which from how many agents' metadata it is handed, and `route` turns
plan rows into each (source agent, destination agent) pair's writes.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from transfer.backends import Backend


class RankAgents:
    """The agents of one side: backends[r] for rank r's KV region, or backends[0] for all of them."""

    def __init__(self, backends: Backend | list[Backend], kv_regions: list[Tensor], context: Tensor):
        self.backends = list(backends) if isinstance(backends, list | tuple) else [backends]
        if len(self.backends) not in (1, len(kv_regions)):
            raise ValueError(
                f"{len(self.backends)} transfer agents for {len(kv_regions)} TP ranks: one per rank, or one"
            )
        if len(self.backends) == 1:
            self.backends[0].register(list(kv_regions) + [context])
        else:
            for rank, (backend, region) in enumerate(zip(self.backends, kv_regions, strict=True)):
                backend.register([region] + ([context] if rank == 0 else []))
        self.context_region = context_region(len(self.backends), len(kv_regions))

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.backends]

    def metadata(self) -> list[bytes]:
        return [b.metadata() for b in self.backends]


def context_region(agents: int, tp: int) -> int:
    """Agent 0's region index of the context buffer (registered after the KV regions it holds)."""
    return tp if agents == 1 else 1


def route(rows: np.ndarray, src_agents: int, dst_agents: int) -> list[tuple[int, int, np.ndarray]]:
    """Plan rows [n, 6] (layer, src_rank, src_offset, dst_rank, dst_offset, nbytes) as the writes of each
    (source agent, destination agent) pair: [(source agent, destination agent, WriteOps [m, 5])], each in
    the rows' order. With one agent per side a rank's region is its rank; with one agent per rank, 0."""
    src, dst = rows[:, 1], rows[:, 3]
    src_agent, src_region = (src, np.zeros_like(src)) if src_agents > 1 else (np.zeros_like(src), src)
    dst_agent, dst_region = (dst, np.zeros_like(dst)) if dst_agents > 1 else (np.zeros_like(dst), dst)
    ops = np.stack([src_region, rows[:, 2], dst_region, rows[:, 4], rows[:, 5]], axis=1)
    pair = src_agent * dst_agents + dst_agent
    out = []
    for key in np.unique(pair).tolist():
        out.append((key // dst_agents, key % dst_agents, ops[pair == key]))
    return out
