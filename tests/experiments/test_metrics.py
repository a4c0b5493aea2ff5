"""experiments.metrics: the printed table's goodput lines."""

from experiments.metrics import SWEEP, label, swept_goodput
from experiments.report import table


def _record(deployment: str, rate, attainment: float, met_per_s: float, meets: bool) -> dict:
    pct = {"p50": 0.1, "p90": 0.2, "p99": 0.3, "mean": 0.1, "n": 10}
    summary = {
        "completed": 10,
        "num_requests": 10,
        **{k: pct for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s", "transfer_s")},
        "transfer_bytes": 0,
        "throughput_rps": 1.0,
        "output_tokens_per_s": 10.0,
        "attainment_pct": attainment,
        "slo_goodput_rps": met_per_s,
        "meets_slo": meets,
        "goodput_rps": None if rate is None else (rate if meets else 0.0),
    }
    return {"deployment": deployment, "rate": rate, "summary": summary}


def _line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(start))


def test_a_run_without_a_rate_sweep_never_shows_a_goodput_of_0_beside_full_attainment():
    """At a fixed concurrency (or one rate) DistServe's goodput is not measured: the table says so, and
    shows vLLM's request goodput (requests meeting the SLO per second), which every run measures."""
    for rate in (None, 2.0):
        records = [_record("colocated", rate, 100.0, 1.5, True), _record("1p1d", rate, 100.0, 1.25, True)]
        text = table(records)
        assert _line(text, "goodput (top rate").count(SWEEP) == 2
        assert "1.50" in _line(text, "request goodput") and "1.25" in _line(text, "request goodput")
        assert swept_goodput(records) == {}
        for line in text.splitlines():
            if "goodput" in line:
                assert "0" not in [cell.strip() for cell in line.split("|")[1:]], line


def test_a_rate_sweep_shows_the_highest_rate_that_met_the_slo():
    records = [
        _record("colocated", 1.0, 100.0, 1.0, True),
        _record("colocated", 2.0, 95.0, 1.9, True),
        _record("colocated", 4.0, 40.0, 1.6, False),
        _record("1p1d", 1.0, 100.0, 1.0, True),  # one rate only: not a sweep
    ]
    assert swept_goodput(records) == {"colocated": 2.0}
    line = _line(table(records), "goodput (top rate")
    assert line.count("2 req/s") == 3 and line.count(SWEEP) == 1


def test_prompts_prefilled_on_a_decode_worker_by_load_get_a_row_only_where_there_are_some():
    records = [_record("1p1d", None, 50.0, 0.5, False), _record("hybrid", None, 60.0, 0.6, False)]
    assert "by load" not in table(records)
    records[1]["summary"]["local_prefills_by_load"] = 12
    line = _line(table(records), "prefilled on decode by load")
    assert [cell.strip() for cell in line.split("|")[1:]] == ["0", "12"]


def test_a_remote_prefill_shows_how_long_its_kv_landed_after_the_prefill_and_after_the_first_post():
    """The decode worker's landing time joined with the prefill worker's Sent by request id; a local
    prefill, and one whose prefill worker's log lacks it, get nothing rather than a made-up time."""
    from experiments.metrics import request_rows
    from experiments.record import DeploymentRun, Request
    from serving.config import DeploymentConfig, SloConfig
    from serving.messages import Result, Timeline

    reqs = [Request(f"r{i}", 0.0, [1, 2, 3], 2) for i in range(3)]
    run = DeploymentRun(DeploymentConfig("1p1d"), reqs, sent={r.request_id: 10.0 for r in reqs}, start=10.0)
    for i, rid in enumerate(("r0", "r1", "r2")):
        res = Result(rid, "decode-0", [5, 6], 10.0, 10.1, [11.0, 11.1], "length", None)
        if i < 2:
            res.prefill, res.kv_landed = "remote", 10.9
        run.results[rid] = res
    run.timelines = [
        Timeline(
            "prefill-0", "prefill", sent=[("r0", 10.1, 10.2, 10.7, 10.85), ("r2", 10.1, 10.3, 10.6, 10.9)]
        )
    ]
    rows = {r["request_id"]: r for r in request_rows(run, SloConfig())}
    assert abs(rows["r0"]["kv_exposed_s"] - 0.2) < 1e-9 and abs(rows["r0"]["kv_span_s"] - 0.7) < 1e-9
    assert abs(rows["r0"]["prefill_compute_s"] - 0.6) < 1e-9
    assert rows["r1"]["kv_exposed_s"] is None and rows["r1"]["kv_span_s"] is None  # not in the log
    assert rows["r2"]["kv_exposed_s"] is None  # prefilled locally: no landing time


# the fields vLLM 0.32's `vllm bench serve --save-result --save-detailed` writes (read off its result JSON)
VLLM_FIELDS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "errors",
}  # fmt: skip
STATS = ("mean", "median", "std", "p50", "p90", "p99")
VLLM_FIELDS |= {f"{s}_{m}_ms" for s in STATS for m in ("ttft", "tpot", "itl", "e2el")}


def test_a_run_is_written_in_the_shape_of_vllm_s_bench_serve_result():
    from types import SimpleNamespace

    from experiments.metrics import vllm_bench

    def row(ttft, times, error=None):
        e2e = None if error else ttft + sum(times)
        return {"prompt_tokens": 10, "output_tokens": len(times) + 1 if error is None else 0, "ttft_s": ttft,
                "tpot_s": sum(times) / len(times) if times else None, "e2e_s": e2e,
                "itl_s": times, "error": error, "meets_slo": error is None}  # fmt: skip

    rows = [row(0.1, [0.02, 0.03]), row(0.3, [0.04]), row(None, [], error="refused")]
    record = {"requests": rows, "summary": {"duration_s": 2.0}, "deployment": "1p1d", "rate": 1.5,
              "concurrency": None}  # fmt: skip
    out = vllm_bench(record, SimpleNamespace(), "smollm2")
    assert VLLM_FIELDS <= set(out)
    assert out["completed"] == 2 and out["failed"] == 1 and out["total_output_tokens"] == 5
    assert out["p50_ttft_ms"] == 200.0 and out["p90_ttft_ms"] == 280.0 and out["median_itl_ms"] == 30.0
    assert (
        out["ttfts"] == [0.1, 0.3, 0.0] and out["itls"][0] == [0.02, 0.03] and out["errors"][2] == "refused"
    )


def test_a_run_s_label_says_how_its_requests_arrived():
    assert label({"deployment": "1p1d", "rate": 2.0, "arrival": "poisson"}) == "1p1d @2/s"
    assert (
        label({"deployment": "1p1d", "rate": None, "arrival": "trace", "trace_scale": 1.0}) == "1p1d @trace"
    )
    assert (
        label({"deployment": "1p1d", "rate": None, "arrival": "trace", "trace_scale": 0.5})
        == "1p1d @trace x0.5"
    )
    assert label({"deployment": "1p1d", "rate": None, "arrival": "concurrency"}) == "1p1d"
    assert label({"deployment": "1p1d", "rate": None}) == "1p1d"  # a results file from before the field
