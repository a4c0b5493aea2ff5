"""A worker side's transfer agents: one per TP rank and NIC, one per TP rank, or one for every rank.

A TP worker's ranks each have NIXL agents of their own (in the lead's process, which maps every rank's
KV): an agent registers only its rank's KV region, and rank 0's agents also the context buffer, so rank
r's bytes go out (or come in) on rank r's NICs. A rank with several NICs (`transfer.nics_per_rank`'s
entry naming several: `eth0,eth1`) has an agent on each, a *rail*: the rank's writes are striped over
the rails both sides share (`route`), each rail's share following its measured rate. One agent for every
rank (the local backend's in-process tests, or a worker of one rank) registers all regions, rank r's as
region r. A side is described to its peer by its rails: (rank, NIC) of each agent, rank -1 for an agent
of every rank, NIC "" for an agent on no named NIC (it pairs with any).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the protocol reads rails, and the server's front imports no torch
    from torch import Tensor

    from transfer.backends import Backend

Rails = list[tuple[int, str]]  # (TP rank, or -1: every rank; NIC name, or "") of each agent, in order
MAX_RAILS = 16  # agents (NICs) a rank may have: a peer's description naming more is refused


def default_rails(agents: int, tp: int) -> Rails:
    """A side that names no NICs: one agent per rank, or one for all."""
    return [(-1, "")] if agents == 1 else [(r, "") for r in range(tp)]


def check_rails(rails: Rails, agents: int, tp: int, what: str) -> None:
    """ValueError unless rails describe `agents` agents over tp ranks: one for all, or each rank's agents
    (one or more, each on another NIC) in rank order."""
    ranks = [r for r, _ in rails]
    ok = len(rails) == agents and all(len(nic) <= 64 for _, nic in rails)
    if ok and ranks != [-1]:
        ok = sorted(ranks) == ranks and set(ranks) == set(range(tp))
        ok = ok and len(set(rails)) == len(rails) and max(ranks.count(r) for r in set(ranks)) <= MAX_RAILS
    if not ok:
        raise ValueError(
            f"{what} describes {len(rails)} agents as {rails[:8]} for {agents} agents over {tp} TP ranks: "
            f"one for every rank, or each rank's (one per NIC, at most {MAX_RAILS}) in rank order"
        )


class RankAgents:
    """The agents of one side: one for every rank, or each rank's (one per NIC: each backend's `rank`
    and `nic`, as transfer.backends.rank_agents sets them; a list without ranks is one agent per rank)."""

    def __init__(self, backends: Backend | list[Backend], kv_regions: list[Tensor], context: Tensor):
        self.backends = list(backends) if isinstance(backends, list | tuple) else [backends]
        tp = len(kv_regions)
        if len(self.backends) == 1:
            self.rails: Rails = [(-1, self.backends[0].nic)]
        elif any(b.rank is None for b in self.backends):
            if len(self.backends) != tp:
                raise ValueError(
                    f"{len(self.backends)} transfer agents for {tp} TP ranks: one per rank, or one"
                )
            self.rails = [(r, b.nic) for r, b in enumerate(self.backends)]
        else:
            self.rails = [(b.rank, b.nic) for b in self.backends]
        check_rails(self.rails, len(self.backends), tp, "the transfer agents")
        if self.rails == [(-1, self.rails[0][1])]:
            self.backends[0].register(list(kv_regions) + [context])
        else:
            for backend, (rank, _) in zip(self.backends, self.rails, strict=True):
                backend.register([kv_regions[rank]] + ([context] if rank == 0 else []))
        self.context_region = context_region(self.rails, tp)

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.backends]

    @property
    def striped(self) -> bool:
        """Whether a rank has several agents (rails) its writes are striped over."""
        return len({rank for rank, _ in self.rails}) < len(self.rails)

    def metadata(self) -> list[bytes]:
        return [b.metadata() for b in self.backends]


def context_region(rails: Rails, tp: int) -> int:
    """A rank-0 agent's region index of the context buffer (registered after the KV regions it holds)."""
    return tp if rails[0][0] == -1 else 1


def agents_of(rails: Rails, rank: int) -> list[int]:
    """The agents that hold rank's KV region."""
    return [i for i, (r, _) in enumerate(rails) if r in (rank, -1)]


def pairs(src: Rails, dst: Rails, src_rank: int, dst_rank: int) -> list[tuple[int, int]]:
    """The (source agent, destination agent) pairs that may carry writes from src_rank to dst_rank: those
    on the same NIC name (a rail: a NIC of one host reaches the other's NIC of that name), an agent on no
    named NIC pairing with any; where none match, the two ranks' first agents (the transfer engine picks
    the devices)."""
    a, b = agents_of(src, src_rank), agents_of(dst, dst_rank)
    out = [(i, j) for i in a for j in b if src[i][1] == dst[j][1] or not src[i][1] or not dst[j][1]]
    return out or [(a[0], b[0])]


def route(
    rows: np.ndarray,
    src: Rails,
    dst: Rails,
    rates: dict[int, float] | None = None,
    usable: Callable[[int, int], bool] | None = None,
) -> list[tuple[int, int, np.ndarray]]:
    """Plan rows [n, 6] (layer, src_rank, src_offset, dst_rank, dst_offset, nbytes) as the writes of each
    (source agent, destination agent) pair: [(source agent, destination agent, WriteOps [m, 5])], each in
    the rows' order. A rank pair's writes are striped over its agent pairs (`pairs`) in contiguous runs,
    each pair's bytes in proportion to rates[source agent] (bytes/s as measured; unmeasured agents weigh
    as the mean of the measured ones, all alike before any is), over those `usable` allows (a rail taken
    down is not) while any is. An agent of one rank has region 0; an agent of every rank has the rank's."""
    src_rank, dst_rank = rows[:, 1], rows[:, 3]
    src_region = src_rank if src[0][0] == -1 else np.zeros_like(src_rank)
    dst_region = dst_rank if dst[0][0] == -1 else np.zeros_like(dst_rank)
    ops = np.stack([src_region, rows[:, 2], dst_region, rows[:, 4], rows[:, 5]], axis=1)
    ranks = int(max(src_rank.max(initial=0), dst_rank.max(initial=0))) + 1
    key = src_rank * ranks + dst_rank
    known = [v for v in (rates or {}).values() if v > 0]
    mean = float(np.mean(known)) if known else 1.0
    out: dict[tuple[int, int], list[np.ndarray]] = {}
    for k in np.unique(key).tolist():
        sel = ops[key == k]
        ways = pairs(src, dst, k // ranks, k % ranks)
        if usable is not None:
            ways = [w for w in ways if usable(*w)] or ways
        if len(ways) == 1:
            out.setdefault(ways[0], []).append(sel)
            continue
        weight = np.array([(rates or {}).get(i, 0.0) or mean for i, _ in ways], dtype=np.float64)
        bounds = np.cumsum(weight) / weight.sum() * sel[:, 4].sum()
        middle = np.cumsum(sel[:, 4]) - sel[:, 4] / 2  # each write goes where its middle byte falls
        which = np.minimum(np.searchsorted(bounds, middle), len(ways) - 1)
        for w, way in enumerate(ways):
            part = sel[which == w]
            if len(part):
                out.setdefault(way, []).append(part)
    return [(i, j, np.concatenate(parts)) for (i, j), parts in sorted(out.items())]
