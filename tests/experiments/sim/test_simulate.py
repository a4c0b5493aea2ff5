"""The event loop on tiny traces whose answers follow by hand from a cost model with round step times."""

import time

import pytest

from experiments.sim.cost import CostModel, Efficiency
from experiments.sim.hardware import Hardware, hardware
from experiments.sim.models import sim_model
from experiments.sim.simulate import (
    Instance,
    SimRequest,
    attainment,
    poisson_requests,
    simulate_colocated,
    simulate_disaggregated,
)
from tests.experiments.sim.toys import TOY, fixed_steps

HW = Hardware("toy", flops=1e3, hbm_bw=1e2, hbm_bytes=1e9, nvlink_bw=10, nic_bw=5)
Steps = fixed_steps(1.0, 0.1)  # a step takes 1 s plus 0.1 s per prefill token; decode steps 1 s


def _cost():
    return Steps(TOY, HW, eff=Efficiency(comm=1))


def _fast_link():
    """The same steps with a link so fast that requests prefilled together land together (one link
    carries one request's KV after another's)."""
    return Steps(TOY, Hardware("toy", flops=1e3, hbm_bw=1e2, hbm_bytes=1e9, nvlink_bw=10, nic_bw=1e9))


def test_one_request_colocated():
    (r,) = simulate_colocated([Instance(_cost())], [SimRequest(0, 0.0, prompt=10, output=4)])
    assert r.first_token == pytest.approx(2.0)  # one prefill step of 10 tokens: 1 + 1 s
    assert r.done == pytest.approx(5.0)  # three decode steps of 1 s
    assert r.ttft == pytest.approx(2.0) and r.tpot == pytest.approx(1.0)


def test_chunked_prefill_splits_a_prompt_and_mixes_it_with_decodes():
    reqs = [SimRequest(0, 0.0, prompt=4, output=3), SimRequest(1, 0.0, prompt=10, output=2)]
    simulate_colocated([Instance(_cost(), budget=8)], reqs)
    # step 1 (t 0 -> 1.8): r0's 4 tokens + 4 of r1's; step 2 (-> 3.4): r0 decodes + r1's last 6 tokens;
    # step 3 (-> 4.4): both decode; r0 is done (3 tokens), r1 too (2 tokens)
    assert reqs[0].first_token == pytest.approx(1.8) and reqs[1].first_token == pytest.approx(3.4)
    assert reqs[0].done == pytest.approx(4.4) and reqs[1].done == pytest.approx(4.4)


def test_without_chunking_a_prefill_step_runs_alone():
    reqs = [SimRequest(0, 0.0, prompt=10, output=3), SimRequest(1, 0.5, prompt=10, output=1)]
    simulate_colocated([Instance(_cost(), chunked=False)], reqs)
    # r0: prefill 0 -> 2; r1 arrived meanwhile: its prefill runs alone 2 -> 4; r0 decodes 4 -> 5 -> 6
    assert reqs[0].first_token == pytest.approx(2.0) and reqs[1].first_token == pytest.approx(4.0)
    assert reqs[1].done == pytest.approx(4.0) and reqs[0].done == pytest.approx(6.0)


def test_disaggregated_request_prefills_moves_its_kv_and_decodes():
    r = SimRequest(0, 0.0, prompt=10, output=3)
    simulate_disaggregated([Instance(_cost())], [Instance(_cost())], [r], layerwise=False)
    # prefill 0 -> 2 (first token); KV 10 tokens x 32 B = 320 B over one 5 B/s link: 64 s; two decode steps
    assert r.first_token == pytest.approx(2.0) and r.done == pytest.approx(2 + 64 + 2)
    streamed = SimRequest(0, 0.0, prompt=10, output=3)
    simulate_disaggregated([Instance(_cost())], [Instance(_cost())], [streamed], layerwise=True)
    # 2 layers over a 2 s pass: 1 s of compute follows layer 0, so 63 s of the 64 show
    assert streamed.done == pytest.approx(2 + 63 + 2)


def test_first_token_on_decode_adds_a_decode_step():
    r = SimRequest(0, 0.0, prompt=10, output=3)
    simulate_disaggregated(
        [Instance(_cost())], [Instance(_cost())], [r], layerwise=False, first_token_on="decode"
    )
    assert r.first_token == pytest.approx(2 + 64 + 1) and r.done == pytest.approx(2 + 64 + 3)


def test_the_transfer_gap_counts_in_tpot_when_prefill_samples_and_attainment_checks_both_slos():
    reqs = [SimRequest(i, 0.0, prompt=1, output=2) for i in range(4)]
    simulate_disaggregated([Instance(_cost())], [Instance(_cost()), Instance(_cost())], reqs, layerwise=False)
    # one prefill step of 4 tokens: 1.4 s; 32 B of KV each over the one 5 B/s link, one after another:
    # 6.4 s each; one decode step: 1 s
    assert all(r.first_token == pytest.approx(1.4) for r in reqs)
    assert [r.done for r in reqs] == pytest.approx([1.4 + 6.4 * k + 1 for k in (1, 2, 3, 4)])
    assert attainment(reqs, ttft_s=None, tpot_s=7.5) == 25.0
    assert attainment(reqs, ttft_s=None, tpot_s=7.3) == 0.0
    assert attainment(reqs, ttft_s=1.0, tpot_s=None) == 0.0


def test_streamed_kv_hides_behind_every_pass_of_a_chunked_prefill_and_waits_for_the_link():
    """Layer streaming: a request's pages leave from its first pass's first layer on, so the compute of
    all its passes hides the link, and only the last pass's last layer must follow the prefill; a
    second request's pages wait for the first's on the prefill instance's link."""
    r = SimRequest(0, 0.0, prompt=10, output=2)
    simulate_disaggregated([Instance(_cost(), budget=4)], [Instance(_cost())], [r], layerwise=True)
    # passes of 4, 4, 2 tokens: 1.4 + 1.4 + 1.2 = 4 s; 320 B over 5 B/s: 64 s from 0.7 s (layer 0 of
    # the first pass, 2 layers): lands at 64.7, then a decode step
    assert r.done == pytest.approx(64.7 + 1)
    fast = Hardware("toy", flops=1e3, hbm_bw=1e2, hbm_bytes=1e9, nvlink_bw=10, nic_bw=1000)
    r = SimRequest(0, 0.0, prompt=10, output=2)
    cost = Steps(TOY, fast, eff=Efficiency(comm=1))
    simulate_disaggregated([Instance(cost, budget=4)], [Instance(cost)], [r], layerwise=True)
    # a link faster than compute: the last pass's last layer (2 of 10 tokens, 1 of 2 layers) follows
    assert r.done == pytest.approx(4 + 0.32 * 2 / 10 / 2 + 1)
    a, b = SimRequest(0, 0.0, prompt=10, output=2), SimRequest(1, 0.0, prompt=10, output=2)
    simulate_disaggregated([Instance(_cost(), chunked=False)], [Instance(_cost())], [a, b], layerwise=False)
    # both prefill in one 3 s pass; a's KV 3 -> 67, b's after it: 67 -> 131 (each then a decode step)
    assert a.done == pytest.approx(67 + 1) and b.done == pytest.approx(131 + 1)


def test_ten_thousand_requests_simulate_quickly():
    """The speed goal is 10,000 requests in under 5 s on one core; this only checks they all finish
    (timing assertions do not belong in tests: see docs/simulator.md for the figure)."""
    reqs = poisson_requests(3.0, 10_000, 512, 64)
    start = time.perf_counter()
    simulate_colocated([Instance(CostModel(sim_model("opt-13b"), hardware("a100-80gb")))], reqs)
    print(f"10,000 requests in {time.perf_counter() - start:.2f} s")
    assert all(r.done is not None and r.done >= r.first_token >= r.arrival for r in reqs)


def test_bad_first_token_place_is_refused():
    with pytest.raises(ValueError, match="first_token_on must be one of"):
        simulate_disaggregated([Instance(_cost())], [Instance(_cost())], [], first_token_on="router")


def test_a_request_routed_through_a_busy_decode_instance_waits_for_its_step():
    """A: prefill 0-2, KV 2-66, decode steps 66-67-68-69. B arrives at 66.5, mid-step: through the decode
    instance it reaches the prefill instance at 67 (prefill 67-69, KV lands at 133, first token 134);
    straight to the prefill instance it lands at 132.5, the decode instance idle: first token 133.5."""
    for router, first in (("decode", 134.0), ("prefill", 133.5)):
        a, b = SimRequest(0, 0.0, prompt=10, output=3), SimRequest(1, 66.5, prompt=10, output=3)
        simulate_disaggregated(
            [Instance(_cost())], [Instance(_cost())], [a, b], False, first_token_on="decode", router=router
        )
        assert a.first_token == pytest.approx(67.0) and b.first_token == pytest.approx(first), router
    with pytest.raises(ValueError, match="router must be one of"):
        simulate_disaggregated([Instance(_cost())], [Instance(_cost())], [], router="random")


def test_an_instance_slowdown_stretches_its_steps():
    (r,) = simulate_colocated([Instance(_cost(), slowdown=1.5)], [SimRequest(0, 0.0, prompt=10, output=2)])
    assert r.first_token == pytest.approx(3.0) and r.done == pytest.approx(4.5)


def test_routing_through_decode_finishes_every_request_including_prefill_only_ones():
    """Through two decode instances: four requests that decode one more token, and one whose only token
    the prefill side samples (it never reaches its decode instance)."""
    dec = [Instance(_cost()), Instance(_cost())]
    reqs = [SimRequest(i, 0.0, prompt=1, output=2) for i in range(4)]
    reqs.append(SimRequest(4, 0.0, prompt=1, output=1))
    simulate_disaggregated([Instance(_cost())], dec, reqs, layerwise=False, router="decode")
    assert all(r.done is not None for r in reqs)
    assert reqs[4].done == pytest.approx(reqs[4].first_token)


@pytest.mark.parametrize(
    "reserved_tokens, preemption", [(None, "refetch"), (0, "recompute_local"), (0, "refetch")]
)
def test_a_full_decode_instance_admits_with_room_to_finish_or_thrashes(reserved_tokens, preemption):
    """4 requests of 10 + 20 tokens land at once on a decode instance that holds 60 tokens of KV. With
    room to finish, two run at a time and none is preempted. With the prompt's KV only
    (reserved_tokens=0), all four start, run out as they grow, and preempted ones are recomputed on the
    decode instance (prefill chunks in its decode steps) or refetched from the prefill instance."""
    reqs = [SimRequest(i, 0.0, prompt=10, output=20) for i in range(4)]
    prefill = [Instance(_fast_link(), budget=64, chunked=False)]
    decode = [Instance(_cost(), kv_tokens=60, reserved_tokens=reserved_tokens, preemption=preemption)]
    simulate_disaggregated(prefill, decode, reqs)
    d = decode[0]
    assert all(r.done is not None and r.generated == 20 for r in reqs)
    assert d.kv_used == 0 and not d.running and not d.recompute  # every slot back
    if reserved_tokens is None:
        assert d.preemptions == d.recomputed_tokens == d.refetched_tokens == 0
        return
    assert d.preemptions > 0
    if preemption == "refetch":
        assert d.refetched_tokens > 0 and d.recomputed_tokens == 0
    else:
        assert d.recomputed_tokens > 0 and d.refetched_tokens == 0


def test_thrashing_shows_in_tpot_and_room_to_finish_removes_it():
    """The same collapse as on the real decode worker: recomputing preempted prompts inside decode steps
    (each 0.1 s per token here) stretches the TPOT of the requests beside them."""
    tpot = {}
    for reserved in (None, 0):
        reqs = [SimRequest(i, 0.0, prompt=10, output=20) for i in range(4)]
        decode = Instance(_cost(), kv_tokens=60, reserved_tokens=reserved, preemption="recompute_local")
        prefill = [Instance(_fast_link(), budget=64, chunked=False)]
        simulate_disaggregated(prefill, [decode], reqs, first_token_on="decode")  # waits count to TTFT
        tpot[reserved] = max(r.tpot for r in reqs)
    assert tpot[None] == pytest.approx(1.0)  # every step a plain decode step
    assert tpot[0] > 1.5


def test_the_page_cache_finds_a_shared_head_leaves_the_last_token_and_evicts_least_recently_used():
    from experiments.sim.instance import PageCache

    cache = PageCache(capacity=4)
    a = SimRequest(0, 0.0, prompt=40, output=1, shared=32)  # pages 0, 1 shared; page 2 its own
    b = SimRequest(1, 0.0, prompt=48, output=1, shared=32)
    cache.add(a, 40, page=16)
    assert cache.peek(b, 48, 16) == [("shared", 0), ("shared", 1)]  # a's page 2 is not b's
    assert cache.lookup(a, 48, 16) == 2  # 47 tokens fill two pages (a's third was named at 40 tokens)
    assert cache.lookup(a, 32, 16) == 1  # at most what leaves the last token to compute
    assert (cache.queries, cache.hits) == (80, 48)
    cache.add(b, 48, 16)  # b's page 2: 4 pages cached
    cache.lookup(a, 32, 16)  # shared 0 used last
    cache.add(SimRequest(2, 0.0, prompt=16, output=1), 16, 16)  # a fifth page: the LRU one goes
    assert ("request", 0) not in cache.pages and ("shared", 0) in cache.pages and len(cache.pages) == 4


def test_a_colocated_instance_computes_only_what_its_cache_lacks():
    first = SimRequest(0, 0.0, prompt=40, output=2, shared=32)
    second = SimRequest(1, 10.0, prompt=40, output=2, shared=32)
    simulate_colocated([Instance(_cost()).enable_cache(100)], [first, second])
    assert first.cached == 0 and first.ttft == pytest.approx(1 + 4.0)  # 40 prefill tokens
    assert second.cached == 32 and second.ttft == pytest.approx(1 + 0.8)  # 8 of them
    off = SimRequest(1, 10.0, prompt=40, output=2, shared=32)
    simulate_colocated([Instance(_cost())], [SimRequest(0, 0.0, prompt=40, output=2, shared=32), off])
    assert off.cached == 0 and off.ttft == pytest.approx(5.0)


def test_a_closed_loop_sends_each_follow_up_after_its_reply_and_holds_arrivals_past_the_concurrency():
    reqs = [SimRequest(i, 0.0, prompt=10, output=2) for i in range(2)]

    def follow(r):
        return SimRequest(r.rid + 10, r.done + 0.5, 10, 2) if r.rid < 10 else None

    simulate_colocated([Instance(_cost())], reqs, follow=follow, concurrency=1)
    assert len(reqs) == 4 and all(r.done is not None for r in reqs)
    a, b, a2, b2 = sorted(reqs, key=lambda r: r.first_token)  # one in flight at a time
    assert a.rid == 0 and b.rid == 1 and b.first_token > a.done  # b waited for a's slot
    assert {a2.rid, b2.rid} == {10, 11}
    assert min(a2.first_token, b2.first_token) > b.done


def test_the_policy_s_admission_refuses_what_would_be_late_in_the_simulator_too():
    """The real router's admission over a simulated colocated instance (2 s per 10-token prefill, a
    request every 0.5 s: 4x what it can serve): it measures the speed from the instance's counters as it
    would from Loads, refuses at once what the queue would make later than a 6 s TTFT, and the requests it
    takes meet it; without admission the queue grows and almost none do."""
    from serving.router.policy import Router

    def run(admission):
        reqs = [SimRequest(i, 0.5 * i, prompt=10, output=2) for i in range(60)]
        policy = Router([0], "least_loaded", cache_pages=0, admission=admission, slo=(6.0, 10.0))
        simulate_colocated([Instance(_cost())], reqs, policy=policy)
        return reqs

    taken = run("none")
    assert all(r.done is not None for r in taken) and sum(r.ttft <= 6.0 for r in taken) < 10
    reqs = run("slo")
    refused = [r for r in reqs if r.rejected]
    served = [r for r in reqs if not r.rejected]
    assert 30 < len(refused) < 55 and all(r.done is None and "predicted TTFT" in r.rejected for r in refused)
    assert all(r.done is not None for r in served)
    assert sum(r.ttft <= 6.0 for r in served) >= 0.9 * len(served)
    assert sum(r.ttft <= 6.0 for r in served) > 2 * sum(r.ttft <= 6.0 for r in taken)


# -- elastic roles: the real Planner on the simulated clock


FAST_LINKS = Hardware("toy", flops=1e3, hbm_bw=1e2, hbm_bytes=1e9, nvlink_bw=1e9, nic_bw=1e9)


def _elastic(n_prefill: int, n_decode: int):
    """Instances whose KV moves in no time (the toy's slow links would hide what the switches do)."""
    settings = {"prefill": {"chunked": False}, "decode": {"chunked": True}}

    def cost():
        return Steps(TOY, FAST_LINKS, eff=Efficiency(comm=1))

    prefill = [Instance(cost(), chunked=False, role_settings=settings) for _ in range(n_prefill)]
    decode = [Instance(cost(), role_settings=settings) for _ in range(n_decode)]
    return prefill, decode


@pytest.mark.parametrize("router", ["decode", "prefill"])
def test_scripted_switches_hand_requests_back_and_every_one_finishes(router):
    """decode-0 turns prefill at t=5 while it decodes (its requests are fetched again, prompt and outputs
    so far, for decode-1), then prefill-0 turns decode at t=20 once its prompts are done: every request
    gets all its tokens, each move is recorded with its time, and no instance holds KV after."""
    from serving.router.planner import PlannerConfig

    prefill, decode = _elastic(1, 2)
    reqs = [SimRequest(i, 0.5 * i, prompt=10, output=12) for i in range(12)]
    moves = []
    planner = PlannerConfig(switches=[[5, "decode-0", "prefill"], [20, "prefill-0", "decode"]])
    simulate_disaggregated(
        prefill, decode, reqs, layerwise=False, router=router, planner=planner, switch_s=0.5, moves=moves
    )
    assert all(r.done is not None and r.generated == 12 for r in reqs)
    assert [(m["worker"], m["from"], m["to"]) for m in moves] == [
        ("decode-0", "decode", "prefill"),
        ("prefill-0", "prefill", "decode"),
    ]
    assert moves[0]["at"] == pytest.approx(5.0, abs=1e-9) and moves[0]["seconds"] >= 0.5
    assert decode[0].handed_back > 0  # it left mid-decode: they were fetched again with their outputs
    assert all(i.kv_used == 0 and not i.running and not i.waiting for i in prefill + decode)


def test_the_planner_moves_a_decode_instance_to_prefill_when_prompts_queue_and_ttft_drops():
    """Prefill-heavy load on 1 prefill + 3 decode instances: TTFT far over its SLO while decode has
    room. With the planner on, decode instances move to prefill (never the last one) and TTFT p90
    falls below the fixed deployment's."""
    from serving.router.planner import PlannerConfig, percentile

    def run(enabled):
        prefill, decode = _elastic(1, 3)
        reqs = [SimRequest(i, 1.0 * i, prompt=20, output=4) for i in range(80)]  # 3 s of prefill a second
        moves = []
        config = PlannerConfig(enabled=enabled, interval_s=5.0, patience=1, window_s=15.0)
        simulate_disaggregated(
            prefill, decode, reqs, layerwise=False, router="decode", planner=config, slo=(10.0, 2.0),
            switch_s=0.5, moves=moves,
        )  # fmt: skip
        assert all(r.done is not None for r in reqs)
        return percentile([r.ttft for r in reqs], 90), moves

    fixed, no_moves = run(False)
    planned, moves = run(True)
    assert not no_moves and moves[0]["to"] == "prefill"
    prefilling = 1 + sum(1 if m["to"] == "prefill" else -1 for m in moves[:3])
    assert prefilling <= 3  # min_decode: one decode instance always stays
    assert planned < 0.5 * fixed, (planned, fixed, moves)


def test_chunk_size_slo_keeps_tpot_at_the_target_in_the_simulator_as_in_the_engine():
    """The engine's SloBudget (engine/budget.py) sizing a simulated instance's steps from the step times
    it observes: 400-token prompts every 6 s into 1 s decode steps (plus 10 ms a prompt token). Whole
    prompts land in the decodes' steps without it: a 5 s step. With a target each request's TPOT stays
    within it once the fit has its steps (the first three requests start before it), and the prompts wait
    for the requests' slack instead, the less the more slack the target leaves."""
    from engine.budget import SloBudget

    steps = fixed_steps(1.0, 0.01)

    def run(target):
        reqs = [SimRequest(i, 6.0 * i, prompt=400, output=20) for i in range(16)]
        budget = SloBudget(target, 512) if target else None
        simulate_colocated(
            [Instance(steps(TOY, HW, eff=Efficiency(comm=1)), budget=512, step_budget=budget)], reqs
        )
        return reqs

    fixed, tight, slo = run(None), run(1.1), run(1.5)
    assert max(r.tpot for r in fixed) > 2.5  # a 5 s step in the middle of 1 s ones
    for target, reqs in ((1.1, tight), (1.5, slo)):
        assert all(r.tpot <= target + 1e-9 for r in reqs[3:])
        assert max(r.tpot for r in reqs) < max(r.tpot for r in fixed)
    assert sorted(r.ttft for r in tight)[8] > 2 * sorted(r.ttft for r in fixed)[8]  # prompts pay for it
    assert sorted(r.ttft for r in slo)[8] < sorted(r.ttft for r in tight)[8]  # less with more slack


def test_prefill_by_load_sends_what_the_prefill_queue_would_make_late_to_the_decode_instance():
    """deployment.local_prefill_by_load in the simulator: the real router's choice (Router._by_load) over
    a prefill instance that serves a 10-token prompt in 2 s while one arrives every second; the decode
    instance prefills those the queue would make later than 4 s, and the TTFT tail shrinks."""
    from serving.router.policy import Router

    def run(by_load):
        reqs = [SimRequest(i, 1.0 * i, prompt=10, output=4) for i in range(30)]
        policy = Router(["decode-0"], "least_loaded", cache_pages=0, slo=(4.0, 10.0), by_load=by_load)
        simulate_disaggregated(
            [Instance(_cost())], [Instance(_cost())], reqs, layerwise=False, router="decode", policy=policy
        )
        return reqs, policy

    sent, off = run(False)
    split, on = run(True)
    assert all(r.done is not None for r in sent + split)
    assert not any(r.local for r in sent) and off.local_by_load == 0
    assert sum(r.local for r in split) == on.local_by_load > 5
    assert sorted(r.ttft for r in split)[27] < sorted(r.ttft for r in sent)[27] / 2


def test_a_decode_instance_s_own_prefills_keep_to_its_step_budget():
    """A decode instance that prefills prompts itself (local_prefill_max_tokens here; by load alike)
    sizes their chunks with its SloBudget as the engine's scheduler does: 400-token prompts every 6 s
    beside 1 s decode steps (plus 10 ms a prompt token). Without a budget a whole prompt lands in one 5 s
    step (its 2,048-token budget takes it); with a 1.5 s target the decodes keep to it, and every prompt
    is still computed there."""
    from engine.budget import SloBudget

    steps = fixed_steps(1.0, 0.01)

    def run(target):
        reqs = [SimRequest(i, 6.0 * i, prompt=400, output=20) for i in range(16)]
        decode = Instance(steps(TOY, HW, eff=Efficiency(comm=1)), local_prefill_max_tokens=1000)
        decode.step_budget = SloBudget(target, 2048) if target else None
        prefill = Instance(steps(TOY, HW, eff=Efficiency(comm=1)))
        simulate_disaggregated(
            [prefill], [decode], reqs, layerwise=False, router="decode", first_token_on="decode"
        )
        return reqs

    fixed, slo = run(None), run(1.5)
    assert all(r.local and r.done is not None for r in fixed + slo)
    assert max(r.tpot for r in fixed) > 2.5  # a 5 s step among 1 s ones
    assert all(r.tpot <= 1.5 + 1e-9 for r in slo[3:])  # once the fit has its steps


def test_a_scaled_traces_blocks_name_its_pages():
    """A Mooncake trace scaled by 1/16 names 32 tokens an id: two pages of 16 each, equal ids equal names."""
    from experiments.sim.instance import SimRequest

    r = SimRequest(0, 0.0, prompt=70, output=1, blocks=(7, 9), block=32)
    assert r.names(70, 16) == [("block", 7, 0), ("block", 7, 1), ("block", 9, 0), ("block", 9, 1)]
    other = SimRequest(1, 0.0, prompt=40, output=1, blocks=(7, 5), block=32)
    assert other.names(32, 16) == r.names(32, 16)
