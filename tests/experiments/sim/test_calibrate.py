import pytest

from experiments.sim.calibrate import Point, fit, predict
from experiments.sim.cost import CostModel, Efficiency
from experiments.sim.hardware import Hardware
from experiments.sim.models import sim_model

CPU = Hardware(
    "cpu", flops=200e9, hbm_bw=20e9, hbm_bytes=16e9, nvlink_bw=20e9, nic_bw=20e9, devices_per_node=1
)


def test_fit_recovers_the_factors_that_generated_the_times():
    model = sim_model("smollm2-135m")
    truth = Efficiency(linear=0.6, attention=0.6, memory=0.8, step_overhead_s=0.02)
    cost = CostModel(model, CPU, 1, truth)
    shapes = [
        ("prefill", 32, 0),
        ("prefill", 128, 0),
        ("prefill", 512, 0),
        ("decode", 1, 130),
        ("decode", 32, 130),
    ]
    points = [Point(k, s, kv, predict(cost, Point(k, s, kv, 0.0))) for k, s, kv in shapes]
    got, err = fit(model, CPU, points)
    assert err < 1e-3
    assert got.linear == pytest.approx(0.6, abs=0.05) and got.memory == pytest.approx(0.8, abs=0.05)
    assert got.step_overhead_s == pytest.approx(0.02, rel=0.15)
