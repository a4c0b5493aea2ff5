"""An operator-level cost model, checked on GPU profiles others measured: Vidur's (microsoft/vidur, MIT
license; `scripts/fetch_vidur_profiles.py` fetches them), per-operator times of a transformer layer on A100,
H100 and A40 for Llama-2-7B/70B, Llama-3-8B/70B, CodeLlama-34B, Qwen-72B, InternLM-20B and Phi-2, at 1 to
4,096+ tokens a step and TP 1-8.

    python -m experiments.sim.operators --profiles DIR [--fit a100 --predict h100] [--fit-models A,B]
        [--predict-models C,D]

Each operator of a layer but attention (the embedding, both norms, the QKV, output, up and down projections,
rope, the activation, the residual add) takes (c^p + m^p)^(1/p) + t0, c = FLOPs / (peak x e_flops) and m =
bytes / (HBM bandwidth x e_mem) (p infinite: the roofline's max; 1: their sum), its FLOPs and bytes from the
model's shapes at that token count and TP degree (fp16: 2 bytes an element; a GEMM reads its input and
weight and writes its output once). The four numbers are fitted per operator on one GPU's rows (least
squares of the log of predicted over measured time; p among P_CHOICES), and predict another
GPU's rows from that GPU's datasheet peak and bandwidth (experiments/sim/hardware.py's presets, Vidur's own
A40 figures), or other models' rows on the same GPU. Printed: the median and 90th-percentile relative error
per operator and for each row's operators summed (a layer's step time without its attention), held out, and
beside them today's step model's (the roofline with its default efficiencies, no fixed cost) on the same rows.
The collectives (`network/*/all_reduce.csv`, `send_recv.csv`) the same way: a rank's wire bytes (a ring
all-reduce's 2 (n - 1) / n of the buffer, a send's buffer) over its link's datasheet rate (NVLink within a
node, the NIC across nodes) x e, plus t0, fitted per node type, collective and link on one GPU's rows.
Attention, and whole layers' steps from their operators: experiments/sim/attention_ops.py.
"""

from __future__ import annotations

import argparse
import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.sim.cost import Efficiency
from experiments.sim.hardware import GB, HARDWARE, TFLOPS

# datasheet peak (dense fp16/bf16 FLOP/s) and HBM bytes/s of the GPUs the profiles were measured on
GPUS = {
    "a100": (HARDWARE["a100-80gb"].flops, HARDWARE["a100-80gb"].hbm_bw),
    "h100": (HARDWARE["h100"].flops, HARDWARE["h100"].hbm_bw),
    "a40": (150 * TFLOPS, 696 * GB),  # Vidur's A40 peak; its datasheet's 696 GB/s GDDR6
}
OPS = (
    "emb",
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
BYTES = 2  # fp16


@dataclass(frozen=True)
class Row:
    """One profiled step size: a model's shapes, its tokens and TP degree, each operator's median ms."""

    gpu: str
    model: str
    heads: int
    kv_heads: int
    hidden: int
    expanded: int
    gated: bool
    tokens: int
    tp: int
    ms: dict[str, float]


def work(row: Row, op: str) -> tuple[float, float]:
    """(FLOPs, bytes) of operator op at row's size, on one TP rank."""
    m, h, tp = row.tokens, row.hidden, row.tp
    head_dim = h // row.heads

    def gemm(k: float, n: float) -> tuple[float, float]:
        return 2 * m * k * n, BYTES * (m * k + k * n + m * n)

    if op == "attn_pre_proj":
        return gemm(h, (row.heads + 2 * row.kv_heads) * head_dim / tp)
    if op == "attn_post_proj":
        return gemm(row.heads * head_dim / tp, h)
    if op == "mlp_up_proj":
        return gemm(h, (2 if row.gated else 1) * row.expanded / tp)
    if op == "mlp_down_proj":
        return gemm(row.expanded / tp, h)
    if op == "attn_rope":  # q and k of this rank's heads, read and written
        return 0.0, 2 * BYTES * m * (row.heads + row.kv_heads) * head_dim / tp
    if op == "mlp_act":  # gated: gate and up read, their product written; else one read, one write
        return 0.0, (3 if row.gated else 2) * BYTES * m * row.expanded / tp
    if op == "add":  # two read, one written
        return 0.0, 3 * BYTES * m * h
    if op in ("input_layernorm", "post_attention_layernorm"):
        return 0.0, BYTES * (2 * m * h + h)
    if op == "emb":  # rows gathered and written
        return 0.0, 2 * BYTES * m * h
    raise ValueError(f"operator must be one of {OPS}, got {op!r}")


def read_profile(path: Path, gpu: str, model: str) -> list[Row]:
    """A Vidur `mlp.csv` (columns time_stats.<op>.median in ms, the model's shapes, num_tokens,
    num_tensor_parallel_workers) as Rows."""
    rows = []
    with open(path, newline="") as f:
        for rec in csv.DictReader(f):
            ms = {
                op: float(rec[f"time_stats.{op}.median"]) for op in OPS if rec.get(f"time_stats.{op}.median")
            }
            rows.append(
                Row(
                    gpu,
                    model,
                    int(rec["n_head"]),
                    int(rec["n_kv_head"]),
                    int(rec["n_embd"]),
                    int(rec["n_expanded_embd"]),
                    rec["use_gated_mlp"] == "True",
                    int(rec["num_tokens"]),
                    int(rec["num_tensor_parallel_workers"]),
                    ms,
                )
            )
    return rows


def read_profiles(root: Path) -> list[Row]:
    """Every <root>/compute/<gpu>/<org>/<model>/mlp.csv under root, as Rows."""
    rows = []
    for path in sorted(Path(root).glob("compute/*/*/*/mlp.csv")):
        gpu, model = path.parts[-4], path.parts[-2]
        if gpu in GPUS:
            rows += read_profile(path, gpu, model)
    if not rows:
        raise SystemExit(f"no Vidur profiles under {root} (compute/<gpu>/<org>/<model>/mlp.csv): fetch them "
                         "with scripts/fetch_vidur_profiles.py")  # fmt: skip
    return rows


# how an operator's compute time c and memory time m combine: (c^p + m^p)^(1/p), fitted per operator among
# these (inf: the larger of the two, the plain roofline; 1: their sum). Near the ridge a GEMM pays more than
# the larger (its tiles' loads and math overlap only in part), which p of 2 or 4 carries
P_CHOICES = (1.0, 2.0, 4.0, math.inf)


@dataclass(frozen=True)
class OpModel:
    """(c^p + m^p)^(1/p) + t0_s, c = FLOPs / (peak x e_flops), m = bytes / (bandwidth x e_mem)."""

    e_flops: float
    e_mem: float
    t0_s: float
    p: float = math.inf

    def predict(self, flops: np.ndarray, nbytes: np.ndarray, gpus: list[str]) -> np.ndarray:
        """Seconds for each (FLOPs, bytes) on its GPU."""
        peak, bw = (np.array([GPUS[g][i] for g in gpus]) for i in (0, 1))
        return combine(flops / (peak * self.e_flops), nbytes / (bw * self.e_mem), self.p) + self.t0_s


def combine(c: np.ndarray, m: np.ndarray, p: float) -> np.ndarray:
    return np.maximum(c, m) if p == math.inf else (c**p + m**p) ** (1 / p)


def _arrays(rows: list[Row], op: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    kept = [r for r in rows if op in r.ms and r.ms[op] > 0]
    flops, nbytes = (np.array(v, dtype=float) for v in zip(*(work(r, op) for r in kept), strict=True))
    return flops, nbytes, np.array([r.ms[op] / 1e3 for r in kept]), [r.gpu for r in kept]


def fit(rows: list[Row], op: str) -> OpModel:
    """The operator's (e_flops, e_mem, t0) minimizing the squared log error over rows (one GPU's)."""
    return fit_arrays(*_arrays(rows, op))


def fit_arrays(flops: np.ndarray, nbytes: np.ndarray, seconds: np.ndarray, gpus: list[str]) -> OpModel:
    """The (e_flops, e_mem, t0, p) minimizing the squared log error of the predicted seconds of work of these
    FLOPs and bytes on these GPUs, the best over P_CHOICES."""
    peak, bw = np.array([GPUS[g][0] for g in gpus]), np.array([GPUS[g][1] for g in gpus])
    best = (math.inf, 1.0, 1.0, 0.0, math.inf)
    for p in P_CHOICES if flops.any() else (math.inf,):  # no FLOPs: p says nothing
        mine = grid_fit(flops / peak, nbytes / bw, seconds, lambda c, m, p=p: combine(c, m, p))
        if mine[0] < best[0]:
            best = (*mine, p)
    return OpModel(*best[1:])


def grid_fit(
    a: np.ndarray,
    b: np.ndarray,
    seconds: np.ndarray,
    join,
    rounds: int = 3,
    points: int = 25,
    t_points: int = 21,
) -> tuple[float, float, float, float]:
    """(loss, e_a, e_b, t0) minimizing the squared log error of join(a / e_a, b / e_b) + t0 against seconds,
    a and b each a part's time at full rate (the efficiencies in (0, 1]): a grid of `points` values an
    efficiency (log-spaced) and t_points of t0, then finer ones around its best point, `rounds` in all."""
    log_s = np.log(seconds)
    lo_a, hi_a, lo_b, hi_b, hi_t = -3.0, 0.0, -3.0, 0.0, float(np.min(seconds))
    best = (math.inf, 1.0, 1.0, 0.0)
    for _ in range(rounds):
        e_a, e_b = 10 ** np.linspace(lo_a, hi_a, points), 10 ** np.linspace(lo_b, hi_b, points)
        base = join(a[None, None, :] / e_a[:, None, None], b[None, None, :] / e_b[None, :, None])
        for t in np.linspace(0.0, hi_t, t_points):
            loss = ((np.log(base + t) - log_s) ** 2).sum(axis=-1)
            i, j = np.unravel_index(np.argmin(loss), loss.shape)
            if loss[i, j] < best[0]:
                best = (float(loss[i, j]), float(e_a[i]), float(e_b[j]), float(t))
        step_a, step_b = (hi_a - lo_a) / (points - 1), (hi_b - lo_b) / (points - 1)
        la, lb = math.log10(best[1]), math.log10(best[2])
        lo_a, hi_a = la - 2 * step_a, min(0.0, la + 2 * step_a)
        lo_b, hi_b = lb - 2 * step_b, min(0.0, lb + 2 * step_b)
        hi_t = max(best[3] * 2, hi_t / 10)
    return best


def errors(pred: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    return np.abs(pred / seconds - 1)


def evaluate(models: dict[str, OpModel], rows: list[Row]) -> dict[str, np.ndarray]:
    """Relative errors on rows, per operator and for each row's operators summed ('layer')."""
    out, pred_sum, meas_sum = {}, np.zeros(len(rows)), np.zeros(len(rows))
    for op, model in models.items():
        flops, nbytes, seconds, gpus = _arrays(rows, op)
        pred = model.predict(flops, nbytes, gpus)
        out[op] = errors(pred, seconds)
        has = np.array([op in r.ms and r.ms[op] > 0 for r in rows])
        pred_sum[has] += pred
        meas_sum[has] += seconds
    out["layer"] = errors(pred_sum, meas_sum)
    return out


def roofline_today(ops: list[str]) -> dict[str, OpModel]:
    """The step model's roofline as the simulator prices a GPU by default (experiments/sim/cost.py's
    Efficiency: linear ops at its linear efficiency of peak, every op at its memory efficiency of the
    bandwidth, no fixed cost)."""
    eff = Efficiency()
    return {op: OpModel(eff.linear, eff.memory, 0.0) for op in ops}


def report(fit_rows: list[Row], test_rows: list[Row], title: str) -> str:
    ops = [op for op in OPS if any(op in r.ms for r in fit_rows)]
    fitted = {op: fit(fit_rows, op) for op in ops}
    new, old = evaluate(fitted, test_rows), evaluate(roofline_today(ops), test_rows)
    lines = [
        f"{title}: fitted on {len(fit_rows)} rows, held out {len(test_rows)}",
        "",
        "| operator | e_flops | e_mem | p | t0 us | median error | p90 error | today's median | "
        "today's p90 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for op in [*ops, "layer"]:
        m = fitted.get(op)
        gemm = m and work(fit_rows[0], op)[0] > 0  # no FLOPs: no e_flops, no p
        e_flops, p = (f"{m.e_flops:.2f}", f"{m.p:g}") if gemm else ("-", "-")
        params = f"{e_flops} | {m.e_mem:.2f} | {p} | {m.t0_s * 1e6:.1f}" if m else "| | |"
        a, b = new[op], old[op]
        lines.append(f"| {op} | {params} | {np.median(a):.1%} | {np.quantile(a, 0.9):.1%} | "
                     f"{np.median(b):.1%} | {np.quantile(b, 0.9):.1%} |")  # fmt: skip
    return "\n".join(lines)


# one GPU's NVLink bytes/s each way and its NIC's (hardware.py's DGX presets; A40: Vidur's pairwise bridge)
LINKS = {
    "a100": (HARDWARE["a100-80gb"].nvlink_bw, HARDWARE["a100-80gb"].nic_bw),
    "h100": (HARDWARE["h100"].nvlink_bw, HARDWARE["h100"].nic_bw),
    "a40": (56 * GB, 25 * GB),
}


@dataclass(frozen=True)
class Collective:
    """One profiled collective: its GPU and node type (dgx, pairwise_nvlink), kind (all_reduce, send_recv),
    ranks, ranks a node, fp16 elements, median ms."""

    gpu: str
    node: str
    kind: str
    workers: int
    per_node: int
    size: int
    ms: float

    @property
    def link(self) -> str:
        return "nvlink" if self.workers <= self.per_node else "nic"

    @property
    def wire_bytes(self) -> float:
        """Bytes one rank sends: a ring all-reduce's 2 (n - 1) / n of the buffer, a send's whole buffer."""
        nbytes = BYTES * self.size
        return 2 * (self.workers - 1) / self.workers * nbytes if self.kind == "all_reduce" else nbytes


def read_collectives(root: Path) -> list[Collective]:
    """Every <root>/network/<gpu>_<node>/{all_reduce,send_recv}.csv, as Collectives."""
    rows = []
    for path in sorted(Path(root).glob("network/*/*.csv")):
        gpu, _, node = path.parent.name.partition("_")
        kind = path.stem
        if gpu not in LINKS or kind not in ("all_reduce", "send_recv"):
            continue
        with open(path, newline="") as f:
            for rec in csv.DictReader(f):
                ranks, per_node = int(rec["num_workers"]), int(rec["devices_per_node"])
                ms = float(rec[f"time_stats.{kind}.median"])
                rows.append(Collective(gpu, node, kind, ranks, per_node, int(rec["size"]), ms))
    return rows


def _link_seconds(rows: list[Collective]) -> tuple[np.ndarray, np.ndarray]:
    """(time at the link's full datasheet rate, measured seconds) of each row."""
    rate = np.array([LINKS[r.gpu][0 if r.link == "nvlink" else 1] for r in rows])
    return np.array([r.wire_bytes for r in rows]) / rate, np.array([r.ms / 1e3 for r in rows])


def fit_collective(rows: list[Collective]) -> tuple[float, float]:
    """(e, t0): time = wire bytes / (the link's rate x e) + t0, least squares of the log error."""
    ideal, seconds = _link_seconds(rows)
    best, lo, hi, hi_t = (math.inf, 1.0, 0.0), -3.0, 0.0, float(np.min(seconds))
    for _ in range(3):
        e, t0 = 10 ** np.linspace(lo, hi, 49), np.linspace(0.0, hi_t, 41)
        loss = (
            (np.log(ideal[None, None, :] / e[:, None, None] + t0[None, :, None]) - np.log(seconds)) ** 2
        ).sum(-1)
        i, j = np.unravel_index(np.argmin(loss), loss.shape)
        if loss[i, j] < best[0]:
            best = (float(loss[i, j]), float(e[i]), float(t0[j]))
        step = (hi - lo) / 48
        lo, hi, hi_t = (
            math.log10(best[1]) - 2 * step,
            min(0.0, math.log10(best[1]) + 2 * step),
            2 * best[2] or hi_t / 10,
        )
    return best[1], best[2]


def report_collectives(rows: list[Collective], fit_gpu: str, test_gpu: str) -> str:
    """Per node type, collective and link: fitted on fit_gpu's rows, the errors on test_gpu's."""
    eff = Efficiency()
    lines = [
        f"collectives held out by GPU: fitted on {fit_gpu}, predicting {test_gpu}",
        "",
        "| node | collective | link | held-out rows | e | t0 us | median error | p90 error | "
        "today's median | today's p90 |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    keys = sorted({(r.node, r.kind, r.link) for r in rows if r.gpu == test_gpu})
    for key in keys:
        fit_rows = [r for r in rows if r.gpu == fit_gpu and (r.node, r.kind, r.link) == key]
        test_rows = [r for r in rows if r.gpu == test_gpu and (r.node, r.kind, r.link) == key]
        if not fit_rows:
            continue
        e, t0 = fit_collective(fit_rows)
        ideal, seconds = _link_seconds(test_rows)
        new, old = errors(ideal / e + t0, seconds), errors(ideal / eff.comm, seconds)
        cells = [f"{np.median(a):.1%} | {np.quantile(a, 0.9):.1%}" for a in (new, old)]
        lines.append(
            f"| {' | '.join(key)} | {len(test_rows)} | {e:.2f} | {t0 * 1e6:.1f} | {' | '.join(cells)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", type=Path, required=True, help="Vidur's data/profiling folder")
    parser.add_argument("--fit", default="a100", help=f"the GPU fitted on, one of {tuple(GPUS)}")
    parser.add_argument("--predict", default="h100", help="the GPU held out")
    parser.add_argument("--fit-models", default="Llama-2-7b-hf,Meta-Llama-3-8B")
    parser.add_argument("--predict-models", default="Llama-2-70b-hf,Qwen-72B")
    args = parser.parse_args(argv)
    for gpu in (args.fit, args.predict):
        if gpu not in GPUS:
            raise SystemExit(f"--fit and --predict must be one of {tuple(GPUS)}, got {gpu!r}")
    rows = read_profiles(args.profiles)
    by_gpu = [r for r in rows if r.gpu == args.fit], [r for r in rows if r.gpu == args.predict]
    fit_models, test_models = set(args.fit_models.split(",")), set(args.predict_models.split(","))
    by_model = (
        [r for r in by_gpu[0] if r.model in fit_models],
        [r for r in by_gpu[0] if r.model in test_models],
    )
    checks = {
        f"held out by GPU: fitted on {args.fit}, predicting {args.predict}": by_gpu,
        f"held out by model on {args.fit}: fitted on {args.fit_models}, "
        f"predicting {args.predict_models}": by_model,
    }
    for name, (fit_rows, test_rows) in checks.items():
        if not fit_rows or not test_rows:
            raise SystemExit(f"{name}: no rows to fit on or to predict (profiles under {args.profiles})")
        print(report(fit_rows, test_rows, name), end="\n\n")
    collectives = read_collectives(args.profiles)
    if collectives:
        print(report_collectives(collectives, args.fit, args.predict))


if __name__ == "__main__":
    main()
