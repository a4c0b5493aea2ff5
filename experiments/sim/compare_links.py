"""The simulator's link model against runs over shaped links: calibrated on one link rate, the others'
TTFT predicted.

    python -m experiments.sim.compare_links RUN/results.json RUN/results.json ... [--calibrate-on 0]
        [--hardware cpu-this-machine]

Each results.json is a run with launcher=netns (hosts in network namespaces, serving/fleet/netns.py)
at its own cluster.link.rate: the same model, deployments and workload otherwise. On the calibration run
(by default the first) the compute factors are fitted to its workers' step timelines (as compare_real
does), then the link's efficiency (Efficiency.comm: the share of the link's rate a transfer reaches,
UCX over TCP beside the control messages and headers) by bisection, so that its simulated TTFT p50
equals the measured one. Every run is then simulated with those factors on its own requests (their
arrivals and lengths), its link at its own rate times cluster.nics_per_host, the KV streamed per layer
or sent whole as its transfer.send_mode says (the simulator: each layer's pages leave as each pass
computes them, one request's after another's on the prefill side's link: simulate.prefilled), and its
measured and simulated TTFT p50 / p90 and TPOT p50 are printed with the error.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from experiments.config import from_cfg
from experiments.sim.calibrate import FitAtBound, at_bound, calibrate_from_run
from experiments.sim.compare_real import Row, compare
from experiments.sim.cost import Efficiency
from experiments.sim.hardware import load_hardware

TTFT_P50 = "TTFT p50"


def link_rate(saved: dict) -> str:
    config = from_cfg(saved["config"])
    if config.launcher.name != "netns":
        raise ValueError(
            f"a run over shaped links is a launcher=netns run; this one is {config.launcher.name}"
        )
    return config.launcher.cluster.link["rate"]


def fit_comm(saved: dict, hw, eff: Efficiency, slowdown: float, low=0.02, high=1.0, steps=30) -> float:
    """The link efficiency at which saved's simulated TTFT p50 (every deployment's, summed) is its
    measured one: the simulated TTFT falls as the efficiency rises."""

    def gap(comm: float) -> float:
        rows = [r for r in compare(saved, hw, replace(eff, comm=comm), slowdown) if r.metric == TTFT_P50]
        return sum(r.simulated - r.measured for r in rows)

    if gap(high) > 0 or gap(low) < 0:
        raise ValueError(f"no link efficiency in [{low}, {high}] matches the measured TTFT p50")
    for _ in range(steps):
        mid = (low + high) / 2
        low, high = (mid, high) if gap(mid) > 0 else (low, mid)
    return (low + high) / 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, nargs="+", help="results.json of runs at different link rates")
    ap.add_argument(
        "--calibrate-on", type=int, default=0, help="the run (its index) the factors are fitted to"
    )
    ap.add_argument("--hardware", default="cpu-this-machine")
    ap.add_argument(
        "--allow-bound",
        action="store_true",
        help="keep a fitted factor on its grid's bound (a run of one-at-a-time requests has decode-only "
        "steps on its decode worker, which leave the linear factor unidentified), printed as such",
    )
    args = ap.parse_args(argv)
    runs = [json.loads(p.read_text()) for p in args.results]
    if not 0 <= args.calibrate_on < len(runs):
        ap.error(f"--calibrate-on must be in [0, {len(runs)})")
    rates = [link_rate(saved) for saved in runs]
    hw = load_hardware(args.hardware)
    calibration = runs[args.calibrate_on]
    try:
        cal = calibrate_from_run(calibration, hw, allow_bound=args.allow_bound)
    except FitAtBound as e:
        ap.error(f"{e}; --allow-bound keeps it")
    eff, slowdown = cal["efficiency"], cal["prefill_slowdown"]
    if at_bound(eff):
        print(f"warning: {', '.join(at_bound(eff))} sits on the fit's bound: the steps do not determine it")
    eff = replace(eff, comm=fit_comm(calibration, hw, eff, slowdown))
    print(f"calibrated on {rates[args.calibrate_on]}: linear {eff.linear:.2f}, memory {eff.memory:.2f}, "
          f"prefill slowdown {slowdown:.2f}, link efficiency {eff.comm:.3f}")  # fmt: skip
    print(f"{'link':<10}{'run':<22}{'metric':<12}{'measured ms':>12}{'sim ms':>9}{'error':>8}")
    worst: list[Row] = []
    for rate, saved in zip(rates, runs, strict=True):
        for r in compare(saved, hw, eff, slowdown):
            if r.metric in (TTFT_P50, "TTFT p90", "TPOT p50"):
                print(f"{rate:<10}{r.run:<22}{r.metric:<12}{1e3 * r.measured:>12.0f}{1e3 * r.simulated:>9.0f}"
                      f"{100 * r.error:>7.0f}%")  # fmt: skip
                if r.metric.startswith("TTFT") and rate != rates[args.calibrate_on]:
                    worst.append(r)
    if worst:
        top = max(worst, key=lambda r: abs(r.error))
        print(f"held-out TTFT: worst |error| {100 * abs(top.error):.0f}% ({top.run}, {top.metric})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
