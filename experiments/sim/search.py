"""Placement search: for a GPU budget and SLOs, the xPyD ratio and TP per side with the highest goodput
per GPU (colocated placements compete too).

    python -m experiments.sim.search sim_model=llama-3-8b hardware=h100 gpus=8 prompt=512 output=64
    python -m experiments.sim.search -m gpus=4,8 hardware=h100,h200      # a sweep: one search.json each
    python -m experiments.sim.search sim_model=deepseek-r1 hardware=h200 gpus=16 "tps=[1,8]" "dps=[1,8]"

Goodput of a placement is the highest Poisson rate whose SLO attainment meets the target (bisection;
attainment falls as the rate grows), divided by the GPUs it uses.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import hydra

from experiments.config import run_job
from experiments.sim.cost import CostModel, Efficiency
from experiments.sim.models import sim_model
from experiments.sim.simulate import (
    Instance,
    attainment,
    poisson_requests,
    simulate_colocated,
    simulate_disaggregated,
)
from serving.config import of_dict, slo_of


@dataclass(frozen=True)
class Placement:
    kind: str  # colocated | disaggregated
    prefill: int  # instances (colocated: the instance count)
    decode: int
    prefill_tp: int
    decode_tp: int
    prefill_dp: int = 1  # attention data-parallel groups per instance (CostModel.dp)
    decode_dp: int = 1

    @property
    def gpus(self) -> int:
        return (
            self.prefill * self.prefill_tp * self.prefill_dp + self.decode * self.decode_tp * self.decode_dp
        )

    def __str__(self) -> str:
        def side(tp: int, dp: int) -> str:
            return f"TP{tp}" + (f" DP{dp}" if dp > 1 else "")

        if self.kind == "colocated":
            return f"{self.prefill}x colocated {side(self.prefill_tp, self.prefill_dp)}"
        return (f"{self.prefill}P({side(self.prefill_tp, self.prefill_dp)}) "
                f"{self.decode}D({side(self.decode_tp, self.decode_dp)})")  # fmt: skip


def placements(gpus: int, tps: tuple[int, ...], heads: int, dps: tuple[int, ...] = (1,)) -> list[Placement]:
    """Every placement within the budget whose TP degrees divide the heads; each instance TP x DP wide
    (DP: attention data-parallel, experts expert-parallel over the instance)."""
    shapes = [(t, d) for t in tps for d in dps if heads % t == 0 and t * d <= gpus]
    out = [Placement("colocated", gpus // (t * d), 0, t, t, d, d) for t, d in shapes]
    for tp_p, dp_p in shapes:
        for tp_d, dp_d in shapes:
            w_p, w_d = tp_p * dp_p, tp_d * dp_d
            for x in range(1, gpus // w_p + 1):
                for y in range(1, (gpus - x * w_p) // w_d + 1):
                    out.append(Placement("disaggregated", x, y, tp_p, tp_d, dp_p, dp_d))
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


def search(make_cost: Callable[[int, int], CostModel], gpus: int, tps=(1, 2, 4, 8), prompt=512, output=64,
           ttft=0.4, tpot=0.04, target=90.0, n=500, dps=(1,)) -> list[tuple[float, Placement]]:  # fmt: skip
    """(goodput per GPU, placement) for every placement whose instances hold the weights, best first.
    make_cost(tp, dp)."""
    heads = make_cost(1, 1).model.heads

    def fits(tp: int, dp: int) -> bool:
        cost = make_cost(tp, dp)
        return cost.weight_bytes_per_rank() < cost.hw.hbm_bytes

    scored = []
    for p in placements(gpus, tps, heads, dps):
        if not (fits(p.prefill_tp, p.prefill_dp) and fits(p.decode_tp, p.decode_dp)):
            continue
        if p.kind == "colocated":

            def run(reqs, p=p):
                cost = make_cost(p.prefill_tp, p.prefill_dp)
                simulate_colocated([Instance(cost) for _ in range(p.prefill)], reqs)
        else:

            def run(reqs, p=p):
                pre = [
                    Instance(make_cost(p.prefill_tp, p.prefill_dp), chunked=False) for _ in range(p.prefill)
                ]
                dec = [Instance(make_cost(p.decode_tp, p.decode_dp)) for _ in range(p.decode)]
                simulate_disaggregated(pre, dec, reqs)

        scored.append((max_rate(run, n, prompt, output, ttft, tpot, target) / p.gpus, p))
    return sorted(scored, key=lambda s: -s[0])


def run_search(cfg, out_dir: Path) -> list[tuple[float, Placement]]:
    from omegaconf import OmegaConf

    from experiments.sim.hardware import hardware_of

    c = OmegaConf.to_container(cfg, resolve=True)
    model, hw = sim_model(c["sim_model"]), hardware_of(c["hardware"])
    eff = of_dict(Efficiency, "efficiency", c["efficiency"])
    slo = slo_of(c)
    for key in ("gpus", "prompt", "output", "requests"):
        if not (isinstance(c[key], int) and c[key] > 0):
            raise ValueError(f"{key}={c[key]!r} is not allowed: must be an integer > 0")
    for key in ("tps", "dps"):
        values = c.get(key) or [1]
        if not all(isinstance(v, int) and v >= 1 for v in values):
            raise ValueError(f"{key}={values!r} is not allowed: a list of integers >= 1")
    best = search(
        lambda tp, dp: CostModel(model, hw, tp, eff, dp=dp), c["gpus"], tuple(c["tps"]), c["prompt"],
        c["output"], slo.ttft_s, slo.tpot_s, slo.attainment, c["requests"], tuple(c.get("dps") or [1]),
    )  # fmt: skip
    print(f"{model.name} on up to {c['gpus']} x {hw.name}, {c['prompt']} in / {c['output']} out, "
          f"SLO P90 TTFT {slo.ttft_s} s, TPOT {slo.tpot_s} s")  # fmt: skip
    for goodput, p in best[: c["top"]]:
        print(f"{goodput:8.2f} req/s per GPU  {p}  ({p.gpus} GPUs)")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"goodput_per_gpu": g, "placement": str(p), **asdict(p), "gpus": p.gpus} for g, p in best]
    (out_dir / "search.json").write_text(json.dumps({"config": c, "placements": rows}, indent=1))
    return best


@hydra.main(version_base=None, config_path="../../conf", config_name="search")
def main(cfg) -> None:
    run_job(run_search, cfg)


if __name__ == "__main__":
    main()
