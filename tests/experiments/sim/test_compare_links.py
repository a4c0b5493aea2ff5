"""The simulator's link model against 1P1D runs over shaped links (SmolLM2, 1,536-token prompts one at a
time, launcher=netns; the runs' slim records in fixtures/): calibrated on 100 Mbit/s, where the link is
twice the prefill, it predicts 200 Mbit/s and 1 Gbit/s (the link hidden behind the compute) within 15%."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from experiments.sim import compare_links
from experiments.sim.calibrate import calibrate_from_run
from experiments.sim.compare_real import compare
from experiments.sim.hardware import load_hardware

FIXTURES = Path(__file__).parent / "fixtures"


def _run(rate: str) -> dict:
    return json.loads((FIXTURES / f"links-{rate}.json").read_text())


def test_a_saved_run_keeps_its_link():
    assert compare_links.link_rate(_run("200mbit")) == "200mbit"


AMX = "cpu-xeon-amx"  # the machine that recorded the runs
RUNS = [str(FIXTURES / f"links-{r}.json") for r in ("100mbit", "200mbit", "1gbit")]


def test_calibrated_on_one_link_rate_the_others_ttft_is_within_15_percent(capsys):
    assert compare_links.main([*RUNS, "--hardware", "cpu-epyc-zen4"]) == 0
    out = capsys.readouterr().out
    assert "calibrated on 100mbit" in out and "held-out TTFT: worst |error|" in out
    # one request at a time: the decode worker's steps are decode-only and leave the linear factor
    # unidentified (anywhere from the grid's bound up; the prefill worker's slowdown carries the prefill's
    # cost), so the fit may sit on its bound: kept (--allow-bound), and only the predictions are held
    hw = load_hardware(AMX)
    cal = calibrate_from_run(_run("100mbit"), hw, allow_bound=True)
    eff, slowdown = cal["efficiency"], cal["prefill_slowdown"]
    comm = compare_links.fit_comm(_run("100mbit"), hw, eff, slowdown)
    assert 0.5 < comm <= 1.0  # UCX over TCP reaches most of the rate
    eff = replace(eff, comm=comm)
    (fitted,) = [r for r in compare(_run("100mbit"), hw, eff, slowdown) if r.metric == "TTFT p50"]
    assert fitted.error == pytest.approx(0, abs=0.01)
    for rate in ("200mbit", "1gbit"):
        ttft = [r for r in compare(_run(rate), hw, eff, slowdown) if r.metric.startswith("TTFT")]
        assert len(ttft) == 2 and all(abs(r.error) < 0.15 for r in ttft), (rate, ttft)


def test_a_run_without_shaped_links_is_refused():
    saved = _run("1gbit")
    saved = {**saved, "config": {**saved["config"], "launcher": {"name": "local"}}}
    with pytest.raises(ValueError, match="launcher=netns"):
        compare_links.link_rate(saved)
