"""The simulator against a measured run: same deployments, workload and rates, P50/P90 TTFT and TPOT.

    python -m experiments.sim.compare_real RUN_DIR/results.json [--hardware cpu-this-machine]
        [--linear 0.75 --memory 0.20 --overhead-ms 0.9]

Reads the measured run's config, simulates each deployment at each rate on the same requests (one
draw serves both), and prints measured and simulated latencies with the simulator's error. This
project's workers sample the first token on the decode side, so the simulation does too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from experiments.config import DeploymentConfig, LengthDist, SloConfig, WorkloadConfig
from experiments.metrics import request_rows, summarize
from experiments.sim.cost import Efficiency
from experiments.sim.models import sim_model
from experiments.sim.run import hardware_of, simulate_deployment

CONF = Path(__file__).resolve().parents[2] / "conf"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--hardware", default="cpu-this-machine")
    ap.add_argument("--linear", type=float, default=0.75)
    ap.add_argument("--memory", type=float, default=0.20)
    ap.add_argument("--overhead-ms", type=float, default=0.9)
    args = ap.parse_args(argv)
    saved = json.loads(args.results.read_text())
    cfg = saved["config"]
    hw = hardware_of(yaml.safe_load((CONF / "hardware" / f"{args.hardware}.yaml").read_text()))
    eff = Efficiency(args.linear, args.linear, args.memory, step_overhead_s=args.overhead_ms / 1e3)
    model = sim_model(cfg["model"]["name"])
    w = dict(cfg["workload"])
    w["prompt_len"], w["output_len"] = LengthDist(**w["prompt_len"]), LengthDist(**w["output_len"])
    deployments = {d["name"]: DeploymentConfig(**d) for d in cfg["deployments"]}
    slo = SloConfig(**cfg["slo"])
    print(f"{model.name} on {hw.name} ({hw.source}); efficiency linear {eff.linear}, memory {eff.memory}, "
          f"overhead {args.overhead_ms} ms")  # fmt: skip
    print(f"{'run':<22}{'metric':<10}{'measured ms':>12}{'sim ms':>9}{'error':>8}")
    errors = []
    for rec in saved["runs"]:
        workload = WorkloadConfig(**{**w, "rate": rec["rate"]})
        d = deployments[rec["deployment"]]
        sim = simulate_deployment(d, workload, model, hw, eff, first_token_on="decode", chunked=True)
        simulated = summarize(sim, request_rows(sim, slo), slo, rec["rate"])
        for key in ("ttft_s", "tpot_s"):
            for q in ("p50", "p90"):
                real, ours = rec["summary"][key][q], simulated[key][q]
                err = ours / real - 1
                errors.append(abs(err))
                label, metric = f"{rec['deployment']} @{rec['rate']:g}/s", f"{key[:4].upper()} {q}"
                print(f"{label:<22}{metric:<10}{1e3 * real:>12.0f}{1e3 * ours:>9.0f}{100 * err:>7.0f}%")
    print(f"mean |error| {100 * sum(errors) / len(errors):.0f}%, worst {100 * max(errors):.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
