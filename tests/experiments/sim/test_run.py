"""The simulator's hydra entry writes the real runs' results.json schema."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments.sim.run import run_sim

CONF = str(Path(__file__).resolve().parents[3] / "conf")


def _cfg(overrides):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose("sim", overrides=overrides)


def test_simulated_runs_write_the_same_results_schema_as_real_ones(tmp_path):
    overrides = ["sim_model=llama-3-8b", "hardware=h100", "workload.num_requests=300", "workload.rate=4"]
    overrides += ["plots=false", "goodput_search.rates=[2,8]"]
    overrides += [
        "deployments=[{name: colocated, kind: colocated, num_workers: 2},"
        "{name: 1p1d, kind: disaggregated, num_prefill: 1, num_decode: 1}]"
    ]
    records = run_sim(_cfg(overrides), tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["schema"] == "pdkernels.results/1" and len(saved["runs"]) == 4
    run = saved["runs"][0]
    assert set(run) >= {"deployment", "rate", "summary", "requests", "events"}
    assert set(run["summary"]) >= {"ttft_s", "tpot_s", "itl_s", "e2e_s", "attainment_pct", "goodput_rps"}
    assert all(r["summary"]["completed"] == 300 for r in records)
    one = run["requests"][0]
    assert one["prompt_tokens"] == 128 and one["output_tokens"] == 32 and one["ttft_s"] > 0
    disagg = [r for r in records if r["deployment"] == "1p1d"]
    assert all(
        r["summary"]["transfer_bytes"] == 300 * 128 * 131072 for r in disagg
    )  # Llama-3-8B: 128 KiB/token


def test_a_small_decode_cache_thrashes_without_room_to_finish(tmp_path):
    """The decode worker's collapse under memory pressure, predicted: reserving only each prompt's KV
    (decode_reserved_tokens=0) preempts and recomputes on the decode instance, and TPOT's tail grows."""
    overrides = ["sim_model=llama-3-8b", "hardware=h100", "workload.num_requests=200", "workload.rate=8"]
    overrides += ["plots=false", "decode_kv_tokens=4000", "first_token_on=decode"]
    overrides += ["workload.prompt_len.value=512", "workload.output_len.value=256"]
    common = "kind: disaggregated, num_prefill: 1, num_decode: 1"
    overrides += [
        f"deployments=[{{name: room, {common}}},"
        f"{{name: old, {common}, decode_reserved_tokens: 0, decode_preemption: recompute_local}}]"
    ]
    room, old = run_sim(_cfg(overrides), tmp_path)
    assert room["summary"]["completed"] == old["summary"]["completed"] == 200
    assert room["summary"]["preemptions"]["decode-0"] == 0
    assert old["summary"]["preemptions"]["decode-0"] > 0
    assert old["summary"]["recomputed_prompt_tokens"]["decode-0"] > 0
    assert old["summary"]["tpot_s"]["p99"] > 1.5 * room["summary"]["tpot_s"]["p99"]


def test_the_simulator_refuses_what_it_cannot_model(tmp_path):
    with pytest.raises(ValueError, match="arrival='concurrency' is not simulated for workload.dataset="):
        run_sim(_cfg(["workload.arrival=concurrency"]), tmp_path)
    with pytest.raises(ValueError, match="cache_pages=-1 is not allowed: null or an integer >= 0"):
        run_sim(_cfg(["cache_pages=-1"]), tmp_path)
    with pytest.raises(ValueError, match="page_size=0 is not allowed: an integer >= 1"):
        run_sim(_cfg(["page_size=0"]), tmp_path)
    with pytest.raises(ValueError, match="sim model must be one of"):
        run_sim(_cfg(["sim_model=gpt-5"]), tmp_path)
    with pytest.raises(ValueError, match=r"router='random' is not allowed: one of \('prefill', 'decode'\)"):
        run_sim(_cfg(["router=random"]), tmp_path)
    with pytest.raises(ValueError, match=r"cost='vidur' is not allowed: one of \('roofline', 'operators'\)"):
        run_sim(_cfg(["cost=vidur"]), tmp_path)
    with pytest.raises(ValueError, match="sim.cost=operators knows the GPUs"):
        run_sim(_cfg(["cost=operators", "hardware=h200", "plots=false"]), tmp_path)
    with pytest.raises(ValueError, match="prefill_slowdown=0.5 is not allowed"):
        run_sim(_cfg(["prefill_slowdown=0.5"]), tmp_path)
    with pytest.raises(ValueError, match="num_workers=auto is chosen by the main job"):
        run_sim(_cfg(["deployment=colocated", "deployment.num_workers=auto"]), tmp_path)


def test_compare_real_against_a_simulated_run_of_the_same_config_shows_no_error(tmp_path, capsys):
    """The comparison's plumbing: simulate with the measured-CPU preset, then compare that run folder
    with the simulator on the same settings: every latency must agree."""
    from experiments.sim import compare_real

    overrides = [
        "sim_model=smollm2-135m",
        "hardware=cpu-epyc-zen4",
        "first_token_on=decode",
        "router=decode",
        "plots=false",
    ]
    overrides += ["efficiency.linear=0.75", "efficiency.attention=0.75", "efficiency.memory=0.2"]
    overrides += [
        "efficiency.step_overhead_s=0.0009",
        "workload.num_requests=30",
        "goodput_search.rates=[0.5,2]",
    ]
    overrides += [
        "deployments=[{name: colocated, kind: colocated, num_workers: 2},"
        "{name: 1p1d, kind: disaggregated, num_prefill: 1, num_decode: 1}]"
    ]
    run_sim(_cfg(overrides), tmp_path)
    capsys.readouterr()
    factors = ["--linear", "0.75", "--memory", "0.2", "--overhead-ms", "0.9"]
    assert compare_real.main([str(tmp_path / "results.json"), "--hardware", "cpu-epyc-zen4", *factors]) == 0
    out = capsys.readouterr().out
    assert "mean |error| 0%, worst 0%" in out and out.count("TTFT p90") == 4


def test_a_mooncake_trace_drives_a_simulated_run(tmp_path):
    """The trace's lengths and timestamps, replayed through the simulator (arrival: trace)."""
    trace = Path(__file__).resolve().parents[2] / "data" / "mooncake_sample.jsonl"
    overrides = ["sim_model=llama-3-8b", "hardware=h100", "workload.num_requests=12", "plots=false"]
    overrides += ["workload.dataset=mooncake", f"workload.dataset_path={trace}", "workload.arrival=trace"]
    overrides += ["deployments=[{name: 1p1d, kind: disaggregated, num_prefill: 1, num_decode: 1}]"]
    (record,) = run_sim(_cfg(overrides), tmp_path)
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["prompt_tokens"] for r in record["requests"]] == [row["input_length"] for row in rows]
    assert [r["output_tokens"] for r in record["requests"]] == [row["output_length"] for row in rows]
    assert record["summary"]["completed"] == 12
    assert record["rate"] is None  # replayed at the trace's own timestamps: no "@1/s" in the table


def test_a_placement_that_cannot_hold_its_weights_or_longest_request_is_refused_naming_the_numbers(tmp_path):
    """Llama-3-70b on one H200 a worker (its weights alone fill it) printed a TTFT p50 of an
    hour and 11 TB of KV moved instead of refusing the placement."""
    overrides = ["sim_model=llama-3-70b", "hardware=h200", "workload.num_requests=20", "plots=false"]
    refused = (
        r"a prefill instance of llama-3-70b at tp=1, dp=1 on h200 holds 141\.1 GB of weights a rank of its "
        r"141\.0 GB, leaving KV for 0 tokens; the workload's longest request needs 128: raise "
        r"deployment\.prefill_tp"
    )
    with pytest.raises(ValueError, match=refused):
        run_sim(_cfg(overrides), tmp_path)
    fits = ["deployment.prefill_tp=2", "deployment.decode_tp=2"]
    assert run_sim(_cfg(overrides + fits), tmp_path)[0]["summary"]["completed"] == 20
    with pytest.raises(
        ValueError,
        match="KV for 386,980 tokens; .* longest request needs 400,128: raise deployment.decode_tp",
    ):
        run_sim(_cfg(overrides + fits + ["workload.output_len.value=400000"]), tmp_path)


def test_simulated_speculation_gives_the_expected_tokens_per_verify_step_and_its_cost(tmp_path):
    """k = 2 drafts accepted with probability 0.8 each: 1 + 0.8 + 0.64 = 2.44 tokens per verify step;
    decode steps cost more (k + 1 tokens each) but TPOT falls; with acceptance 0 it only costs."""
    base = ["sim_model=llama-3-8b", "hardware=h100", "workload.num_requests=200", "workload.rate=2"]
    base += ["plots=false"]

    def run(spec, acceptance):
        extra = f", speculative: {{method: ngram, num_speculative_tokens: {spec}}}" if spec else ""
        d = f"deployments=[{{name: d, kind: disaggregated, num_prefill: 1, num_decode: 1{extra}}}]"
        (rec,) = run_sim(_cfg([*base, d, f"spec_acceptance={acceptance}"]), tmp_path)
        return rec["summary"]

    plain, spec, useless = run(0, 0.8), run(2, 0.8), run(2, 0.0)
    assert plain["spec_acceptance_rate"] is None
    assert abs(spec["spec_acceptance_rate"] - (0.8 + 0.64) / 2) < 0.03
    assert abs(spec["spec_mean_accepted_length"] - 2.44) < 0.05
    assert spec["tpot_s"]["p50"] < 0.6 * plain["tpot_s"]["p50"]
    assert useless["tpot_s"]["p50"] > plain["tpot_s"]["p50"]  # every draft rejected: verify costs only


MULTITURN = ["workload=multiturn", "workload.conversations=4", "workload.turns=4", "workload.concurrency=4"]
MULTITURN += ["workload.system_prompt_len=200", "workload.turn_len=100", "workload.output_len.value=40"]


def _multiturn_sim(tmp_path, extra=(), cached=""):
    overrides = ["sim_model=smollm2-135m", "hardware=cpu-epyc-zen4", "first_token_on=decode"]
    overrides += ["router=decode", "plots=false", "efficiency.memory=0.2", *MULTITURN, *extra]
    overrides += [
        f"deployments=[{{name: cached, kind: disaggregated, num_prefill: 1, num_decode: 1{cached}}},"
        "{name: nocache, kind: disaggregated, num_prefill: 1, num_decode: 1, prefix_caching: false},"
        "{name: colocated, kind: colocated, num_workers: 1}]"
    ]
    return {r["deployment"]: r for r in run_sim(_cfg(overrides), tmp_path)}


def test_a_multiturn_workload_runs_closed_loop_and_the_cache_predicts_what_is_not_sent(tmp_path):
    runs = _multiturn_sim(tmp_path)
    cached, nocache, colocated = runs["cached"], runs["nocache"], runs["colocated"]
    for run in runs.values():  # 4 conversations x 4 turns, each turn sent 1 s after the reply it extends
        assert run["summary"]["completed"] == 16 and run["summary"]["errors"] == 0
        by_conv = {}
        for r in sorted(run["requests"], key=lambda r: r["turn"]):
            if r["turn"]:
                prev = by_conv[r["conversation"]]
                assert r["arrival_s"] >= prev["arrival_s"] + prev["e2e_s"] + 1.0 - 1e-9
                assert r["prompt_tokens"] == prev["prompt_tokens"] + 40 + 100
            by_conv[r["conversation"]] = r
    page, message = 16, 100
    for r in cached["requests"]:  # the decode instance holds the previous turn's prompt and reply
        if r["turn"]:
            held = (r["prompt_tokens"] - message - 1) // page * page  # the last reply token has no KV
            assert r["cached_tokens"] == held
            assert r["transfer_bytes"] == (r["prompt_tokens"] - held) * 46080 // 2  # bf16 preset
    assert all(r["cached_tokens"] == 0 for r in nocache["requests"])
    assert nocache["summary"]["prefix_hit_rate"] == 0 and cached["summary"]["prefix_hit_rate"] > 0.6
    assert cached["summary"]["transfer_bytes"] < 0.35 * nocache["summary"]["transfer_bytes"]
    assert cached["summary"]["ttft_s"]["p50"] < nocache["summary"]["ttft_s"]["p50"]
    assert colocated["summary"]["prefix_hit_rate"] > 0.6 and colocated["summary"]["transfer_bytes"] == 0
    hits = cached["summary"]["prefix_hits"]
    assert hits["decode-0"] > 0 and hits["prefill-0"] > 0
    turns = cached["summary"]["by_turn"]
    assert [t["turn"] for t in turns] == [0, 1, 2, 3] and turns[3]["cached_tokens_mean"] > 400


def test_a_decode_instance_prefills_a_short_missing_rest_itself(tmp_path):
    runs = _multiturn_sim(tmp_path, cached=", local_prefill_max_tokens: 200")
    later = [r for r in runs["cached"]["requests"] if r["turn"]]
    assert later and all(r["prefill"] == "local" and r["transfer_bytes"] == 0 for r in later)
    assert all(r["prefill"] == "remote" for r in runs["cached"]["requests"] if not r["turn"])


def test_compare_real_on_a_multiturn_run_compares_hits_and_kv_sent(tmp_path, capsys):
    from experiments.sim import compare_real

    _multiturn_sim(tmp_path, ["efficiency.linear=0.75", "efficiency.attention=0.75"])
    capsys.readouterr()
    assert (
        compare_real.main(
            [
                str(tmp_path / "results.json"),
                "--hardware",
                "cpu-epyc-zen4",
                "--linear",
                "0.75",
                "--memory",
                "0.2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "mean |error| 0%, worst 0%" in out and out.count("TTFT turn 4") == 3
    hits = [line for line in out.splitlines() if "prefix hit" in line]
    assert len(hits) == 2 and all(line.endswith(" 0%") for line in hits)
    assert out.count("KV sent tokens") == 2


def test_a_synthetic_mooncake_trace_s_reuse_shows_as_prefix_cache_hits_in_the_simulator(tmp_path):
    """Pages named by the trace's hash ids: a colocated instance finds cached the blocks an earlier
    request brought (about the trace's reuse), and none without that naming's reuse."""
    from experiments.workload import main

    hits = {}
    for reuse in (0.0, 0.5):
        trace = tmp_path / f"trace-{reuse}.jsonl"
        main(["mooncake", str(trace), "--requests", "120", "--reuse", str(reuse), "--rate", "2"])
        overrides = ["sim_model=llama-3-8b", "hardware=h100", "workload.num_requests=120", "plots=false"]
        overrides += ["workload.dataset=mooncake", f"workload.dataset_path={trace}", "workload.arrival=trace"]
        overrides += ["deployments=[{name: c, kind: colocated, num_workers: 1}]"]
        (record,) = run_sim(_cfg(overrides), tmp_path / str(reuse))
        s = record["summary"]
        hits[reuse] = sum(r["cached_tokens"] for r in record["requests"]) / sum(
            r["prompt_tokens"] for r in record["requests"]
        )
        assert s["completed"] == 120
    assert hits[0.0] == 0.0 and 0.2 < hits[0.5] < 0.6, hits


def test_sim_pages_take_their_names_from_the_trace_s_blocks():
    from experiments.sim.instance import SimRequest

    a = SimRequest(0, 0.0, prompt=1100, output=4, blocks=(7, 8, 9))
    b = SimRequest(1, 0.0, prompt=700, output=4, blocks=(7, 5))
    na, nb = a.names(1100, 16), b.names(700, 16)
    assert na[:32] == nb[:32] and na[32] != nb[32]  # block 7 shared, then they part
    # past the prompt (a refetch's outputs), its own names
    assert a.names(1200, 16)[68] == (("request", 0), 68) and a.names(1200, 16)[67] == ("block", 9, 3)


def test_a_deployment_s_dp_degrees_reach_the_simulated_instances(tmp_path):
    """deployment.decode_dp (and dp, prefill_dp) are the simulated instances' DP groups, as the real
    workers': DeepSeek-R1's decode instance at TP 8 x DP 2 (16 ranks, each group its own sequences and
    latent, the experts over all 16) steps faster than at TP 8 alone under the same load."""
    overrides = ["sim_model=deepseek-r1", "hardware=h200", "workload.num_requests=200", "workload.rate=20"]
    overrides += ["plots=false", "workload.prompt_len.value=1024", "workload.output_len.value=256"]
    common = "kind: disaggregated, num_prefill: 1, num_decode: 1, prefill_tp: 8, decode_tp: 8"
    overrides += [f"deployments=[{{name: tp8, {common}}},{{name: dp2, {common}, decode_dp: 2}}]"]
    tp8, dp2 = run_sim(_cfg(overrides), tmp_path)
    assert tp8["summary"]["completed"] == dp2["summary"]["completed"] == 200
    assert dp2["summary"]["tpot_s"]["p50"] < tp8["summary"]["tpot_s"]["p50"]


def test_the_operator_model_runs_the_same_simulation(tmp_path):
    """sim.cost=operators: the same deployments and workload over steps priced operator by operator (the
    fitted A100 parameters, H100 from its datasheet): every request completes, and its steps differ from
    the roofline's."""
    overrides = ["sim_model=llama-3-8b", "hardware=h100", "workload.num_requests=100", "workload.rate=4"]
    overrides += [
        "plots=false",
        "deployments=[{name: 1p1d, kind: disaggregated, num_prefill: 1, num_decode: 1}]",
    ]
    (ops,) = run_sim(_cfg([*overrides, "cost=operators"]), tmp_path / "ops")
    (roof,) = run_sim(_cfg(overrides), tmp_path / "roof")
    assert ops["summary"]["completed"] == roof["summary"]["completed"] == 100
    assert ops["summary"]["tpot_s"]["p50"] != roof["summary"]["tpot_s"]["p50"]
