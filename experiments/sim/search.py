"""Placement search: for a GPU budget and SLOs, the xPyD ratio and TP per side with the highest goodput
per GPU (colocated placements compete too).

    python -m experiments.sim.search --model llama-3-8b --hardware h100 --gpus 8 --prompt 512 --output 64

Goodput of a placement is the highest Poisson rate whose SLO attainment meets the target (bisection;
attainment falls as the rate grows), divided by the GPUs it uses.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from experiments.sim.cost import CostModel, Efficiency
from experiments.sim.hardware import hardware
from experiments.sim.models import sim_model
from experiments.sim.simulate import (
    Instance,
    attainment,
    poisson_requests,
    simulate_colocated,
    simulate_disaggregated,
)


@dataclass(frozen=True)
class Placement:
    kind: str  # colocated | disaggregated
    prefill: int  # instances (colocated: the instance count)
    decode: int
    prefill_tp: int
    decode_tp: int

    @property
    def gpus(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    def __str__(self) -> str:
        if self.kind == "colocated":
            return f"{self.prefill}x colocated TP{self.prefill_tp}"
        return f"{self.prefill}P(TP{self.prefill_tp}) {self.decode}D(TP{self.decode_tp})"


def placements(gpus: int, tps: tuple[int, ...], heads: int) -> list[Placement]:
    """Every placement within the budget whose TP degrees divide the heads."""
    tps = tuple(t for t in tps if heads % t == 0 and t <= gpus)
    out = [Placement("colocated", gpus // t, 0, t, t) for t in tps]
    for tp_p in tps:
        for tp_d in tps:
            for x in range(1, gpus // tp_p + 1):
                for y in range(1, (gpus - x * tp_p) // tp_d + 1):
                    out.append(Placement("disaggregated", x, y, tp_p, tp_d))
    return out


def max_rate(run: Callable, n: int, prompt: int, output: int, ttft: float, tpot: float, target: float,
             tol: float = 0.02) -> float:  # fmt: skip
    """Highest Poisson rate meeting the target: double until one fails, then bisect."""

    def ok(rate: float) -> bool:
        reqs = poisson_requests(rate, n, prompt, output, seed=1)
        run(reqs)
        return attainment(reqs, ttft, tpot) >= target

    hi = 1.0
    while ok(hi) and hi < 1e6:
        hi *= 2
    lo = 0.0
    while hi - lo > tol * max(lo, 0.1):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def search(make_cost: Callable[[int], CostModel], gpus: int, tps=(1, 2, 4, 8), prompt=512, output=64,
           ttft=0.4, tpot=0.04, target=90.0, n=500) -> list[tuple[float, Placement]]:  # fmt: skip
    """(goodput per GPU, placement) for every placement, best first."""
    heads = make_cost(1).model.heads
    scored = []
    for p in placements(gpus, tps, heads):
        if p.kind == "colocated":

            def run(reqs, p=p):
                simulate_colocated([Instance(make_cost(p.prefill_tp)) for _ in range(p.prefill)], reqs)
        else:

            def run(reqs, p=p):
                pre = [Instance(make_cost(p.prefill_tp), chunked=False) for _ in range(p.prefill)]
                dec = [Instance(make_cost(p.decode_tp)) for _ in range(p.decode)]
                simulate_disaggregated(pre, dec, reqs)

        scored.append((max_rate(run, n, prompt, output, ttft, tpot, target) / p.gpus, p))
    return sorted(scored, key=lambda s: -s[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--ttft", type=float, default=0.4)
    ap.add_argument("--tpot", type=float, default=0.04)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args(argv)
    model, hw = sim_model(args.model), hardware(args.hardware)
    best = search(
        lambda tp: CostModel(model, hw, tp, Efficiency()), args.gpus, prompt=args.prompt, output=args.output,
        ttft=args.ttft, tpot=args.tpot, n=args.requests,
    )  # fmt: skip
    print(f"{model.name} on up to {args.gpus} x {hw.name}, {args.prompt} in / {args.output} out, "
          f"SLO P90 TTFT {args.ttft} s, TPOT {args.tpot} s")  # fmt: skip
    for goodput, p in best[: args.top]:
        print(f"{goodput:8.2f} req/s per GPU  {p}  ({p.gpus} GPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
