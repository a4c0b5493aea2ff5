"""experiments.metrics: the printed table's goodput lines."""

from experiments.metrics import SWEEP, swept_goodput
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
    from experiments.deploy.config import DeploymentConfig, SloConfig
    from experiments.deploy.messages import Result, Timeline
    from experiments.metrics import request_rows
    from experiments.record import DeploymentRun, Request

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
