"""The simulator's DP-attention model against the engine: fitted on one engine's and TP's decode steps,
it predicts DP's, which it never saw.

    python -m experiments.sim.dp_check bench_results/dp-....json

reads what `python -m experiments.bench.dp_step --one` measured (each layout's decode step by batch and
prompt length, and the machine's peak, bandwidth and collective latencies), fits the cost model's
efficiencies on the TP 1 and TP rows (the linear and memory efficiencies over a grid; for each, the step
overhead, the per-sequence overhead and that of an instance of several ranks by non-negative least
squares on the relative error; the collectives' latencies are the machine's, measured beside the
steps), then predicts every row, the DP ones held out. Prints each row's measured and predicted step,
and the mean |error| over the held-out rows and over the fitted ones. The DP prediction is the cost
model's own (experiments/sim/cost.py): the attention side on each group's share of the batch, the
experts spread over every rank, the all-to-all's bytes and rounds; nothing in it is fitted to DP.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from experiments.sim.cost import CostModel, Efficiency
from experiments.sim.hardware import Hardware
from experiments.sim.models import sim_model

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Row:
    tp: int
    dp: int
    batch: int
    kv: int
    seconds: float

    @property
    def label(self) -> str:
        return f"{'DP' if self.dp > 1 else 'TP'} {max(self.tp, self.dp)}, batch {self.batch}, kv {self.kv}"


def _nnls(cols: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Non-negative least squares over a few columns: the best of every subset's unconstrained solution
    that stays >= 0 (three columns: eight subsets)."""
    best, best_x = np.inf, np.zeros(cols.shape[1])
    for k in range(cols.shape[1] + 1):
        for subset in itertools.combinations(range(cols.shape[1]), k):
            x = np.zeros(cols.shape[1])
            if subset:
                sol, *_ = np.linalg.lstsq(cols[:, subset], target, rcond=None)
                if (sol < 0).any():
                    continue
                x[list(subset)] = sol
            err = float(np.sum((cols @ x - target) ** 2))
            if err < best:
                best, best_x = err, x
    return best_x


def _cost(model, hw: Hardware, row: Row, eff: Efficiency) -> CostModel:
    return CostModel(model, hw, row.tp, eff, row.dp)


def fit(model, hw: Hardware, rows: list[Row]) -> Efficiency:
    """The efficiencies that best fit rows' decode steps (relative error)."""
    meas = np.array([r.seconds for r in rows])
    weight = 1 / meas
    seqs = np.array([r.batch / r.dp for r in rows], dtype=float)
    many = np.array([float(r.tp * r.dp > 1) for r in rows])
    cols = np.stack([np.ones_like(meas), seqs, many], axis=1) * weight[:, None]
    best = (np.inf, Efficiency())
    for lin, mem in itertools.product(np.linspace(0.05, 1.0, 20), np.linspace(0.05, 1.0, 20)):
        base = Efficiency(linear=float(lin), attention=float(lin), memory=float(mem))
        preds = np.array([_cost(model, hw, r, base).decode_time([r.kv] * r.batch) for r in rows])
        a, b, c = _nnls(cols, (meas - preds) * weight)
        err = float(np.mean(((preds + a + b * seqs + c * many - meas) * weight) ** 2))
        if err < best[0]:
            best = (err, replace(base, step_overhead_s=a, seq_overhead_s=b, ranks_overhead_s=c))
    return best[1]


def check(saved: dict) -> dict:
    """Fit on saved's TP 1 and TP rows, predict all; the mean |error| of the DP rows and the fitted ones."""
    first = saved["rows"][0]
    model = replace(sim_model(first["model"]), bytes_per_param=BYTES[first["dtype"]])
    hw = Hardware(**saved["hardware"])
    # the steps ran after the prompts: their KV length is the prompt's and about half the steps taken
    grow = saved.get("steps", 0) // 2 + 1
    rows = [Row(r["tp"], r["dp"], r["batch"], r["kv"] + grow, r["step_ms"] / 1e3) for r in saved["rows"]]
    seen = [r for r in rows if r.dp == 1]
    held = [r for r in rows if r.dp > 1]
    if not held or not any(r.tp == 1 for r in seen) or not any(r.tp > 1 for r in seen):
        raise ValueError("dp_check needs TP 1, TP and DP rows: run experiments.bench.dp_step with --one")
    eff = fit(model, hw, seen)
    out = []
    for r in rows:
        pred = _cost(model, hw, r, eff).decode_time([r.kv] * r.batch)
        out.append({"row": r.label, "held_out": r.dp > 1, "measured_ms": 1e3 * r.seconds,
                    "predicted_ms": 1e3 * pred, "error": pred / r.seconds - 1})  # fmt: skip

    def mean_abs(held_out: bool) -> float:
        return float(np.mean([abs(o["error"]) for o in out if o["held_out"] is held_out]))

    return {"efficiency": eff, "hardware": hw, "rows": out, "held_out_error": mean_abs(True),
            "fitted_error": mean_abs(False)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="experiments.bench.dp_step --one outputs (JSON)")
    args = p.parse_args(argv)
    saved = {"rows": []}
    for path in args.results:  # the machine as the first file measured it
        data = json.loads(path.read_text())
        saved.setdefault("hardware", data["hardware"])
        saved.setdefault("steps", data["steps"])
        saved["rows"] += data["rows"]
    result = check(saved)
    e = result["efficiency"]
    print(
        f"fitted on the TP rows: linear {e.linear:.2f}, memory {e.memory:.2f}, step overhead "
        f"{1e3 * e.step_overhead_s:.2f} ms, per sequence {1e3 * e.seq_overhead_s:.3f} ms, of several "
        f"ranks {1e3 * e.ranks_overhead_s:.2f} ms; measured: "
        f"all-reduce {1e3 * result['hardware'].allreduce_s:.2f} ms, all-to-all exchange "
        f"{1e3 * result['hardware'].alltoall_s:.2f} ms\n"
    )
    print("| step | measured ms | predicted ms | error |\n| --- | ---: | ---: | ---: |")
    for o in result["rows"]:
        name = o["row"] + (" (held out)" if o["held_out"] else "")
        print(f"| {name} | {o['measured_ms']:.1f} | {o['predicted_ms']:.1f} | {100 * o['error']:+.0f}% |")
    print(
        f"\nmean |error|: DP rows (held out) {100 * result['held_out_error']:.0f}%, "
        f"TP 1 and TP rows (fitted) {100 * result['fitted_error']:.0f}%"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
