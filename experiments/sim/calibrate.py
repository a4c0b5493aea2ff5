"""Fit the cost model's efficiency factors to step times measured on the real engine here.

    python -m experiments.sim.calibrate [--model smollm2-135m] [--threads 1]

1. Measure this machine as the cost model sees a device, with the worker's thread count: bf16 matmul
   FLOP/s and memory copy bandwidth (a Hardware preset with source "measured here").
2. Time real forward passes of the engine: prefills of several prompt lengths and decode steps of
   several batch sizes (best of a few).
3. Fit linear/attention efficiency, memory efficiency and a fixed per-step overhead by least squares on
   the relative error (a grid; the roofline's max() rules out a closed form), and print each point's
   measured and fitted time.
The fitted factors go into conf/sim.yaml's `efficiency` (with `hardware` set to this machine's preset)
to simulate the real deployments.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import dataclass

import numpy as np

from experiments.sim.cost import CostModel, Efficiency
from experiments.sim.hardware import Hardware
from experiments.sim.models import sim_model


@dataclass(frozen=True)
class Point:
    kind: str  # prefill | decode
    size: int  # prompt tokens, or decode batch size
    kv: int  # decode: KV length per sequence
    seconds: float


def predict(cost: CostModel, p: Point) -> float:
    if p.kind == "prefill":
        return cost.prefill_time([p.size])
    return cost.decode_time([p.kv] * p.size)


def fit(model, hw: Hardware, points: list[Point], tp: int = 1) -> tuple[Efficiency, float]:
    """Efficiency minimising the mean squared relative error over points; returns it and that error.

    A grid over the linear (= attention) and memory efficiencies; for each, the best step overhead has
    a closed form: minimising sum(((pred + oh - meas) / meas)^2) gives oh = sum((meas - pred) / meas^2)
    / sum(1 / meas^2), kept >= 0."""
    meas = np.array([p.seconds for p in points])
    w = 1 / meas**2
    best = (np.inf, None)
    for lin, mem in itertools.product(np.linspace(0.05, 1.0, 20), np.linspace(0.05, 1.0, 20)):
        base = Efficiency(linear=float(lin), attention=float(lin), memory=float(mem))
        preds = np.array([predict(CostModel(model, hw, tp, base), p) for p in points])
        oh = max(0.0, float(np.sum((meas - preds) * w) / np.sum(w)))
        err = float(np.mean((preds + oh - meas) ** 2 * w))
        if err < best[0]:
            best = (err, Efficiency(float(lin), float(lin), float(mem), step_overhead_s=oh))
    return best[1], best[0]


def measure_hardware(threads: int) -> Hardware:
    import os

    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(1024, 1024, dtype=torch.bfloat16), torch.randn(1024, 1024, dtype=torch.bfloat16)
    flops = 2 * 1024**3 / _best(lambda: a @ b)
    x = torch.empty(64 << 20, dtype=torch.uint8)
    y = torch.empty_like(x)
    bw = 2 * x.numel() / _best(lambda: y.copy_(x))  # read + write
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware("cpu-measured", flops, bw, mem, bw, bw, devices_per_node=1, source="measured here")


def _best(fn, rounds: int = 5) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure_engine(
    model_name: str, threads: int, prompts=(32, 128, 512), batches=(1, 8, 32), kv=128
) -> list[Point]:
    import torch

    from engine import LLM, SamplingParams
    from pdkernels import ops

    torch.set_num_threads(threads)
    ops.set_backend("torch")
    llm = LLM(model_name, dtype="bfloat16", num_pages=512, max_num_batched_tokens=max(prompts))
    points = []
    for n in prompts:
        times = []
        for _ in range(3):
            llm.add_request(list(range(100, 100 + n)), SamplingParams(max_tokens=1, ignore_eos=True))
            t = time.perf_counter()
            llm.step()
            times.append(time.perf_counter() - t)
        points.append(Point("prefill", n, 0, min(times)))
    for b in batches:
        for _ in range(b):
            llm.add_request(list(range(100, 100 + kv)), SamplingParams(max_tokens=5, ignore_eos=True))
        while any(len(s.output_ids) == 0 for s in llm.seqs.values() if not s.finished):
            llm.step()  # the prompts (they sample their first token)
        times = []
        while llm.has_unfinished():
            t = time.perf_counter()
            llm.step()
            times.append(time.perf_counter() - t)
        points.append(Point("decode", b, kv + 2, min(times)))
    return points


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    hw = measure_hardware(args.threads)
    print(
        f"this machine, {args.threads} thread(s): {hw.flops / 1e9:.0f} GFLOP/s bf16 matmul, "
        f"{hw.hbm_bw / 1e9:.1f} GB/s copy"
    )
    points = measure_engine(args.model, args.threads)
    model = sim_model(args.model)
    eff, err = fit(model, hw, points)
    print(
        f"fitted: linear/attention {eff.linear:.2f}, memory {eff.memory:.2f}, step overhead "
        f"{1e3 * eff.step_overhead_s:.1f} ms (rms relative error {100 * err**0.5:.1f}%)"
    )
    cost = CostModel(model, hw, 1, eff)
    print(f"{'step':<16}{'measured ms':>12}{'model ms':>10}{'error':>8}")
    for p in points:
        pred = predict(cost, p)
        label = f"{p.kind} {p.size}" + (f" x kv {p.kv}" if p.kind == "decode" else "")
        print(f"{label:<16}{1e3 * p.seconds:>12.1f}{1e3 * pred:>10.1f}{100 * (pred / p.seconds - 1):>7.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
