"""Attention priced from a published GPU profile, a layer's step time from its operators, and what published
operator times say a decode step with a prompt batched in costs.

Vidur's first public commit (microsoft/vidur, MIT license; `scripts/fetch_vidur_profiles.py` writes it as
`a100/attention.csv`, at the commit scripts/vidur-attention.pin names) carries one attention profile: an
A100 running FlashAttention over a Llama-2-70B layer's heads at TP 2 (32 query and 4 KV heads of 128 dims a
rank, 16-token blocks), decode at batch 1 and more with 32-4,032 tokens of KV each, and prefill of one
request in chunks of 64-4,096 tokens after up to about 3,000 tokens already cached. (The later commits'
attention profiles per model and GPU are not in the public copy, so attention is checked on A100 alone,
held out by context length.)

Decode attention is priced as experiments/sim/operators.py prices a layer's other operators (its FLOPs and
bytes, combined as a fitted p-norm, plus t0). Prefill attention is two parts of one kernel that run at rates
of their own: the chunk over itself (causal: FlashAttention skips the masked half, and its tiles near the
diagonal do less work each) and the chunk over the KV cached before it (dense tiles): t0 + causal FLOPs /
(peak x e_causal) + cached FLOPs / (peak x e_cached). Each is fitted on the rows whose context is at most
FIT_CONTEXT tokens and checked on the longer ones. `layer_seconds` sums a layer's operators for a step of
decodes and prompt chunks; `interference` is a step with one prompt batched into a decode batch over the
step without it, per layer: from the profiles' own times (Llama-2-70B at TP 2, its mlp.csv rows interpolated
in tokens, and the attention rows), and from the fitted models for any model's shapes (DistServe's OPT-13B:
experiments/repro/survey.py reads the fitted parameters from PARAMS).

    python -m experiments.sim.attention_ops --profiles DIR [--gpu a100] [--write-params PATH]

prints the attention and interference tables; --write-params writes every operator's and attention's
parameters fitted on that GPU's rows (experiments/sim/data/a100-operators.json is a100's).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from experiments.sim.cost import Efficiency
from experiments.sim.operators import (
    BYTES,
    GPUS,
    OPS,
    OpModel,
    Row,
    errors,
    fit,
    fit_arrays,
    grid_fit,
    read_profiles,
    work,
)

FIT_CONTEXT = 1024  # tokens of context (KV, plus the chunk in a prefill) the attention fit sees at most
KINDS = ("decode", "prefill")
# the fitted A100 parameters experiments/repro/survey.py prices steps with (written by --write-params)
PARAMS = Path(__file__).parent / "data" / "a100-operators.json"


@dataclass(frozen=True)
class AttnRow:
    """One profiled attention call: its GPU, the model's shapes and TP degree, the batch (decode: its
    sequences, each with kv tokens of KV; prefill: one request's chunk after kv tokens), its median ms
    (the kernel and the reshapes around it)."""

    gpu: str
    hidden: int
    heads: int
    kv_heads: int
    tp: int
    kind: str
    batch: int
    chunk: int
    kv: int
    ms: float

    @property
    def context(self) -> int:
        return self.kv + (self.chunk if self.kind == "prefill" else 0)


def attn_work(
    hidden: int, heads: int, kv_heads: int, tp: int, kind: str, batch: int, chunk: int, kv: int
) -> tuple[float, float]:
    """(FLOPs, bytes) of one TP rank's attention: decode, batch sequences' one query each over kv tokens;
    prefill, one chunk of tokens over the kv before it and itself (causal)."""
    head_dim, q, k = hidden // heads, heads / tp, max(1.0, kv_heads / tp)
    if kind == "decode":
        return 4.0 * batch * kv * q * head_dim, BYTES * batch * (2 * kv * k * head_dim + 2 * q * head_dim)
    if kind == "prefill":
        flops = 4.0 * q * head_dim * chunk * (kv + (chunk + 1) / 2)
        return flops, BYTES * (2 * (kv + chunk) * k * head_dim + 2 * chunk * q * head_dim)
    raise ValueError(f"attention kind must be one of {KINDS}, got {kind!r}")


def read_attention(root: Path) -> list[AttnRow]:
    """Every <root>/<gpu>/attention.csv (Vidur's first layout) as AttnRows."""
    rows = []
    for path in sorted(Path(root).glob("*/attention.csv")):
        gpu = path.parent.name
        if gpu not in GPUS:
            continue
        with open(path, newline="") as f:
            for rec in csv.DictReader(f):
                kind = "prefill" if rec["is_prefill"] == "True" else "decode"
                extra = sum(
                    float(rec[f"time_stats.attn_{p}_reshape.median"] or 0) for p in ("input", "output")
                )
                rows.append(AttnRow(
                    gpu, int(rec["n_embd"]), int(rec["n_q_head"]), int(rec["n_kv_head"]),
                    int(rec["num_tensor_parallel_workers"]), kind, int(rec["batch_size"]),
                    int(rec["prefill_chunk_size"]), int(rec["kv_cache_size"]),
                    float(rec[f"time_stats.attn_{kind}.median"]) + extra,
                ))  # fmt: skip
    return rows


def prefill_parts(hidden: int, heads: int, tp: int, chunk: int, kv: int) -> tuple[float, float]:
    """(FLOPs of the chunk over itself, causal; FLOPs of the chunk over the kv tokens before it), a rank's."""
    per_pair = 4.0 * heads / tp * (hidden // heads)  # a query and a key: QK^T and PV over the head dim
    return per_pair * chunk * (chunk + 1) / 2, per_pair * chunk * kv


@dataclass(frozen=True)
class PrefillModel:
    """t0 + causal FLOPs / (peak x e_causal) + cached FLOPs / (peak x e_cached)."""

    e_causal: float
    e_cached: float
    t0_s: float

    def predict(self, causal: np.ndarray, cached: np.ndarray, gpus: list[str]) -> np.ndarray:
        peak = np.array([GPUS[g][0] for g in gpus])
        return self.t0_s + causal / (peak * self.e_causal) + cached / (peak * self.e_cached)


def _arrays(rows: list[AttnRow]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """Decode rows: (FLOPs, bytes, seconds, GPUs); prefill rows: (causal FLOPs, cached FLOPs, ...)."""
    w = [
        attn_work(r.hidden, r.heads, r.kv_heads, r.tp, r.kind, r.batch, r.chunk, r.kv)
        if r.kind == "decode"
        else prefill_parts(r.hidden, r.heads, r.tp, r.chunk, r.kv)
        for r in rows
    ]
    a, b = (np.array(v, dtype=float) for v in zip(*w, strict=True))
    return a, b, np.array([r.ms / 1e3 for r in rows]), [r.gpu for r in rows]


def fit_prefill(causal: np.ndarray, cached: np.ndarray, seconds: np.ndarray, gpus: list[str]) -> PrefillModel:
    """(e_causal, e_cached, t0) minimizing the squared log error (operators.grid_fit, its parts summed)."""
    peak = np.array([GPUS[g][0] for g in gpus])
    _, e_causal, e_cached, t0 = grid_fit(causal / peak, cached / peak, seconds, np.add, 4, 31, 31)
    return PrefillModel(e_causal, e_cached, t0)


def fit_attention(rows: list[AttnRow]) -> dict[str, OpModel | PrefillModel]:
    """Decode's (e_flops, e_mem, t0) and prefill's (e_causal, e_cached, t0), each on its own rows."""
    fits = {"decode": fit_arrays, "prefill": fit_prefill}
    return {kind: fits[kind](*_arrays([r for r in rows if r.kind == kind])) for kind in KINDS}


def report_attention(rows: list[AttnRow]) -> str:
    """Fitted on the rows of at most FIT_CONTEXT tokens of context, the errors on the longer ones, beside
    today's step model's roofline (attention at Efficiency.attention of peak, memory of bandwidth)."""
    short, long = [r for r in rows if r.context <= FIT_CONTEXT], [r for r in rows if r.context > FIT_CONTEXT]
    fitted, eff = fit_attention(short), Efficiency()
    lines = [
        f"attention held out by context on {rows[0].gpu}: fitted on {len(short)} rows of at most "
        f"{FIT_CONTEXT:,} tokens of context, predicting {len(long)} longer",
        "",
        "| attention | held-out rows | e_flops (prefill: causal) | e_mem (prefill: cached) | t0 us | "
        "median error | p90 error | today's median | "
        "today's p90 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    today = OpModel(eff.attention, eff.memory, 0.0)
    for kind, m in fitted.items():
        held = [r for r in long if r.kind == kind]
        x, y, seconds, gpus = _arrays(held)
        new = errors(m.predict(x, y, gpus), seconds)
        work_of = [attn_work(r.hidden, r.heads, r.kv_heads, r.tp, kind, r.batch, r.chunk, r.kv) for r in held]
        old = errors(today.predict(*(np.array(v) for v in zip(*work_of, strict=True)), gpus), seconds)
        cells = [f"{np.median(a):.1%} | {np.quantile(a, 0.9):.1%}" for a in (new, old)]
        if isinstance(m, OpModel):
            params = f"{m.e_flops:.2f} | {m.e_mem:.2f} (p {m.p:g})"
        else:
            params = f"{m.e_causal:.2f} | {m.e_cached:.2f}"
        lines.append(f"| {kind} | {len(held)} | {params} | {m.t0_s * 1e6:.1f} | {' | '.join(cells)} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Shape:
    """A dense model's layer as the operators see it."""

    name: str
    heads: int
    kv_heads: int
    hidden: int
    expanded: int
    gated: bool  # a gated MLP (gate and up): Llama's; OPT's is one up projection and a ReLU
    rotary: bool  # rope on q and k (OPT learns its positions: no such operator)


SHAPES = {
    "opt-13b": Shape("OPT-13B", 40, 40, 5120, 20480, False, False),
    "llama-2-70b": Shape("Llama-2-70B", 64, 8, 8192, 28672, True, True),
}


def layer_ops_seconds(ops: dict[str, OpModel], shape: Shape, gpu: str, tp: int, tokens: int) -> float:
    """A layer's operators but attention (and the embedding, once a step: not a layer's) at `tokens` tokens
    on one TP rank."""
    row = Row(gpu, shape.name, shape.heads, shape.kv_heads, shape.hidden, shape.expanded, shape.gated, tokens,
              tp, {})  # fmt: skip
    layer = [op for op in OPS if op != "emb" and (shape.rotary or op != "attn_rope")]
    return float(sum(ops[op].predict(*(np.array([x]) for x in work(row, op)), [gpu])[0] for op in layer))


def decode_attention_seconds(
    attention: dict, shape: Shape, gpu: str, tp: int, kv_lens: list[int]
) -> float:  # fmt: skip
    """A layer's decode attention on one TP rank: one call over the batch, each sequence over its own
    kv_lens tokens (their work summed)."""
    w = [attn_work(shape.hidden, shape.heads, shape.kv_heads, tp, "decode", 1, 0, kv) for kv in kv_lens]
    return float(attention["decode"].predict(*(np.array([x]) for x in np.sum(w, axis=0)), [gpu])[0])


def prefill_attention_seconds(
    attention: dict, shape: Shape, gpu: str, tp: int, chunk: int, kv: int
) -> float:  # fmt: skip
    """A layer's prefill attention of a chunk after kv cached tokens, on one TP rank."""
    parts = prefill_parts(shape.hidden, shape.heads, tp, chunk, kv)
    return float(attention["prefill"].predict(*(np.array([x]) for x in parts), [gpu])[0])


def layer_seconds(
    ops: dict[str, OpModel],
    attention: dict,
    shape: Shape,
    gpu: str,
    tp: int,
    decode: list[int],
    prompts: list[tuple[int, int]],
) -> float:
    """One layer of a step on one TP rank (its collectives aside): the operators but the embedding at the
    step's tokens, decode attention over each decode's kv tokens, prefill attention for each (chunk, kv)."""
    tokens = len(decode) + sum(chunk for chunk, _ in prompts)
    seconds = layer_ops_seconds(ops, shape, gpu, tp, tokens)
    if decode:
        seconds += decode_attention_seconds(attention, shape, gpu, tp, decode)
    for chunk, kv in prompts:
        seconds += prefill_attention_seconds(attention, shape, gpu, tp, chunk, kv)
    return seconds


def interference(
    ops: dict[str, OpModel], attention: dict[str, OpModel], shape: Shape, gpu: str, tp: int, prompt: int,
    batch: int, kv: int,
) -> float:  # fmt: skip
    """A decode step of batch sequences at kv tokens with one prompt of `prompt` tokens batched in, over the
    same step without it, a layer's operators priced by the fitted models."""
    decode = [kv] * batch
    alone = layer_seconds(ops, attention, shape, gpu, tp, decode, [])
    return layer_seconds(ops, attention, shape, gpu, tp, decode, [(prompt, 0)]) / alone


def measured_interference(
    rows: list[Row], attn: list[AttnRow], model: str, gpu: str, tp: int, prompt: int, batch: int, kv: int
) -> float | None:
    """The same ratio from the profiles' own times: the model's layer operators (but the embedding) at the
    step's tokens, interpolated between the profiled token counts, and the attention rows of this batch at
    kv tokens and of the prompt as one chunk; None where the profiles lack a row it needs."""
    mine = sorted((r for r in rows if (r.model, r.gpu, r.tp) == (model, gpu, tp)), key=lambda r: r.tokens)
    dec = [r.ms for r in attn if (r.gpu, r.tp, r.kind, r.batch, r.kv) == (gpu, tp, "decode", batch, kv)]
    pre = [r.ms for r in attn if (r.gpu, r.tp, r.kind, r.chunk, r.kv) == (gpu, tp, "prefill", prompt, 0)]
    if not mine or not dec or not pre:
        return None
    tokens = np.array([r.tokens for r in mine], dtype=float)

    def ops_ms(n: int) -> float:
        return sum(
            float(np.interp(n, tokens, [r.ms.get(op, 0.0) for r in mine])) for op in OPS if op != "emb"
        )

    alone = ops_ms(batch) + dec[0]
    return (ops_ms(batch + prompt) + dec[0] + pre[0]) / alone


def fitted_params(rows: list[Row], attn: list[AttnRow], gpu: str) -> dict:
    """Every layer operator's and attention's fitted parameters on gpu's rows (what PARAMS holds)."""
    mine = [r for r in rows if r.gpu == gpu]
    ops = {op: fit(mine, op) for op in OPS if any(op in r.ms for r in mine)}
    attention = fit_attention([r for r in attn if r.gpu == gpu])
    return {
        "gpu": gpu,
        "rows": {"operators": len(mine), "attention": sum(r.gpu == gpu for r in attn)},
        "operators": {op: _to_json(m) for op, m in ops.items()},
        "attention": {kind: _to_json(m) for kind, m in attention.items()},
    }


def _to_json(m: OpModel | PrefillModel) -> dict:
    """A fitted model's fields; an OpModel's p null for the plain roofline's max (JSON has no infinity)."""
    d = asdict(m)
    if "p" in d and not math.isfinite(d["p"]):
        d["p"] = None
    return d


def _op_model(d: dict) -> OpModel:
    return OpModel(**{**d, "p": d["p"] if d["p"] is not None else math.inf})


def load_params(path: Path = PARAMS) -> tuple[dict[str, OpModel], dict, str]:
    """(operators, attention, gpu) from a file fitted_params wrote."""
    p = json.loads(Path(path).read_text())
    ops = {op: _op_model(m) for op, m in p["operators"].items()}
    a = p["attention"]
    return ops, {"decode": _op_model(a["decode"]), "prefill": PrefillModel(**a["prefill"])}, p["gpu"]


def report_interference(rows: list[Row], attn: list[AttnRow], gpu: str, prompts=(128, 1024)) -> str:
    """The ratio for each prompt length at a decode batch of 1 at 544 tokens of KV (DistServe's example's
    512 in / 64 out, halfway): from the profiles' times where they have the model, and from models fitted
    on gpu's rows of the other models (Llama-2-70B's left out) for Llama-2-70B and OPT-13B."""
    batch, kv = 1, 544
    others = [r for r in rows if r.gpu == gpu and r.model != "Llama-2-70b-hf"]
    ops = {op: fit(others, op) for op in OPS if any(op in r.ms for r in others)}
    attention = fit_attention([r for r in attn if r.gpu == gpu])
    lines = [
        f"a decode step (batch {batch} at {kv} tokens of KV) with one prompt batched in, over the step "
        f"without it, per layer on {gpu}",
        "",
        "| model | priced by | " + " | ".join(f"{p:,}-token prompt" for p in prompts) + " |",
        "| --- | --- |" + " ---: |" * len(prompts),
    ]
    measured = [measured_interference(rows, attn, "Llama-2-70b-hf", gpu, 2, p, batch, kv) for p in prompts]
    if all(m is not None for m in measured):
        lines.append("| Llama-2-70B, TP 2 | the profiles' operator times | " +
                     " | ".join(f"{m:.2f}x" for m in measured) + " |")  # fmt: skip
    for key, tp in (("llama-2-70b", 2), ("opt-13b", 1)):
        got = [interference(ops, attention, SHAPES[key], gpu, tp, p, batch, kv) for p in prompts]
        lines.append(f"| {SHAPES[key].name}, TP {tp} | operators fitted on the other models | " +
                     " | ".join(f"{g:.2f}x" for g in got) + " |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", type=Path, required=True, help="Vidur's data/profiling folder")
    parser.add_argument("--gpu", default="a100", help=f"the GPU fitted on, one of {tuple(GPUS)}")
    parser.add_argument("--write-params", type=Path, help="write the fitted parameters there (JSON)")
    args = parser.parse_args(argv)
    rows, attn = read_profiles(args.profiles), read_attention(args.profiles)
    if not any(r.gpu == args.gpu for r in attn):
        raise SystemExit(f"no attention rows of {args.gpu} under {args.profiles} (<gpu>/attention.csv): "
                         "fetch them with scripts/fetch_vidur_profiles.py")  # fmt: skip
    print(report_attention([r for r in attn if r.gpu == args.gpu]), end="\n\n")
    print(report_interference(rows, attn, args.gpu))
    if args.write_params:
        params = fitted_params(rows, attn, args.gpu)
        params["source"] = (
            "microsoft/vidur (MIT license) at the commits scripts/fetch_vidur_profiles.py reads: python -m "
            f"experiments.sim.attention_ops --profiles DIR --gpu {args.gpu} --write-params "
            f"{args.write_params.name}"
        )
        args.write_params.write_text(json.dumps(params, indent=1) + "\n")


if __name__ == "__main__":
    main()
