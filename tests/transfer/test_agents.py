"""transfer/agents.py: a side's agents (one per TP rank, or one) and each agent pair's writes."""

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.transfer.test_plan import cases
from transfer.agents import RankAgents, route
from transfer.backends import make_backend
from transfer.plan import plan_array
from transfer.protocol import Hello, decode_codec
from transfer.wire import WireError


def _rails(kind: str, tp: int) -> list[tuple[int, str]]:
    """A side's agents: one for all, one per rank, two NICs a rank, or rank r on NIC r only."""
    return {
        "one": [(-1, "")],
        "rank": [(r, "") for r in range(tp)],
        "two-nics": [(r, nic) for r in range(tp) for nic in ("eth0", "eth1")],
        "nic-per-rank": [(r, f"eth{r % 2}") for r in range(tp)],
    }[kind]


RAILS = ("one", "rank", "two-nics", "nic-per-rank")


@settings(max_examples=200, deadline=None)
@given(case=cases(), src_kind=st.sampled_from(RAILS), dst_kind=st.sampled_from(RAILS), rate=st.floats(0, 1e9))
def test_routed_writes_are_the_plan_split_by_agent_pair(case, src_kind, dst_kind, rate):
    """Every plan row is in exactly one pair's writes, from an agent of its source rank to an agent of its
    destination rank on the same NIC (an agent on none pairs with any), with that rank's region (its own
    agent's only region, or its rank among one agent's), whatever the agents' measured rates."""
    src, dst, src_pages, dst_pages, seed = case
    rows = plan_array(src, dst, src_pages, dst_pages, seed=seed)
    ours, theirs = _rails(src_kind, src.tp), _rails(dst_kind, dst.tp)
    routed = route(rows, ours, theirs, {0: rate, len(ours) - 1: 1e6})
    assert sum(len(ops) for *_, ops in routed) == len(rows)
    assert len({(s, d) for s, d, _ in routed}) == len(routed)  # one post per pair
    got = []
    for s, d, ops in routed:
        (s_rank, s_nic), (d_rank, d_nic) = ours[s], theirs[d]
        for region, offset, far_region, far_offset, nbytes in ops.tolist():
            assert (s_rank < 0 or region == 0) and (d_rank < 0 or far_region == 0)
            src_rank, dst_rank = (s_rank if s_rank >= 0 else region), (d_rank if d_rank >= 0 else far_region)
            if s_nic and d_nic and any(n == s_nic for r, n in theirs if r in (dst_rank, -1)):
                assert s_nic == d_nic  # a rail that exists is the one taken
            got.append((src_rank, offset, dst_rank, far_offset, nbytes))
    assert sorted(got) == sorted(map(tuple, rows[:, 1:].tolist()))


@pytest.mark.parametrize("rates, share", [(None, 0.5), ({0: 1e6, 1: 3e6}, 0.25), ({1: 2e6}, 0.5)])
def test_a_rank_pair_s_writes_are_striped_over_its_rails_by_rate(rates, share):
    """Two NICs a side: a rank pair's bytes go over both rails, in contiguous runs, rail 0's share its
    rate's (within one write); an agent not yet measured weighs as the mean of those that are."""
    rows = np.array([[0, 0, i * 100, 0, i * 100, 100] for i in range(400)], dtype=np.int64)
    rails = [(0, "eth0"), (0, "eth1")]
    routed = {(s, d): ops for s, d, ops in route(rows, rails, rails, rates)}
    assert set(routed) == {(0, 0), (1, 1)}  # each on its own rail, never across
    first = routed[0, 0][:, 4].sum()
    assert abs(first - share * 40_000) <= 100
    assert (np.diff(routed[0, 0][:, 1]) == 100).all() and (np.diff(routed[1, 1][:, 1]) == 100).all()
    assert routed[0, 0][-1, 1] < routed[1, 1][0, 1]


def test_two_agents_a_rank_each_register_the_rank_s_region():
    regions = [torch.zeros(64, dtype=torch.uint8) + r for r in range(2)]
    context = torch.zeros(2, 4)
    backends = [make_backend("local", f"rails-{r}-{k}") for r in range(2) for k in range(2)]
    for i, b in enumerate(backends):
        b.rank, b.nic = i // 2, f"eth{i % 2}"
    agents = RankAgents(backends, regions, context)
    try:
        assert agents.rails == [(0, "eth0"), (0, "eth1"), (1, "eth0"), (1, "eth1")]
        assert [len(b.regions) for b in agents.backends] == [2, 2, 1, 1] and agents.context_region == 1
        assert [int(b.regions[0][0]) for b in agents.backends] == [0, 0, 1, 1]
    finally:
        for b in backends:
            b.close()
    backends = [make_backend("local", f"rails-bad-{k}") for k in range(2)]
    for b in backends:
        b.rank, b.nic = 0, "eth0"  # two agents of rank 0 on one NIC, and none of rank 1
    with pytest.raises(ValueError, match="describes 2 agents"):
        RankAgents(backends, regions, context)


def test_an_agent_per_rank_registers_its_rank_alone_and_rank_0_the_context():
    regions = [torch.zeros(64, dtype=torch.uint8) + r for r in range(3)]
    context = torch.zeros(2, 4)
    agents = RankAgents([make_backend("local", f"rank-agents-{r}") for r in range(3)], regions, context)
    try:
        assert [len(b.regions) for b in agents.backends] == [2, 1, 1] and agents.context_region == 1
        assert [int(b.regions[0][0]) for b in agents.backends] == [0, 1, 2]
        assert agents.names == ["rank-agents-0", "rank-agents-1", "rank-agents-2"]
    finally:
        for b in agents.backends:
            b.close()
    one = RankAgents(make_backend("local", "rank-agents-one"), regions, context)
    assert len(one.backends[0].regions) == 4 and one.context_region == 3
    one.backends[0].close()
    with pytest.raises(ValueError, match="2 transfer agents for 3 TP ranks: one per rank, or one"):
        RankAgents([make_backend("local", f"rank-agents-bad{r}") for r in range(2)], regions, context)


def test_a_hello_naming_agents_that_do_not_match_its_ranks_is_refused():
    """A peer names one agent per TP rank or one: anything else (none, too many, an empty name) does not
    decode, so no notification from an agent it invented can ever count."""
    from transfer.plan import ShardSpec

    spec = ShardSpec(tp=2, num_kv_heads=2, num_layers=1, num_pages=4, page_size=4, head_dim=8, itemsize=2)
    codec = decode_codec()
    for agents in (["a", "b"], ["a"]):
        assert codec.decode(codec.encode(Hello.of(spec, agents))).agents == agents
        forged = msgspec.msgpack.encode({"type": "Hello", "spec": spec, "agents": agents})
        assert codec.decode(forged).agents == agents  # so what fails below fails on its agents
    for agents in ([], ["a", "b", "c"], ["a", ""]):
        with pytest.raises(ValueError):
            Hello.of(spec, agents)
        raw = msgspec.msgpack.encode({"type": "Hello", "spec": spec, "agents": agents})  # a forged one
        with pytest.raises(WireError):
            codec.decode(raw)
    assert codec.dropped == 3
    rails = [(0, "eth0"), (0, "eth1"), (1, "eth0")]
    assert codec.decode(codec.encode(Hello.of(spec, ["a", "b", "c"], rails))).rails == rails
    bad = [
        (["a", "b"], [(0, "eth0"), (0, "eth1")]),  # every agent of rank 0, none of rank 1
        (["a", "b"], [(1, ""), (0, "")]),  # not in rank order
        (["a", "a"], [(0, ""), (1, "")]),  # one name twice
        (["a", "b"], [(0, "x" * 65), (1, "")]),  # a NIC name past 64 characters
        ([f"a{k}" for k in range(18)], [(0, f"eth{k}") for k in range(17)] + [(1, "")]),  # 17 NICs a rank
    ]
    for agents, rails in bad:
        raw = msgspec.msgpack.encode({"type": "Hello", "spec": spec, "agents": agents, "rails": rails})
        with pytest.raises(WireError):
            codec.decode(raw)
