import pytest

from experiments.repro import mooncake


def test_the_long_context_gain_needs_a_per_token_slo():
    """16k-token prompts, 100 requests: on mean TPOT the 4 mixed instances keep up with 3P1D; held to a
    1 s longest token gap, their prefill stalls leave them a ninth of its rate."""
    assert mooncake.long_context_gain("llama-3-70b", "a100-80gb", 16384, 100) == pytest.approx(
        (1.8125, 1.8125)
    )
    stalled = mooncake.long_context_gain("llama-3-70b", "a100-80gb", 16384, 100, stall_s=1.0)
    assert stalled == pytest.approx((1.8125, 0.1953), rel=0.02)


# make test-all: a rate sweep of three deployments over the trace (45 s); make test keeps one replay
# either side of the SLO and the early rejection
@pytest.mark.slow
def test_the_trace_replays_against_colocated_pd_and_the_pool():
    """The trace's first 150 requests: the highest rate factor each deployment meets the SLO at, and
    the pool finds at least what the prefill instances' own caches do."""
    table = mooncake.trace_table("llama-3-70b", 150)
    factors = {name: row["factor"] for name, row in table.items()}
    assert factors == pytest.approx({"colocated": 2.123, "PD": 2.011, "PD + pool": 2.011}, rel=0.02)
    assert table["PD + pool"]["hit_rate"] >= table["PD"]["hit_rate"] > 0
    assert mooncake.trace_claim(150).ours == pytest.approx(0.947, rel=0.02)


def test_the_trace_at_its_own_rate_meets_the_slo_and_a_much_faster_one_does_not():
    d, pool = mooncake.deployments(4)["PD + pool"]
    assert mooncake.replay("llama-3-70b", d, pool, 100, 1.0)["attainment"] >= mooncake.TARGET
    assert mooncake.replay("llama-3-70b", d, pool, 100, 8.0)["attainment"] < mooncake.TARGET


def test_early_rejection_turns_some_away_to_keep_the_rest_within_the_slo():
    """At 3x the trace's rate PD misses the SLO for a third of the requests; the router's admission
    (deployment.admission=slo) turns a few away at arrival and the rest meet it."""
    d, pool = mooncake.deployments(4)["PD + pool"]
    flat = mooncake.replay("llama-3-70b", d, pool, 150, 3.0)
    shed = mooncake.replay("llama-3-70b", d, pool, 150, 3.0, admission=True)
    assert flat["rejected"] == 0 and flat["attainment"] < mooncake.TARGET
    assert 0 < shed["rejected"] < 10 and shed["attainment"] >= mooncake.TARGET


def test_the_cluster_table_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        mooncake.main(["--requests", "10"])
    assert "--requests must be >= 100" in capsys.readouterr().err


def test_an_mla_models_decode_node_runs_attention_data_parallel():
    """Under TP8 every GPU of DeepSeek-R1's decode node holds every sequence's latent KV: at 3x the trace's
    rate it ran out and its TPOT P90 reached 1.2 s; DP8 (as SGLang and vLLM serve it) holds 8x."""
    r1, _ = mooncake.deployments(4, "deepseek-r1")["PD"]
    dense, _ = mooncake.deployments(4, "llama-3-70b")["PD"]
    assert (r1.decode_tp, r1.decode_dp, r1.prefill_tp) == (1, 8, 8)
    assert (dense.decode_tp, dense.decode_dp) == (8, 1)
