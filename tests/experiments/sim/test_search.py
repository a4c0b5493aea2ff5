import pytest

from experiments.sim.hardware import Hardware
from experiments.sim.search import Placement, placements, search
from tests.experiments.sim.toys import TOY, fixed_steps

HW = Hardware("toy", flops=1e3, hbm_bw=1e2, hbm_bytes=1e9, nvlink_bw=1e9, nic_bw=1e9)
PrefillHeavy = fixed_steps(0.01, 0.001)  # decode steps 10 ms; a 100-token prompt adds 0.1 s


def test_placements_respect_the_budget_and_the_heads():
    ps = placements(4, (1, 2, 3, 4), heads=4)
    assert all(p.gpus <= 4 for p in ps) and not any(3 in (p.prefill_tp, p.decode_tp) for p in ps)
    assert Placement("disaggregated", 2, 1, 1, 2) in ps and Placement("colocated", 2, 0, 2, 2) in ps


def test_placements_with_dp_attention_count_every_gpu():
    ps = placements(4, (1, 2), heads=4, dps=(1, 2))
    assert all(p.gpus <= 4 for p in ps)
    dp = Placement("disaggregated", 1, 1, 1, 1, 1, 2)  # a TP1 prefill instance and a TP1 x DP2 decode one
    assert dp in ps and dp.gpus == 3 and str(dp) == "1P(TP1) 1D(TP1 DP2)"
    assert Placement("colocated", 1, 0, 2, 2, 2, 2) in ps  # one instance, TP2 x DP2
    assert not any(p.prefill_dp > 1 or p.decode_dp > 1 for p in placements(4, (1, 2), heads=4))


def test_the_search_skips_instances_that_cannot_hold_the_weights():
    """TOY has 1,440 one-byte weights; a GPU of 1,000 bytes holds them only split over 2 ranks."""
    small = Hardware("small", flops=1e3, hbm_bw=1e2, hbm_bytes=1000, nvlink_bw=1e9, nic_bw=1e9)
    best = search(lambda tp, dp: PrefillHeavy(TOY, small, tp), gpus=2, tps=(1, 2), prompt=10, output=2, n=20)
    assert [str(p) for _, p in best] == ["1x colocated TP2"]


def test_a_tight_tpot_slo_favours_disaggregation():
    """Colocated decode steps stall behind other requests' 0.1 s prefills (P90 TPOT under 20 ms holds
    only while requests rarely overlap); a decode-only instance always steps in 10 ms, and one prefill
    instance clears 10 prompts a second. The best placement of 2 GPUs must be 1P1D."""
    best = search(
        lambda tp, dp: PrefillHeavy(TOY, HW, tp, dp=dp),
        gpus=2,
        tps=(1,),
        prompt=100,
        output=20,
        ttft=5.0,
        tpot=0.02,
        n=200,
    )
    (top_goodput, top), *rest = best
    assert top == Placement("disaggregated", 1, 1, 1, 1) and top_goodput > 0
    (colocated,) = [g for g, p in best if p.kind == "colocated"]
    assert top_goodput > 2 * colocated


# make test-all: a hydra sweep of joblib processes (13 s); make test keeps the search itself
@pytest.mark.slow
def test_the_search_runs_as_a_hydra_sweep(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    args = [
        "-m",
        "gpus=1,2",
        "tps=[1]",
        "requests=100",
        "sim_model=smollm2-135m",
        f"hydra.sweep.dir={tmp_path}",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "experiments.sim.search", *args], capture_output=True, text=True, cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root)), timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    found = {f: json.loads((tmp_path / f / "search.json").read_text()) for f in ("0", "1")}
    assert found["0"]["config"]["gpus"] == 1 and found["1"]["config"]["gpus"] == 2
    assert [p["placement"] for p in found["0"]["placements"]] == ["1x colocated TP1"]  # one GPU: nothing else
    assert len(found["1"]["placements"]) == 2 and all(
        p["goodput_per_gpu"] > 0 for p in found["1"]["placements"]
    )
