"""The simulator against a recorded real run it did not see: 30 Poisson arrivals of
1,024-token prompts and 32 outputs at 0.5, 1.0 and 1.5 req/s, colocated (2 workers) and 1P1D, SmolLM2
bf16 on 2 cores of an AMD EPYC with AVX-512 BF16 (experiments.run, alone on the
machine; slimmed by `compare_real --save-slim`). Calibrated on the 0.5 req/s records, it predicts
the overload at 1.0 and 1.5 req/s, where every queue grows (1P1D's TTFT p90: 7.2 s at 0.5 req/s, 22.0
and 32.1 s at 1.0 and 1.5)."""

import json
import re
from pathlib import Path

import pytest

from experiments.sim import compare_real
from experiments.sim.calibrate import calibrate_from_run
from experiments.sim.hardware import load_hardware

RECORDED = Path(__file__).parent / "fixtures" / "overload.json"
EPYC = ["--hardware", "cpu-epyc-zen4"]  # the machine that recorded it


def _held_out(saved: dict) -> list[compare_real.Row]:
    hw = load_hardware("cpu-epyc-zen4")
    cal = calibrate_from_run(compare_real.with_rates(saved, lambda rate: rate == 0.5), hw)
    held = compare_real.with_rates(saved, lambda rate: rate != 0.5)
    return compare_real.compare(held, hw, cal["efficiency"], cal["prefill_slowdown"])


def test_overload_it_never_saw_is_predicted_within_15_percent():
    rows = _held_out(json.loads(RECORDED.read_text()))
    runs = {r.run for r in rows}
    assert runs == {"colocated @1/s", "colocated @1.5/s", "1p1d @1/s", "1p1d @1.5/s"}
    errors = compare_real.latency_errors(rows)
    assert len(errors) == 16  # TTFT and TPOT, p50 and p90, of each
    assert sum(errors) / len(errors) <= 0.15, rows
    assert max(errors) <= 0.30, rows


def test_the_replay_is_the_recording_machine_s_whatever_cpu_replays_it(monkeypatch):
    """chunk_size auto means the budget of the machine simulated (the preset's bf16), not of the CPU the
    simulator runs on: replayed on an AVX2-only EPYC, the recording's 2,048-token steps became 512 and the
    held-out error 16%."""
    from pdkernels import cpuinfo

    saved = json.loads(RECORDED.read_text())
    rows = {}
    for native in (True, False):
        monkeypatch.setattr(cpuinfo, "native_bf16", lambda native=native: native)
        rows[native] = _held_out(saved)
    assert rows[True] == rows[False]


def test_a_slimmed_run_compares_as_the_whole_one(tmp_path, capsys):
    saved = json.loads(RECORDED.read_text())
    again = compare_real.slim(saved, 0.5)
    assert again == saved  # the fixture is its own slim form: nothing it needs was dropped
    # a newer run's steps carry their prompt chunks, which the slim form keeps
    steps = saved["runs"][0]["timelines"][0]["steps"]
    chunked = {**saved, "runs": [{**saved["runs"][0], "timelines": [{"name": "w", "role": "colocated",
               "steps": [[*s[:4], 0, [[s[2], 0]] if s[2] else []] for s in steps]}]}]}  # fmt: skip
    kept = compare_real.slim(chunked, 0.5)["runs"][0]["timelines"][0]["steps"]
    assert kept == chunked["runs"][0]["timelines"][0]["steps"]
    path = tmp_path / "results.json"
    path.write_text(json.dumps(saved))
    out = tmp_path / "slim.json"
    assert compare_real.main([str(path), *EPYC, "--calibrate-rate", "0.5", "--save-slim", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "at 0.5 req/s" in printed and "@0.5/s" not in printed  # calibrated on it, not compared
    assert json.loads(out.read_text()) == saved
    assert "latencies: mean |error|" in printed


@pytest.mark.parametrize(
    "args, message",
    [
        (["--calibrate-rate", "2.0"], "--calibrate-rate must be one of this run's rates"),
        (["--calibrate-rate", "0.5", "--calibrate-from", "x.json"], "not both"),
        (["--save-slim", "out.json"], "--save-slim needs --calibrate-rate"),
    ],
)
def test_a_calibration_the_options_cannot_give_is_refused_by_name(tmp_path, capsys, args, message):
    path = tmp_path / "results.json"
    path.write_text(RECORDED.read_text())
    with pytest.raises(SystemExit):
        compare_real.main([str(path), *EPYC, *args])
    assert message in capsys.readouterr().err


def test_on_an_amx_xeon_the_machine_model_measured_there_predicts_its_overload_within_15_percent(capsys):
    """The same protocol on the other CPU family (run on 2 cores of a Xeon with AMX,
    slimmed to what the check reads), against that machine's measured figures; against the EPYC's
    (6.5x less GEMM peak a core) the fit would pin at its grid's top, and is refused instead."""
    amx = Path(__file__).parent / "fixtures" / "overload-amx.json"
    assert compare_real.main([str(amx), "--hardware", "cpu-xeon-amx", "--calibrate-rate", "0.5"]) == 0
    out = capsys.readouterr().out
    mean, worst = (float(x) for x in re.search(r"mean \|error\| (\d+)%, worst (\d+)%", out).groups())
    assert mean <= 15 and worst <= 30, out
    assert "linear 0.40" in out  # of the AMX core's 1,352 GFLOP/s
    with pytest.raises(SystemExit):
        compare_real.main([str(amx), *EPYC, "--calibrate-rate", "0.5"])
    assert "linear 1.00 (its upper bound)" in capsys.readouterr().err


def test_a_real_trace_scaled_to_the_engine_is_predicted_from_its_first_slice(tmp_path, capsys):
    """Mooncake's conversation trace scaled to SmolLM2 on 2 cores (lengths and blocks x
    1/16, timestamps x 2), colocated and 1P1D; the simulator, calibrated on its first 40 requests, predicts
    the next 120 (run on the AMX Xeon, alone; docs/results/reproduction.md)."""
    root = Path(__file__).parents[3]
    paths = {}
    for part in ("a", "b"):
        saved = json.loads((Path(__file__).parent / "fixtures" / f"trace-slice-{part}.json").read_text())
        saved["config"]["workload"]["dataset_path"] = str(root / saved["config"]["workload"]["dataset_path"])
        paths[part] = tmp_path / f"{part}.json"
        paths[part].write_text(json.dumps(saved))
    args = [str(paths["b"]), "--calibrate-from", str(paths["a"]), "--hardware", "cpu-xeon-amx"]
    assert compare_real.main(args) == 0
    out = capsys.readouterr().out
    mean, worst = (float(x) for x in re.search(r"mean \|error\| (\d+)%, worst (\d+)%", out).groups())
    assert mean <= 15 and worst <= 25, out
    hits = re.findall(r"prefix hit %\s+(\d+)\s+(\d+)", out)  # the trace's own reuse, found by both
    assert len(hits) == 2 and all(int(m) > 0 and abs(int(m) - int(s)) <= 2 for m, s in hits), out
