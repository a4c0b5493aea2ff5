"""Workers sharing a machine: the neighbours' model, its fit, the simulation and the calibration that use
it, and the bench that measures it."""

import os
import statistics

import pytest

from experiments.sim.calibrate import alone
from experiments.sim.contention import KINDS, Contention, Shapes, bytes_model, fit, measure, step_bytes
from experiments.sim.cost import Efficiency
from experiments.sim.hardware import Hardware
from experiments.sim.models import sim_model
from experiments.sim.simulate import Instance, SimRequest, simulate_colocated
from tests.experiments.sim.toys import TOY, fixed_steps

HW = Hardware("toy", flops=1e3, hbm_bw=1e2, hbm_bytes=1e9, nvlink_bw=10, nic_bw=5)
# half of a decode step's 1 s is reading (0.5 bytes at 1 byte/s); beside a busy neighbour of either kind
# it takes 1 + 0.5 x 0.5 + 0.5 x 0.1 = 1.3 s
SHARED = Contention({"prefill": 0.5, "decode": 0.5}, {"prefill": 0.1, "decode": 0.1}, read_bw=1.0)


NONE = {"prefill": 0.0, "decode": 0.0}


class Reads(fixed_steps(1.0, 0.1)):
    def step_bytes(self, chunks, decode_kv_lens, sampled=None):
        return 0.5


def _instances(n: int, contention) -> list[Instance]:
    return [Instance(Reads(TOY, HW, eff=Efficiency(comm=1)), contention=contention) for _ in range(n)]


def _gaps(r: SimRequest) -> list[float]:
    return [b - a for a, b in zip(r.token_times, r.token_times[1:], strict=False)]


def test_the_model_prices_a_step_by_its_memory_share_and_its_neighbours_kinds():
    c = Contention({"prefill": 0.04, "decode": 0.2}, {"prefill": 0.02, "decode": 0.04}, read_bw=40e9)
    assert c.factor(0.9, {}) == 1.0
    assert c.factor(1.0, {"decode": 1.0}) == pytest.approx(1.2)
    assert c.factor(0.0, {"decode": 1.0}) == pytest.approx(1.04)
    assert c.factor(0.5, {"decode": 0.5, "prefill": 1.0}) == pytest.approx(1 + 0.5 * 0.12 + 0.03)
    assert c.share(20e9, 1.0) == pytest.approx(0.5) and c.share(80e9, 1.0) == 1.0 and c.share(1.0, 0.0) == 0.0


@pytest.mark.parametrize(
    "memory, compute, read_bw, field",
    [
        ({"prefill": 0.1}, NONE, 1.0, "contention.memory"),
        ({"prefill": 0.1, "decode": -0.1}, NONE, 1.0, "contention.memory"),
        (NONE, {"prefill": 0.0, "decode": 0.0, "x": 0.0}, 1.0, "contention.compute"),
        (NONE, NONE, 0.0, "contention.read_bw"),
    ],
)
def test_a_bad_model_is_refused_by_field(memory, compute, read_bw, field):
    with pytest.raises(ValueError, match=field):
        Contention(memory, compute, read_bw)


def test_the_fit_finds_the_model_its_steps_were_made_with():
    """Steps timed beside each neighbour kind as a known model says they would be: the fit gives it back,
    each step's f from the cost model's bytes and its time alone."""
    model, read_bw = sim_model("smollm2-135m"), 40e9
    truth = Contention({"prefill": 0.03, "decode": 0.21}, {"prefill": 0.02, "decode": 0.03}, read_bw)
    records = []
    for kind, size, kv, seconds in [("decode", 1, 1024, 0.008), ("decode", 8, 1024, 0.04),
                                    ("decode", 32, 1024, 0.15), ("prefill", 1024, 0, 2.6)]:  # fmt: skip
        record = {"kind": kind, "size": size, "kv": kv, "alone": seconds, "beside": {}}
        f = truth.share(step_bytes(bytes_model(model, read_bw), record), seconds)
        record["beside"] = {k: seconds * truth.factor(f, {k: 1.0}) for k in KINDS}
        records.append(record)
    got = fit(records, model, read_bw)
    for kind in KINDS:
        assert got.memory[kind] == pytest.approx(truth.memory[kind], rel=1e-6)
        assert got.compute[kind] == pytest.approx(truth.compute[kind], rel=1e-6)


def test_a_lone_instance_is_not_slowed_and_two_busy_ones_slow_each_other():
    """One instance: the same times with the model as without. Two decoding side by side the whole
    time: every step beside the other's, 1.3 s instead of 1 (SHARED's docstring)."""

    def run(n: int, contention) -> list[SimRequest]:
        reqs = [SimRequest(i, 0.0, prompt=10, output=40) for i in range(n)]
        return simulate_colocated(_instances(n, contention), reqs)

    (plain,), (shared,) = run(1, None), run(1, SHARED)
    assert shared.token_times == plain.token_times
    for r in run(2, None):
        assert statistics.median(_gaps(r)) == pytest.approx(1.0)
    slowed = run(2, SHARED)
    for r in slowed:
        assert statistics.median(_gaps(r)) == pytest.approx(1.3)
    assert all(r.done > plain.done for r in slowed)


def test_a_step_is_taken_back_to_its_time_alone_by_what_overlapped_it():
    """calibrate.alone: a 1.3 s step beside a neighbour's decode steps the whole time, reading 0.5 bytes
    at 1 byte/s, was a 1 s step (f 0.5) alone; half overlapped, less; none, as measured."""
    beside = [[[0.0, 0.7, 0, 4], [0.7, 1.5, 0, 4]]]  # (start, end, prompt tokens, decode sequences)
    assert alone(SHARED, 0.5, 0.0, 1.3, beside) == pytest.approx(1.0, rel=1e-3)
    half = alone(SHARED, 0.5, 0.0, 1.3, [[[0.0, 0.65, 0, 4]]])
    assert 1.0 < half < 1.3
    assert alone(SHARED, 0.5, 0.0, 1.3, [[[1.3, 2.0, 0, 4]]]) == 1.3


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the bench pins two workers to two cores")
def test_the_bench_times_each_step_alone_and_beside_every_neighbour():
    small = Shapes(batches=(1, 2), kv=32, prompt=32, neighbour_batch=2, pages=2 * 70)  # 66 a sequence
    cores = os.sched_getaffinity(0)
    records = measure("tiny-random", small, rounds=1, steps=2)
    assert os.sched_getaffinity(0) == cores  # given back
    shapes = [(r["kind"], r["size"], r["kv"]) for r in records]
    assert shapes == [("decode", 1, 32), ("decode", 2, 32), ("prefill", 32, 0)]
    for r in records:
        assert r["alone"] > 0 and set(r["beside"]) == {"prefill", "decode", "read"}
        assert all(t > 0 for t in r["beside"].values())
