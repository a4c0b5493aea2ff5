"""Fair share among clients (engine/fair.py) in the engine's scheduler: the next sequence admitted is the
client's that holds the fewest, and while it cannot start a client holding two more gives way; one
client alone is served first come, first served; preempted sequences give the same tokens."""

import pytest

from engine import LLM, SamplingParams
from engine.fair import Shares, check_client

A, B = ("10.0.0.1",), ("10.0.0.2",)
LONG = 60  # tokens a flooding request asks for (it runs past every check below)


def _params(client, max_tokens=LONG):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, client=client)


def _running(llm) -> dict:
    count: dict = {}
    for seq in llm.scheduler.running:
        count[seq.params.client] = count.get(seq.params.client, 0) + 1
    return count


def _step(llm, done: dict | None = None) -> None:
    """One step; the requests it finished, into done (request id -> token ids)."""
    for out in llm.step():
        if out.finished and done is not None:
            done[out.request_id] = out.token_ids


def _steps_until_first_token(llm, request_id: str, most: int) -> int:
    for step in range(1, most + 1):
        llm.step()
        if llm.core.seqs[request_id].output_ids:
            return step
    raise AssertionError(f"{request_id} had no token after {most} steps; running: {_running(llm)}")


@pytest.fixture
def alone():
    """Each prompt's greedy tokens run by itself (preempted sequences must give the same)."""
    llm = LLM("tiny-random", page_size=4, num_pages=256)
    return lambda prompt, n=LONG: llm.generate([prompt], _params(None, n))[0].token_ids


def test_a_client_holding_every_slot_gives_one_to_a_newcomer_at_once(alone):
    llm = LLM("tiny-random", page_size=4, num_pages=256, max_num_seqs=4)
    for i in range(6):  # four run, two wait
        llm.add_request([5 + i, 6, 7], _params(A), f"a{i}")
    for _ in range(3):
        llm.step()
    assert _running(llm) == {A: 4}
    llm.add_request([9, 9, 9], _params(B, 8), "b")
    assert _steps_until_first_token(llm, "b", 1) == 1  # its first step: a of A's gave way
    assert _running(llm) == {A: 3, B: 1} and llm.preemption_stats["preemptions"] == 1
    outs: dict = {}
    while "b" not in outs:  # settled: A's own waiting ones do not take the slot back
        assert _running(llm).get(B) == 1
        _step(llm, outs)
    while llm.has_unfinished():
        _step(llm, outs)
    assert llm.preemption_stats["preemptions"] == 1  # no sequence traded back and forth
    assert outs["a3"] == alone([8, 6, 7])  # the one preempted and computed again: the same tokens
    assert llm.allocator.num_free == 256


def test_one_client_alone_is_first_come_first_served():
    llm = LLM("tiny-random", page_size=4, num_pages=256, max_num_seqs=4)
    for i in range(4):
        llm.add_request([5 + i, 6, 7], _params(A), f"a{i}")
    for _ in range(3):
        llm.step()
    llm.add_request([9, 9, 9], _params(A, 8), "late")
    for _ in range(20):  # its own client's: it waits for a slot, and nothing is preempted for it
        llm.step()
        assert not llm.core.seqs["late"].output_ids
    assert llm.preemption_stats["preemptions"] == 0


def test_the_waiting_client_that_holds_the_fewest_goes_first():
    llm = LLM("tiny-random", page_size=4, num_pages=256, max_num_seqs=3)
    llm.add_request([5, 6], _params(A, 4), "a0")
    llm.add_request([5, 7], _params(A), "a1")
    llm.add_request([5, 8], _params(B), "b0")
    llm.step()
    for rid, client in (("a2", A), ("a3", A), ("b1", B)):  # queued in this order, behind a full step
        llm.add_request([6, 6], _params(client), rid)
    done: dict = {}
    while "a0" not in done:
        _step(llm, done)
    llm.step()  # a0's slot: A and B hold one each, and a2 came first
    started = {rid for rid in ("a2", "a3", "b1") if llm.core.seqs[rid].num_computed}
    assert started == {"a2"} and llm.preemption_stats["preemptions"] == 0
    llm.abort("b0")  # B holds none, A two: b1 goes before a3, which came before it
    llm.step()
    assert llm.core.seqs["b1"].num_computed and not llm.core.seqs["a3"].num_computed


def test_a_sender_is_served_before_the_users_behind_another_sender():
    """Levels: an address that names a new user per request gets its address's share, not one per user."""
    llm = LLM("tiny-random", page_size=4, num_pages=256, max_num_seqs=6)
    for i in range(5):
        llm.add_request([5 + i, 6], _params(("10.0.0.9", f"user{i}")), f"x{i}")
    llm.add_request([5, 7], _params(("10.0.0.8", "bob")), "y0")
    for _ in range(2):
        llm.step()
    llm.add_request([5, 9], _params(("10.0.0.9", "user5")), "x5")  # its users hold one each: it waits
    for _ in range(5):
        llm.step()
    assert not llm.core.seqs["x5"].output_ids and llm.preemption_stats["preemptions"] == 0
    llm.add_request([5, 8], _params(("10.0.0.8", "carol")), "y1")  # its sender holds 1 against 5
    assert _steps_until_first_token(llm, "y1", 1) == 1
    assert llm.preemption_stats["preemptions"] == 1


def test_a_client_over_its_share_of_pages_gives_way():
    """Pages, not slots: A's long sequences grow into every free page past their share; B waits for
    pages, and A's newest gives its pages back."""
    llm = LLM("tiny-random", page_size=4, num_pages=40, max_num_seqs=16)
    for i in range(4):
        llm.add_request([5 + i] * 8, _params(A, 120), f"a{i}")
    while llm.allocator.num_free > 2:
        llm.step()
    llm.add_request([9] * 8, _params(B, 8), "b")
    assert _steps_until_first_token(llm, "b", 3) <= 3
    assert llm.preemption_stats["preemptions"] >= 1


def test_shares_count_each_level_and_compare_at_the_first_that_differs():
    class Seq:
        def __init__(self, client):
            self.params = SamplingParams(client=client)

    x1, x2, y = Seq(("x", "1")), Seq(("x", "2")), Seq(("y", "1"))
    shares = Shares([x1, x1, x1, x2, y])
    assert shares.rank(x1) == (4, 3) and shares.rank(x2) == (4, 1) and shares.rank(y) == (1, 1)
    assert shares.gives_way(x1, y) and not shares.gives_way(y, x1)  # by sender: 4 against 1
    assert shares.gives_way(x1, x2)  # same sender: by user, 3 against 1
    assert not shares.gives_way(x1, x1) and not Shares([Seq(None)] * 9).gives_way(Seq(None), Seq(None))
    assert not Shares([x1, x1, y]).gives_way(x1, y)  # 2 against 1: after the exchange y would hold more


@pytest.mark.parametrize("client", ["x", (), ("a", "b", "c"), ("",), ("a" * 65,), (1,), ["a", None]])
def test_a_bad_client_is_refused_naming_it(client):
    with pytest.raises(ValueError, match="client must be None or a list of 1-2 names"):
        check_client(client)
    with pytest.raises(ValueError, match="client must be"):
        SamplingParams(client=client)
