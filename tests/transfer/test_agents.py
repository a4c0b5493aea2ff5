"""transfer/agents.py: a side's agents (one per TP rank, or one) and each agent pair's writes."""

import msgspec
import pytest
import torch
from hypothesis import given, settings

from tests.transfer.test_plan import cases
from transfer.agents import RankAgents, route
from transfer.backends import make_backend
from transfer.plan import plan_array
from transfer.protocol import Hello, decode_codec
from transfer.wire import WireError


@settings(max_examples=200, deadline=None)
@given(case=cases())
def test_routed_writes_are_the_plan_split_by_agent_pair(case):
    """Every plan row is in exactly one pair's writes, from its source rank's agent to its destination
    rank's, with that rank's region (its own agent's only region, or its rank among one agent's)."""
    src, dst, src_pages, dst_pages, seed = case
    rows = plan_array(src, dst, src_pages, dst_pages, seed=seed)
    for src_agents in {1, src.tp}:
        for dst_agents in {1, dst.tp}:
            routed = route(rows, src_agents, dst_agents)
            assert sum(len(ops) for *_, ops in routed) == len(rows)
            assert len({(s, d) for s, d, _ in routed}) == len(routed)  # one post per pair
            got = []
            for s, d, ops in routed:
                for region, offset, far_region, far_offset, nbytes in ops.tolist():
                    src_rank = s if src_agents > 1 else region
                    dst_rank = d if dst_agents > 1 else far_region
                    assert (region == 0 or src_agents == 1) and (far_region == 0 or dst_agents == 1)
                    got.append((src_rank, offset, dst_rank, far_offset, nbytes))
            assert sorted(got) == sorted(map(tuple, rows[:, 1:].tolist()))


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
