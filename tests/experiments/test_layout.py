"""num_workers: auto (experiments/layout.py): the cores' split into workers x threads chosen from the
steps measured on each thread count, by simulating the run's own requests through each split."""

import numpy as np
import pytest

from experiments.config import from_cfg
from experiments.layout import Steps, choose, prompt_lengths, splits
from experiments.record import Request
from experiments.sim.cost import Efficiency
from experiments.sim.hardware import Hardware
from experiments.sim.models import sim_model
from serving.config import DeploymentConfig
from tests.experiments.runs import _cfg

SLO = ["slo.ttft_s=3", "slo.tpot_s=0.1"]


def test_splits_cover_every_product_of_the_cores_and_bad_counts_are_named():
    assert splits(1) == [(1, 1)]
    assert splits(2) == [(2, 1), (1, 2)]
    assert splits(6) == [(6, 1), (3, 2), (2, 3), (1, 6)]
    for bad in (0, -2, "2", 1.5):
        with pytest.raises(ValueError, match="cores must be an integer >= 1"):
            splits(bad)


class Machine:
    """Steps as a machine whose step on t threads runs `scaling(t)` times faster than on one: a fitted
    cost model per thread count, as layout.Steps gives after measuring."""

    def __init__(self, scaling):
        self.scaling, self.asked = scaling, []

    def fitted(self, threads, prompts):
        self.asked.append((threads, prompts))
        s = self.scaling(threads)
        hw = Hardware("cpu-fake", 3e12 * s, 20e9 * s, 16e9, 1e9, 1e9, devices_per_node=1, source="test")
        eff = Efficiency(linear=0.3, attention=0.3, memory=0.5, step_overhead_s=0.01 / s, seq_overhead_s=0.0)
        return sim_model("smollm2-135m"), hw, eff, 5.0


def _requests(rate, n=40, prompt=1024, output=32):
    gaps = np.random.default_rng(0).exponential(1 / rate, n)
    return [Request(f"r{i}", float(t), range(prompt), output) for i, t in enumerate(np.cumsum(gaps))]


def _config():
    return from_cfg(_cfg(["model=smollm2-135m", "deployment=colocated", *SLO]))


def _d(**kw):
    return DeploymentConfig(**{"name": "auto", "kind": "colocated", "num_workers": "auto", **kw})


def test_threads_that_do_not_speed_a_step_up_give_one_worker_a_core():
    """No faster on two threads: one worker has half the capacity, and at a rate that two workers keep up
    with, its queue breaks the TTFT SLO."""
    machine = Machine(lambda t: 1.0)
    reqs = _requests(rate=3.0)
    chosen, table = choose(_config(), _d(), reqs, machine, prompt_lengths(reqs, 2048), cores=2)
    assert (chosen.num_workers, chosen.threads_per_worker) == (2, 1)
    by = {(r["num_workers"], r["threads_per_worker"]): r for r in table}
    assert by[2, 1]["simulated_attainment_pct"] > by[1, 2]["simulated_attainment_pct"]
    assert sorted(t for t, _ in machine.asked) == [1, 2]  # each thread count's fit, asked once
    assert chosen.name == "auto" and chosen.kind == "colocated"


def test_threads_that_scale_give_one_worker_every_core():
    """Twice as fast on two threads: the same capacity in one worker whose prompts finish in half the
    time and whose one batch decodes all requests at once."""
    reqs = _requests(rate=3.0)
    chosen, table = choose(_config(), _d(), reqs, Machine(lambda t: float(t)), prompt_lengths(reqs, 2048), 2)
    assert (chosen.num_workers, chosen.threads_per_worker) == (1, 2)
    assert table[0]["num_workers"] == 1  # best first
    assert table[0]["simulated_ttft_p90_s"] < table[1]["simulated_ttft_p90_s"]


def test_the_prefill_shapes_timed_are_the_median_prompt_within_one_steps_budget():
    assert prompt_lengths(_requests(1.0, prompt=1024), 2048) == (32, 128, 1024)
    assert prompt_lengths(_requests(1.0, prompt=4000), 2048) == (32, 128, 2048)  # chunks of the budget
    assert prompt_lengths(_requests(1.0, prompt=20), 2048) == (20, 32, 128)
    assert prompt_lengths([], 512) == (32, 128)


@pytest.mark.parametrize(
    "kw, what",
    [
        (dict(kind="disaggregated", num_prefill=1, num_decode=1), "auto only for kind=colocated"),
        (dict(tp=2), "auto only for kind=colocated with tp=1"),
        (dict(threads_per_worker=2), "threads_per_worker left at 1"),
    ],
)
def test_auto_is_refused_where_it_cannot_split_the_cores(kw, what):
    with pytest.raises(ValueError, match=what):
        _d(**kw)
    with pytest.raises(
        ValueError, match=r"num_workers \(or auto\)='many' is not allowed: must be an integer"
    ):
        DeploymentConfig(name="x", kind="colocated", num_workers="many")
    with pytest.raises(ValueError, match="no count until the job measures it"):
        _ = _d().processes


def test_the_main_job_refuses_auto_on_ray_before_anything_runs(tmp_path):
    from experiments.run import run

    cfg = _cfg(["model=tiny-random", "launcher=ray", "deployment=colocated", "deployment.num_workers=auto"])
    with pytest.raises(
        ValueError, match="num_workers: auto measures this machine's cores; with launcher=ray"
    ):
        run(cfg, tmp_path, progress=False)
    assert not (tmp_path / "results.json").exists()


def test_the_server_asks_for_a_number(tmp_path):
    """A server has no run's requests to simulate: auto is refused by name before any worker starts."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    args = ["deployment=colocated", "deployment.num_workers=auto", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run([sys.executable, "-m", "experiments.serve", "model=tiny-random", *args], cwd=root,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0
    assert "num_workers=auto is chosen by simulating a run's requests" in done.stderr + done.stdout


def test_the_cores_are_timed_in_the_engines_dtype(monkeypatch):
    """The GEMM peak the split is simulated with is the engine's own dtype's: a bf16 GEMM on a CPU without
    bf16 (an AVX2 EPYC: 0.9 GFLOP/s against fp32's 75) took the test of auto 57 of its 68 s and described
    an engine that computes in fp32 there."""
    import experiments.sim.calibrate as calibrate
    import experiments.sim.hardware as hardware
    from serving.config import ModelSpec

    asked = []

    def measure(threads, device="cpu", dtype="bfloat16"):
        asked.append((threads, dtype))
        return Hardware("cpu", flops=1e11, hbm_bw=1e10, hbm_bytes=1e9, nvlink_bw=1e9, nic_bw=1e9)

    monkeypatch.setattr(hardware, "measure", measure)
    monkeypatch.setattr(calibrate, "measure_engine", lambda *a, **kw: [])
    monkeypatch.setattr(calibrate, "fit", lambda *a, **kw: (None, 0.0))
    for dtype in ("float32", "bfloat16"):
        asked.clear()
        steps = Steps(ModelSpec(name="tiny-random", dtype=dtype))
        steps.fitted(1, (32,))
        steps.fitted(2, (32,))
        assert asked == [(1, dtype), (2, dtype)]
