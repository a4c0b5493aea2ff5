"""The decode messenger with a worker of DP groups (engine/dp.py), in this process over the local backend:
each group a destination of its own (its agent, its KV, its context slots), requests given to a group
land there, a notification at another group's agent never counts, and a request that fails frees its
pages in its own group."""

import pytest

from engine import DPLLM, LLM
from tests.kept import finished
from tests.transfer.messengers import GREEDY, _close, _local_pair, _prompts, _run
from transfer.protocol import Notif

MODEL, PAGES = "tiny-random-deepseek", 64


@pytest.fixture(scope="module")
def pair():
    """A prefill engine (TP 1) and a decode engine of 2 DP groups, both messengers over local agents."""
    prefill = LLM(MODEL, role="prefill", page_size=4, num_pages=PAGES)
    decode = DPLLM(MODEL, role="decode", page_size=4, num_pages=PAGES, dp=2)
    pm, dm = _local_pair(prefill, decode, "dp")
    yield prefill, decode, pm, dm
    _close(pm, dm)
    decode.close()


def _all_back(decode, dm):
    decode.step()  # the other group reports its pages after a step
    return (
        decode.pages == (2 * PAGES, 2 * PAGES)
        and not dm.pending
        and all(len(g.free_slots) == dm.config.context_slots for g in dm.groups)
    )


def test_each_request_lands_in_its_group_and_decodes_as_one_engine(pair):
    prefill, decode, pm, dm = pair
    prompts = [p for p in _prompts(8, seed=3) if len(p) > 1]
    expected = [o.token_ids for o in LLM(MODEL, page_size=4, num_pages=PAGES).generate(prompts, GREEDY)]
    ids = [f"g{i}" for i in range(len(prompts))]
    for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
        assert dm.submit(rid, prompt, GREEDY, group=i % 2)
        assert dm.pending[rid].group == i % 2 and decode.front.dp_rank_of(rid) == i % 2
    _run(prefill, decode, pm, dm, ids)
    assert [decode.output(rid).token_ids for rid in ids] == expected
    assert all(dm.timings[rid].nbytes > 0 for rid in ids) and not dm.dropped
    assert _all_back(decode, dm)


def test_a_notification_at_another_groups_agent_never_counts(pair):
    """Group 1's request: its notification delivered to group 0's agent (a prefill side that wrote to the
    wrong agent, or a forged one) is dropped and counted; the request still completes from its own."""
    prefill, decode, pm, dm = pair
    dm.dropped.clear()
    assert dm.submit("wrong-agent", list(range(100, 121)), GREEDY, group=1)
    p = dm.pending["wrong-agent"]
    forged = Notif("kv", "wrong-agent", p.seq, 10**6, 1).encode()
    dm.groups[0].backend._inbox.append((p.peer.hello.agents[0], forged))
    dm.poll()
    assert dm.dropped == {"notification to another DP group's agent": 1} and p.received == 0
    _run(prefill, decode, pm, dm, ["wrong-agent"])
    assert decode.output("wrong-agent").finish_reason == "length"
    assert _all_back(decode, dm)


def test_a_request_aborted_in_flight_frees_its_pages_in_its_own_group(pair):
    prefill, decode, pm, dm = pair
    assert dm.submit("gone", list(range(200, 260)), GREEDY, group=1)
    pm.poll()  # the prefill side takes it
    dm.abort("gone")
    _run(prefill, decode, pm, dm, ["gone"])
    assert decode.output("gone").finish_reason == "error" and finished(decode, "gone")
    assert _all_back(decode, dm)


def test_a_group_that_is_not_there_is_refused_with_nothing_taken(pair):
    _, decode, _, dm = pair
    for bad in (2, -1, "1", None, True):
        with pytest.raises(ValueError, match=r"group must be a DP group of this worker, in \[0, 2\)"):
            dm.submit("nowhere", [5, 6, 7, 8, 9], GREEDY, group=bad)
    assert not dm.pending and not decode.front.holds("nowhere")
