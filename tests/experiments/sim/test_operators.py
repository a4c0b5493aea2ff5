"""experiments/sim/operators.py: each operator's FLOPs and bytes from a model's shapes, the fit recovering a
known operator, and the held-out errors on the slice of Vidur's profiles kept in tests/data/vidur, bounded by
what they measured (fitted on A100 Llama-2-7B: H100 Llama-2-7B layer sums 8.3% median, 12.1% p90;
A100 Llama-2-70B 4.7% and 8.2%; the default roofline 14.9% and 7.8% median)."""

import math
from pathlib import Path

import numpy as np
import pytest

from experiments.sim import operators

SLICE = Path(__file__).resolve().parents[2] / "data" / "vidur"


@pytest.fixture(scope="module")
def rows():
    return operators.read_profiles(SLICE)


def _row(tokens=8, tp=1, **ms):
    return operators.Row("a100", "Llama-2-7b-hf", 32, 32, 4096, 11008, True, tokens, tp, ms)


def test_a_layers_operators_cost_what_their_shapes_say():
    row = _row(tokens=8, tp=2)
    flops, nbytes = operators.work(row, "attn_pre_proj")  # q, k and v of 16 of 32 heads: N = 6,144
    assert flops == 2 * 8 * 4096 * 6144 and nbytes == 2 * (8 * 4096 + 4096 * 6144 + 8 * 6144)
    assert operators.work(row, "mlp_up_proj")[0] == 2 * 8 * 4096 * 11008  # gate and up, halved by TP
    assert operators.work(row, "mlp_act") == (0.0, 3 * 2 * 8 * 5504)
    with pytest.raises(ValueError, match="operator must be one of"):
        operators.work(row, "attention")


def test_the_slice_reads_as_published(rows):
    assert {(r.gpu, r.model) for r in rows} == {
        ("a100", "Llama-2-7b-hf"), ("h100", "Llama-2-7b-hf"), ("a100", "Llama-2-70b-hf")
    }  # fmt: skip
    r = next(r for r in rows if r.gpu == "h100" and r.tokens == 4096 and r.tp == 1)
    assert set(r.ms) == set(operators.OPS) and (r.heads, r.hidden, r.expanded) == (32, 4096, 11008)
    assert r.ms["mlp_up_proj"] > r.ms["mlp_down_proj"] > 0  # twice the columns (gate and up)


@pytest.mark.parametrize("p", [math.inf, 2.0])
def test_the_fit_finds_an_operator_it_was_made_from(p):
    """Times made by a known (e_flops, e_mem, t0, p) at the slice's shapes: the fit gives them back."""
    truth = operators.OpModel(0.6, 0.8, 10e-6, p)
    made = []
    for tokens in (1, 4, 16, 64, 256, 1024, 4096):
        for tp in (1, 2):
            flops, nbytes = operators.work(_row(tokens, tp), "mlp_down_proj")
            seconds = truth.predict(np.array([flops]), np.array([nbytes]), ["a100"])[0]
            made.append(_row(tokens, tp, mlp_down_proj=seconds * 1e3))
    got = operators.fit(made, "mlp_down_proj")
    assert got.e_flops == pytest.approx(0.6, rel=0.03) and got.e_mem == pytest.approx(0.8, rel=0.03)
    assert got.t0_s == pytest.approx(10e-6, rel=0.1) and got.p == p


def test_held_out_errors_stay_within_what_they_measured(rows):
    fit_rows = [r for r in rows if r.gpu == "a100" and r.model == "Llama-2-7b-hf"]
    fitted = {op: operators.fit(fit_rows, op) for op in operators.OPS}
    for held, median, p90, today in (
        ([r for r in rows if r.gpu == "h100"], 0.09, 0.13, 0.149),  # by GPU: its datasheet only
        ([r for r in rows if r.model == "Llama-2-70b-hf"], 0.05, 0.09, 0.078),  # by model
    ):
        errors = operators.evaluate(fitted, held)["layer"]
        assert np.median(errors) <= median and np.quantile(errors, 0.9) <= p90
        baseline = operators.evaluate(operators.roofline_today(list(operators.OPS)), held)["layer"]
        assert np.median(errors) < np.median(baseline) == pytest.approx(today, abs=0.005)


def test_the_command_prints_both_held_out_tables_and_refuses_what_it_cannot_do(capsys, tmp_path):
    operators.main(["--profiles", str(SLICE), "--fit-models", "Llama-2-7b-hf", "--predict-models",
                    "Llama-2-70b-hf"])  # fmt: skip
    out = capsys.readouterr().out
    assert "held out by GPU: fitted on a100, predicting h100" in out and "held out by model on a100" in out
    assert out.count("| layer |") == 2
    with pytest.raises(SystemExit, match="--fit and --predict must be one of"):
        operators.main(["--profiles", str(SLICE), "--fit", "v100"])
    with pytest.raises(SystemExit, match="fetch_vidur_profiles"):
        operators.main(["--profiles", str(tmp_path)])
    with pytest.raises(SystemExit, match="no rows to fit on or to predict"):
        operators.main(["--profiles", str(SLICE), "--predict", "a40"])


def test_a_collective_costs_its_wire_bytes_over_its_link_and_the_fit_finds_it():
    ring = operators.Collective("a100", "dgx", "all_reduce", 4, 8, 1 << 20, 0.1)
    assert ring.link == "nvlink" and ring.wire_bytes == 2 * 3 / 4 * 2 * (1 << 20)
    assert operators.Collective("a100", "dgx", "send_recv", 2, 1, 10, 0.1).link == "nic"  # across nodes
    nvlink = operators.LINKS["a100"][0]
    made = []
    for size in (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 26):
        row = operators.Collective("a100", "dgx", "all_reduce", 2, 8, size, 0.0)
        seconds = row.wire_bytes / (nvlink * 0.6) + 20e-6
        made.append(operators.Collective("a100", "dgx", "all_reduce", 2, 8, size, seconds * 1e3))
    e, t0 = operators.fit_collective(made)
    assert e == pytest.approx(0.6, rel=0.03) and t0 == pytest.approx(20e-6, rel=0.1)


def test_the_slices_collectives_are_held_out_by_gpu():
    rows = operators.read_collectives(SLICE)
    assert {(r.gpu, r.kind, r.workers) for r in rows} == {
        ("a100", "all_reduce", 2),
        ("h100", "all_reduce", 2),
    }
    table = operators.report_collectives(rows, "a100", "h100")
    assert "| dgx | all_reduce | nvlink | 5 |" in table
