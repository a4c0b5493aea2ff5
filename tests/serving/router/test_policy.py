"""The router's policies (serving/router/policy.py) on hand-made page names."""

import pytest

from serving.router.belief import page_names
from serving.router.policy import BIAS_WINDOW_S, POLICIES, Router


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


def test_a_dp_worker_s_groups_each_get_the_conversations_whose_history_they_hold():
    """deployment.dp: the worker as above, then the group in it by the same cost over each group's own belief
    (what it routed there, and the worker's per-group cache events); dp 1 names no group."""
    from serving.messages import Load

    r = Router(["a", "b"], page_size=16, dp=2)
    assert r.route("c1-t0", _names("c1", 4), 64, ["a"]) == "a" and r.dp_rank_of("c1-t0") == 0
    assert r.route("c2-t0", _names("c2", 4), 64, ["a"]) == "a" and r.dp_rank_of("c2-t0") == 1  # the idle one
    r.finished("a", "c1-t0", _names("c1", 6))
    r.finished("a", "c2-t0", _names("c2", 6))
    assert r.dp_rank_of("c1-t0") is None and not any(r.groups["a"].in_flight)
    assert r.route("c2-t1", _names("c2", 8), 128, ["a"]) == "a" and r.dp_rank_of("c2-t1") == 1
    assert r.route("c1-t1", _names("c1", 8), 128, ["a"]) == "a" and r.dp_rank_of("c1-t1") == 0
    # group 0 reports c3's pages named (a request the router did not route there, e.g. a migrated one)
    r.observe_load("a", Load("a", 0, 0, 0, group_cache_events=[[(True, n) for n in _names("c3", 6)], []]))
    r.moved("c1-t1", "a")
    r.moved("c2-t1", "a")
    assert r.route("c3-t1", _names("c3", 8), 128, ["a"]) == "a" and r.dp_rank_of("c3-t1") == 0
    r.forget("a")  # died: every group's cache with it
    assert not any(r.groups["a"].cached)
    one = Router(["a"], page_size=16)
    one.route("x", _names("c1", 4), 64, ["a"])
    assert one.dp_rank_of("x") is None and not one.groups


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
    from serving.config import DeploymentConfig

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


def _Load(prefill_tokens=0, prefill_s=0.0, decode_steps=0, decode_seqs=0, decode_s=0.0):
    """A worker's Load with these counters (what admission reads)."""
    from serving.messages import Load

    return Load("w", 0, 0, 0, prefill_tokens=prefill_tokens, prefill_s=prefill_s, decode_steps=decode_steps,
                decode_seqs=decode_seqs, decode_s=decode_s)  # fmt: skip


def _slo_router(**kw):
    now = [0.0]
    slo = (1.0, 0.1)
    r = Router(["a"], "least_loaded", page_size=16, admission="slo", slo=slo, clock=lambda: now[0], **kw)
    return r, now


def test_admission_admits_until_it_knows_the_speed_then_refuses_what_the_queue_makes_late():
    r, now = _slo_router()
    for i in range(20):  # no Load yet: no prediction, every request taken
        assert r.route(f"r{i}", [], 1000, ["a"], admit=True) == "a"
    r.observe_load("a", _Load(0, 0.0))
    r.observe_load("a", _Load(2000, 1.0))  # 2,000 prompt tokens/s
    # 20,000 tokens ahead: 10 s, far past the 1 s TTFT
    assert r.route("late", [], 1000, ["a"], admit=True) is None
    assert "predicted TTFT 10.50 s > slo.ttft_s=1" in r.why and r.rejected == 1
    assert "late" not in r.in_flight["a"]  # refused: nothing recorded
    assert r.route("migrated", [], 1000, ["a"]) == "a"  # a migration is never refused, nor queued
    for i in range(20):  # their first tokens come: the queue empties
        r.first_token(f"r{i}")
    assert r.route("now", [], 1000, ["a"], admit=True) == "a" and r.why is None  # 0.5 s


def test_a_colocated_worker_not_measured_yet_is_priced_as_its_peers():
    r = Router(["a", "b"], "round_robin", page_size=16, admission="slo", slo=(1.0, 1.0))
    r.observe_load("a", _Load())
    r.observe_load("a", _Load(1000, 1.0))
    assert r.predict("b", 500)[0] == pytest.approx(0.5)  # b has no Load with prompt tokens yet
    assert r.route("x", [], 2000, ["a", "b"], admit=True) is None  # 2 s on a, and on b alike


def test_admission_learns_the_bias_from_first_tokens_on_a_driven_clock():
    r, now = _slo_router()
    r.observe_load("a", _Load(0, 0.0))
    r.observe_load("a", _Load(1000, 1.0))  # 1,000 tokens/s
    for i in range(30):  # each alone: predicted 0.5 s, but its first token takes 0.9 s
        assert r.route(f"r{i}", [], 500, ["a"], admit=True) == "a"
        now[0] += 0.9
        r.first_token(f"r{i}")
        r.finished("a", f"r{i}")
    assert r.ttft_bias == pytest.approx(0.4)  # the 0.4 s each missed by
    ttft, _ = r.predict("a", 500)
    assert ttft == pytest.approx(0.5 + r.ttft_bias)
    assert r.route("next", [], 700, ["a"], admit=True) is None  # 0.7 + ~0.35 > 1 s


def test_admission_cannot_lock_itself_out():
    """The lockout recipe: one first token 20 s late (a slow grammar) raised the bias past the
    SLO, and since a refused request never has a first token, every request after it was refused for
    good. Now one is admitted per probe interval while all are refused, and lateness counts for
    BIAS_WINDOW_S only: within that time requests are admitted as before."""
    r, now = _slo_router()
    r.observe_load("a", _Load(0, 0.0))
    r.observe_load("a", _Load(1000, 1.0))  # 1,000 tokens/s: a 200-token prompt alone, 0.2 s
    assert r.route("slow", [], 200, ["a"], admit=True) == "a"
    now[0] += 20.2
    r.first_token("slow")
    r.finished("a", "slow")
    assert r.ttft_bias == pytest.approx(20.0)
    # the first request after a probe interval with no admission is a probe; the rest are refused
    assert r.route("x0", [], 200, ["a"], admit=True) == "a" and r.probes == 1
    for i in range(1, 30):  # predicted 20 s late
        now[0] += 0.02
        assert r.route(f"x{i}", [], 200, ["a"], admit=True) is None
    assert r.refusing == pytest.approx(0.56) and r.rejected == 29
    now[0] += r.probe_s  # a probe interval of refusing everything: the next one is measured
    assert r.route("probe", [], 200, ["a"], admit=True) == "a" and r.probes == 2 and r.refusing is None
    r.first_token("x0")  # it waited behind the probe's worker: on time too, here
    r.finished("a", "x0")
    now[0] += 0.2
    r.first_token("probe")  # on time
    r.finished("a", "probe")
    assert r.route("still", [], 200, ["a"], admit=True) is None  # the old lateness still weighs (10 s)
    served_at = None
    for i in range(200):  # normal requests, one every 0.25 s: admitted again in bounded time
        now[0] += 0.25
        if r.route(f"n{i}", [], 200, ["a"], admit=True) == "a":
            served_at = served_at or now[0]
            now[0] += 0.2
            r.first_token(f"n{i}")
            r.finished("a", f"n{i}")
    assert served_at is not None and served_at - 20.2 <= BIAS_WINDOW_S + r.probe_s
    assert r.refusing is None and r.ttft_bias == pytest.approx(0.0, abs=1e-9)


def test_a_slow_decode_step_long_ago_does_not_refuse_requests_for_good():
    r, now = _slo_router()
    r.observe_load("a", _Load())
    r.observe_load("a", _Load(decode_steps=2, decode_seqs=2, decode_s=10.0))  # 5 s steps (a compile)
    assert r.route("x", [], 16, ["a"], admit=True) is None and "TPOT" in r.why
    now[0] += BIAS_WINDOW_S + 0.1
    assert r.predict("a", 16)[1] is None  # nothing recent measured: admitted, as before any Load
    assert r.route("y", [], 16, ["a"], admit=True) == "a"


def test_admission_predicts_tpot_from_the_batch_it_would_join():
    r, _ = _slo_router()
    # pure decode steps: batch 2 at 40 ms, batch 6 at 80 ms (a line: 20 ms + 10 ms per sequence)
    r.observe_load("a", _Load())
    r.observe_load("a", _Load(decode_steps=10, decode_seqs=20, decode_s=0.4))
    r.observe_load("a", _Load(decode_steps=20, decode_seqs=80, decode_s=1.2))
    assert r.speed["a"].step_s(4) == pytest.approx(0.06)
    for i in range(7):
        assert r.route(f"r{i}", [], 16, ["a"], admit=True) == "a"
        r.first_token(f"r{i}")
    assert r.predict("a", 16)[1] == pytest.approx(0.1)  # the 8th: 20 + 80 ms, at the bound
    r.route("r7", [], 16, ["a"], admit=True)
    assert r.route("r8", [], 16, ["a"], admit=True) is None and "TPOT" in r.why


def test_admission_prices_every_completion_of_a_request():
    """A request of n=16 was priced as one sequence (its later completions follow the first
    without admission), so four of them filled a worker's batch while other clients were refused. Its
    predicted TPOT is now the step at the batch with all n: refused where n=1 is admitted."""
    r, _ = _slo_router()
    r.observe_load("a", _Load())  # a step takes 20 ms + 10 ms per sequence (slo.tpot_s 0.1)
    r.observe_load("a", _Load(decode_steps=10, decode_seqs=20, decode_s=0.4))
    r.observe_load("a", _Load(decode_steps=20, decode_seqs=80, decode_s=1.2))
    assert r.route("many", [], 16, ["a"], admit=True, sequences=16) is None and "TPOT" in r.why
    assert r.route("one", [], 16, ["a"], admit=True) == "a"
    assert r.route("eight", [], 16, ["a"], admit=True, sequences=7) == "a"  # 20 + 8 x 10 ms: the bound


def test_admission_weighs_the_pages_a_request_s_completions_need_to_finish():
    """Four requests of n=16 x 700 tokens on a worker of 256 pages of 4 tokens were admitted,
    each needing 16 x 175 pages: they could only run by being preempted and recomputed over and over."""
    r = Router(["a"], page_size=4, cache_pages=256, admission="slo", slo=(10.0, 1.0))
    assert r.route("big", [], 5, ["a"], admit=True, sequences=16, max_tokens=700) is None
    assert "need 2802 KV pages to reach max_tokens, more than the 256 a worker holds" in r.why
    assert r.route("fits", [], 5, ["a"], admit=True, sequences=16, max_tokens=60) == "a"  # 2 + 16 x 15
    assert r.route("one", [], 5, ["a"], admit=True, max_tokens=1000) == "a"  # 2 + 250
    none = Router(["a"], page_size=4, cache_pages=256)  # admission none takes it (fair share copes)
    assert none.route("big", [], 5, ["a"], admit=True, sequences=16, max_tokens=700) == "a"


def test_a_request_that_cannot_fit_is_refused_every_time_even_by_the_probe():
    """With admission=slo, one of four identical requests needing 1,616 pages of 256 was
    admitted: the probe that admits one request after a probe interval of refusals took it."""
    now = [0.0]
    r = Router(["a"], page_size=4, cache_pages=256, admission="slo", slo=(1.0, 1.0), clock=lambda: now[0])
    assert r.route("small", [], 5, ["a"], admit=True, max_tokens=8) == "a"
    for i in range(4):
        now[0] += 100.0  # far past the probe interval each time
        assert r.route(f"big{i}", [], 5, ["a"], admit=True, sequences=16, max_tokens=400) is None
        assert r.why.startswith("rejected: it cannot fit") and "1602 KV pages" in r.why
    assert r.probes == 0 and r.rejected == 4 and r.refusing is None  # it says nothing of the load


def test_admission_starts_from_the_speed_a_worker_timed_as_it_started():
    """The router admitted on a speed it had not measured yet, and 5 of the first 6 admitted
    missed TTFT. With what each worker timed as it started (its Ready), the burst's third 1,024-token
    prompt, predicted at 3.1 s on a 1,000 token/s worker, is refused at once."""
    burst = [f"r{i}" for i in range(4)]
    blind = Router(["a"], page_size=16, admission="slo", slo=(3.0, 1.0))
    assert [blind.route(rid, [], 1024, ["a"], admit=True) for rid in burst] == ["a"] * 4
    seeded = Router(["a"], page_size=16, admission="slo", slo=(3.0, 1.0))
    seeded.measured("a", 1000.0, 0.02)
    assert [seeded.route(rid, [], 1024, ["a"], admit=True) for rid in burst] == ["a", "a", None, None]
    assert "predicted TTFT 3.07 s" in seeded.why
    assert seeded.predict("a", 1)[1] == pytest.approx(0.02)  # the decode step it timed
    seeded.observe_load("a", _Load(prefill_tokens=1024, prefill_s=2.048))  # its Loads take over: 500/s
    assert seeded.speed["a"].prefill_tok_s == pytest.approx(0.7 * 1000 + 0.3 * 500)


def test_the_first_submit_of_a_request_carries_its_number_of_completions():
    from engine import SamplingParams
    from serving.http.api import Parsed
    from serving.messages import Submit

    first = Submit("r", [1, 2], SamplingParams(max_tokens=2))
    subs = Parsed([1, 2], first, stream=False, include_usage=False, n=3).completions
    assert [s.completions for s in subs] == [3, 1, 1] and [s.after for s in subs] == [None, "r", "r"]
    with pytest.raises(ValueError, match="completions"):
        Submit("r", [1], SamplingParams(), completions=0)


def test_the_router_picks_the_prefill_worker_where_a_prompt_starts_soonest_and_skips_a_dead_one():
    now = [0.0]
    r = Router(["d0", "d1"], "least_loaded", admission="slo", slo=(1.6, 1.0), prefill_workers=["p0", "p1"],
               clock=lambda: now[0])  # fmt: skip
    assert r.route("early", [], 500, ["d0", "d1"], admit=True) and r.prefill_of("early") is None  # none heard
    r.first_token("early")
    r.observe_load("p0", _Load(1000, 1.0))  # 1,000 tokens/s
    r.observe_load("p1", _Load(2000, 1.0))  # 2,000 tokens/s
    chosen = []
    for i in range(4):
        assert r.route(f"r{i}", [], 500, ["d0", "d1"], admit=True) is not None
        chosen.append(r.prefill_of(f"r{i}"))
    # where it starts soonest: p1 (0.25 s against 0.5), p0 (a tie at 0.5: the first), p1 (0.5 against
    # 1.0), p1 (0.75 against 1.0)
    assert chosen == ["p1", "p0", "p1", "p1"]
    assert r._ahead("p0") + r._ahead("p1") == 2000
    r.forget("p1")  # dead: not chosen until it is heard from again
    assert r.route("r4", [], 100, ["d0"], admit=True) and r.prefill_of("r4") == "p0"
    ahead = r._ahead("p0")
    assert r.predict("d0", 500)[0] == pytest.approx((ahead + 500) / 1000)
    assert r.route("r5", [], 1100, ["d0"], admit=True) is None  # (600 + 1100) / 1000 > 1.6 s
    r.observe_load("p1", _Load(100, 0.05))  # back (restarted): 1,500 ahead at 2,000/s beats p0's 1.1 s
    assert r.route("r6", [], 500, ["d0", "d1"], admit=True) and r.prefill_of("r6") == "p1"
    assert r.prefill_of("missing") is None


def test_round_robin_takes_the_live_prefill_workers_in_turn_too():
    """routing=round_robin, disaggregated: each admitted request's prefill worker is the next live one,
    whatever their queues; a refused request takes no turn, a dead worker is skipped."""
    r = Router(["d0"], "round_robin", admission="slo", slo=(1.0, 1.0), prefill_workers=["p0", "p1", "p2"])
    for p in ("p0", "p1", "p2"):
        r.observe_load(p, _Load(1000, 1.0))
    chosen = []
    for i in range(4):
        assert r.route(f"r{i}", [], 100, ["d0"], admit=True) == "d0"
        chosen.append(r.prefill_of(f"r{i}"))
    assert chosen == ["p0", "p1", "p2", "p0"]
    assert r.route("huge", [], 100_000, ["d0"], admit=True) is None  # refused: 100 s to its first token
    assert r.route("r4", [], 100, ["d0"], admit=True) and r.prefill_of("r4") == "p1"  # p1's turn still
    r.forget("p2")
    after = []
    for i in range(5, 9):
        assert r.route(f"r{i}", [], 100, ["d0"], admit=True)
        after.append(r.prefill_of(f"r{i}"))
    assert after in (["p0", "p1"] * 2, ["p1", "p0"] * 2)  # the two live ones, in turn


def test_the_first_load_counts_from_the_worker_s_start_and_a_restart_starts_over():
    r, _ = _slo_router()
    r.observe_load("a", _Load(2000, 1.0))  # the first Load the router sees (Loads before it were not)
    assert r.speed["a"].prefill_tok_s == 2000
    r.observe_load("a", _Load(3000, 2.0))  # 1,000 tokens/s since: 0.7 x 2000 + 0.3 x 1000
    assert r.speed["a"].prefill_tok_s == pytest.approx(1700)
    r.observe_load("a", _Load(100, 0.1))  # restarted: its counters since it came back, never negative
    assert r.speed["a"].prefill_tok_s == pytest.approx(0.7 * 1700 + 0.3 * 1000)


def test_admission_none_takes_everything_and_the_config_checks_it():
    r = Router(["a"], page_size=16, admission="none", slo=(0.001, 0.001))
    r.observe_load("a", _Load())
    r.observe_load("a", _Load(10, 1.0))
    assert all(r.route(f"r{i}", [], 10_000, ["a"], admit=True) == "a" for i in range(5))
    with pytest.raises(ValueError, match="deployment.admission='maybe' is not allowed: one of"):
        Router(["a"], admission="maybe")
    from serving.config import DeploymentConfig

    with pytest.raises(ValueError, match="deployment.admission"):
        DeploymentConfig("x", admission="always")


# -- elastic roles: Router.leave/join and the Planner on a driven clock


def test_a_leaving_worker_takes_nothing_new_and_joins_its_new_role():
    r = Router(["d0", "d1"], page_size=16, prefill_workers=["p0"])
    assert r.route("a", [("x", 0)], 16, ["d0", "d1"]) == "d0"
    r.leave("d0")
    assert r.workers == ["d1"] and "a" in r.in_flight["d0"]  # what it has stays recorded until moved
    r.moved("a", "d0")
    assert r.route("a", [("x", 0)], 16, r.workers) == "d1"
    r.join("d0", "prefill")
    assert r.prefill_workers == ["p0", "d0"]
    r.leave("p0")
    r.join("p0", "decode")
    assert r.workers == ["d1", "p0"] and r.prefill_workers == ["d0"] and r.in_flight["p0"] == set()
    with pytest.raises(ValueError, match="role='colocated' is not allowed"):
        r.join("p0", "colocated")


class _Recording(Router):
    """A Router that keeps the worker of every route() (the simulator's choices)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.routed = []

    def route(self, *args, **kwargs):
        self.routed.append(super().route(*args, **kwargs))
        return self.routed[-1]


def test_the_simulator_and_the_real_driver_route_the_same_recorded_requests_alike():
    """Six conversations of four turns over a shared system prompt, one request at a time: the router
    fed the real requests' token ids (the driver's route_tokens / finished_tokens, names hashed as the
    engine's) and the same router inside the simulator (its requests' page names by conversation) pick the
    same worker for every request and find the same pages cached there, cache_aware and round_robin
    alike."""
    import random

    from experiments.sim.simulate import Instance, SimRequest, simulate_colocated
    from tests.experiments.sim.test_simulate import _cost

    rng = random.Random(0)
    system = [rng.randrange(3, 1000) for _ in range(40)]
    recorded = []  # (conversation, prompt ids, reply ids), in arrival order
    history = {c: list(system) for c in range(6)}
    for _ in range(4):  # turns
        for c in rng.sample(range(6), 6):
            prompt = history[c] + [rng.randrange(3, 1000) for _ in range(rng.randrange(5, 30))]
            reply = [rng.randrange(3, 1000) for _ in range(rng.randrange(2, 20))]
            recorded.append((c, prompt, reply))
            history[c] = prompt + reply
    for policy in ("cache_aware", "round_robin"):
        real = Router(["w0", "w1"], policy, page_size=16, cache_pages=64)
        chosen = []
        for i, (_, prompt, reply) in enumerate(recorded):
            worker = real.route_tokens(i, prompt, ["w0", "w1"])
            real.finished_tokens(worker, i, prompt + reply)
            chosen.append(int(worker[1]))
        sim = _Recording([0, 1], policy, page_size=16, cache_pages=64)
        reqs = [
            SimRequest(i, 1000.0 * i, len(p), len(r), shared=len(system), stream=("conversation", c))
            for i, (c, p, r) in enumerate(recorded)
        ]
        simulate_colocated(
            [Instance(_cost(), page_size=16), Instance(_cost(), page_size=16)], reqs, policy=sim
        )
        assert sim.routed == chosen, policy
        # the same pages found cached: the simulator names pages as the engine does
        assert sim.overlap_pages == real.overlap_pages > 0 and sim.routed_pages == real.routed_pages


def test_by_load_a_decode_worker_prefills_itself_when_the_prefill_queue_would_break_the_ttft_slo():
    """deployment.local_prefill_by_load: conditional disaggregation by load, not by prompt length."""
    r = Router(["d0"], "round_robin", slo=(3.0, 0.1), prefill_workers=["p0"], by_load=True)
    r.observe_load("p0", _Load(1000, 1.0))  # 1,000 prompt tokens/s
    r.observe_load("d0", _Load())
    r.observe_load("d0", _Load(500, 1.0, decode_steps=10, decode_seqs=20, decode_s=0.5))  # 500/s, 50 ms
    routed = []
    for i in range(6):
        assert r.route(f"r{i}", [], 1000, ["d0"], admit=True) == "d0"
        routed.append(r.prefill_of(f"r{i}"))
    # p0's queue: 1, 2, 3 s (within 3 s), then 4 s against d0's own 2 s: d0; then p0's 4 s against 4 s
    # on d0 (not sooner): p0; then 5 s against 4: d0
    assert routed == ["p0", "p0", "p0", "d0", "p0", "d0"]
    assert r.local_by_load == 2


def test_by_load_keeps_the_prefill_worker_without_tpot_headroom_or_when_asked_not_to():
    r = Router(["d0"], "round_robin", slo=(1.0, 0.1), prefill_workers=["p0"], by_load=True)
    r.observe_load("p0", _Load(1000, 1.0))
    r.observe_load("d0", _Load())
    r.observe_load("d0", _Load(5000, 1.0, decode_steps=10, decode_seqs=20, decode_s=1.5))  # 150 ms steps
    r.route("a", [], 1000, ["d0"], admit=True)
    r.route("b", [], 1000, ["d0"], admit=True)  # 2 s on p0 against 0.2 s here, but its decodes are late
    assert r.prefill_of("b") == "p0" and r.local_by_load == 0
    off = Router(["d0"], "round_robin", slo=(1.0, 0.1), prefill_workers=["p0"])
    off.observe_load("p0", _Load(1000, 1.0))
    for i in range(3):
        off.route(f"r{i}", [], 1000, ["d0"], admit=True)
    assert [off.prefill_of(f"r{i}") for i in range(3)] == ["p0"] * 3


def test_a_bursts_lateness_does_not_refuse_requests_to_an_idle_worker():
    """A burst's first tokens came late (each behind the others), the bias rose past the SLO,
    and once the burst ended the idle server refused every request for about 20 s. What requests took
    beside others predicts nothing for a worker with nothing in flight; it still weighs while others run."""
    r, now = _slo_router()
    r.observe_load("a", _Load(0, 0.0))
    r.observe_load("a", _Load(1000, 1.0))  # 1,000 tokens/s
    burst = [f"b{i}" for i in range(8)]
    for rid in burst:  # 100 tokens each: 0.1-0.8 s predicted, all admitted
        assert r.route(rid, [], 100, ["a"], admit=True) == "a"
    now[0] += 4.0  # their first tokens come 3-4 s late (something slowed every step)
    for rid in burst:
        r.first_token(rid)
    for rid in burst:
        r.finished("a", rid)
    assert r.ttft_bias > 3.0
    assert r.route("alone", [], 200, ["a"], admit=True) == "a" and r.probes == 0  # 0.2 s: not a probe
    assert r.route("beside", [], 200, ["a"], admit=True) is None  # 0.4 s + the burst's lateness
    now[0] += 0.3
    r.first_token("alone")  # on time, and alone: its own evidence for an idle worker
    r.finished("a", "alone")
    assert r.route("again", [], 200, ["a"], admit=True) == "a"
