"""The router's policies (experiments/deploy/policy.py) on hand-made page names."""

import pytest

from experiments.deploy.policy import POLICIES, Router, page_names


def _names(conversation: str, pages: int) -> list:
    return [("system", 0), ("system", 1)] + [(conversation, i) for i in range(2, pages)]


def test_cache_aware_sends_a_conversation_where_its_history_is():
    r = Router(["a", "b"], page_size=16)
    assert r.route("c1-t0", _names("c1", 4), 64, ["a", "b"]) == "a"  # a tie: the first
    # a holds the system pages but has 4 in flight: 2 to compute + 4 there, 4 + 0 on b
    assert r.route("c2-t0", _names("c2", 4), 64, ["a", "b"]) == "b"
    r.finished("a", "c1-t0", _names("c1", 6))  # prompt and reply now cached on a
    r.finished("b", "c2-t0", _names("c2", 6))
    assert r.route("c2-t1", _names("c2", 8), 128, ["a", "b"]) == "b"  # 6 of 8 pages there
    assert r.route("c1-t1", _names("c1", 8), 128, ["a", "b"]) == "a"
    assert r.overlap_pages == 0 + 0 + 6 + 6 and r.routed_pages == 4 + 4 + 8 + 8


def test_cache_aware_weighs_the_overlap_against_the_load():
    r = Router(["a", "b"], page_size=16, overlap_weight=1.0)
    r.finished("a", "old", _names("c1", 10))
    for i in range(3):  # a is busy: 3 requests of 10 pages in flight
        r.route(f"busy{i}", [("other", i)], 160, ["a"])
    # on a: 2 pages to compute + 30 in flight; on b: 12 + 0
    assert r.route("c1-t1", _names("c1", 12), 192, ["a", "b"]) == "b"
    heavy = Router(["a", "b"], page_size=16, overlap_weight=4.0)
    heavy.finished("a", "old", _names("c1", 10))
    for i in range(3):
        heavy.route(f"busy{i}", [("other", i)], 160, ["a"])
    assert heavy.route("c1-t1", _names("c1", 12), 192, ["a", "b"]) == "a"  # 4 x 2 + 30 < 4 x 12


def test_a_dead_worker_is_skipped_and_forgotten_and_no_live_worker_is_an_error():
    r = Router(["a", "b"], page_size=16)
    r.finished("a", "x", _names("c1", 6))
    assert r.route("c1-t1", _names("c1", 8), 128, ["b"]) == "b"  # a is not live
    r.forget("a")
    assert r.overlap("a", _names("c1", 8)) == 0
    r.moved("c1-t1", "b")
    assert not r.in_flight["b"]
    with pytest.raises(ValueError, match="no live worker"):
        r.route("y", [], 1, [])


def test_a_stale_belief_only_misroutes_and_the_lru_keeps_what_was_used_last():
    r = Router(["a", "b"], page_size=16, cache_pages=4)
    r.finished("a", "x", _names("c1", 4))
    r.finished("a", "y", [("z", i) for i in range(3)])  # 7 pages believed: the oldest 3 dropped
    assert r.overlap("a", _names("c1", 4)) == 0 and len(r.cached["a"]) == 4


def test_round_robin_and_least_loaded():
    rr = Router(["a", "b", "c"], "round_robin")
    assert [rr.route(i, [], 16, ["a", "b", "c"]) for i in range(4)] == ["a", "b", "c", "a"]
    ll = Router(["a", "b"], "least_loaded")
    assert [ll.route(i, [], 16, ["a", "b"]) for i in range(3)] == ["a", "b", "a"]
    ll.finished("a", 0)
    ll.finished("a", 2)
    assert ll.route(3, [], 16, ["a", "b"]) == "a"
    with pytest.raises(ValueError, match=r"deployment.routing='random' is not allowed: one of"):
        Router(["a"], "random")
    assert POLICIES == ("round_robin", "least_loaded", "cache_aware")


def test_real_page_names_chain_so_only_a_shared_head_overlaps():
    a, b = page_names(range(40), 16), page_names([*range(16), 99, *range(17, 40)], 16)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]  # one token differs in page 1
    r = Router(["w"], page_size=16)
    r.finished_tokens("w", "x", list(range(49)))  # 48 tokens with KV: 3 pages
    assert r.overlap("w", page_names(range(64), 16)) == 3


def test_the_deployment_config_checks_its_routing():
    from experiments.config import DeploymentConfig

    with pytest.raises(ValueError, match=r"deployment.routing='fastest' is not allowed: one of \("):
        DeploymentConfig("d", routing="fastest")
    for bad in (-1, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="deployment.routing_overlap_weight="):
            DeploymentConfig("d", routing_overlap_weight=bad)


def test_cache_events_correct_the_belief():
    r = Router(["a", "b"], page_size=16)
    names = _names("c1", 6)
    r.route("t0", names, 96, ["a", "b"])  # believed on a at once
    r.observe("a", [(False, names[3])])  # a evicted page 3: the overlap stops there
    assert r.overlap("a", names) == 3
    r.observe("b", [(True, n) for n in names])  # b computed them (another router's request)
    assert r.overlap("b", names) == 6 and r.events == 7
    r.finished("a", "t0")
    assert r.route("t1", names + [("c1", 6)], 112, ["a", "b"]) == "b"
    r.observe("gone", [(True, b"x")])  # a worker the router does not route to: ignored
    assert "gone" not in r.cached


def test_with_events_a_request_s_end_adds_nothing_the_worker_did_not_report():
    r = Router(["w"], page_size=4, salt=b"m|float32|4")
    r.observe("w", [(True, b"seen")])
    r.finished_tokens("w", "x", list(range(13)))  # 3 pages' worth: the worker's events say what it named
    assert list(r.cached["w"]) == [b"seen"]
    assert page_names(range(8), 4, b"m|float32|4") != page_names(range(8), 4)  # the engine's salt


def test_the_engine_s_events_name_pages_as_the_router_does():
    from engine import LLM, SamplingParams

    llm = LLM("tiny-random", page_size=4, num_pages=64)
    llm.allocator.record_events()
    prompt = list(range(10, 40))
    llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
    r = Router(["w"], page_size=4, salt=llm.scheduler.salt)
    r.observe("w", llm.allocator.take_events())
    assert r.overlap("w", page_names(prompt, 4, llm.scheduler.salt)) == 30 // 4
