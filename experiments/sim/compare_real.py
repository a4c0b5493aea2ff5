"""The simulator against a measured run: same deployments, workload and rates, P50/P90 TTFT and TPOT.

    python -m experiments.sim.compare_real RUN_DIR/results.json [--calibrate-from CAL_DIR/results.json]
        [--hardware cpu-this-machine]
    python -m experiments.sim.compare_real RUN_DIR/results.json --linear 0.75 --memory 0.2 [--overhead-ms ..]

Reads the measured run's config, simulates each deployment at each rate on that run's own requests
(their arrival times and lengths, from results.json), and prints measured and simulated latencies
with the simulator's error. The cost model's factors come from calibrate.calibrate_from_run on the
steps a real run timed (by default the compared run itself; another run of the same config makes the
check held-out), or are given. This project's workers sample the first token on the decode side and
route every request through a decode worker, so the simulation does too.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from experiments.config import from_cfg
from experiments.metrics import request_rows, summarize
from experiments.sim.calibrate import calibrate_from_run
from experiments.sim.cost import Efficiency
from experiments.sim.hardware import load_hardware
from experiments.sim.models import sim_model
from experiments.sim.run import simulate_deployment


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--hardware", default="cpu-this-machine")
    ap.add_argument("--calibrate-from", type=Path, help="a run whose step timelines fit the factors")
    ap.add_argument("--linear", type=float, help="give the factors instead of calibrating")
    ap.add_argument("--memory", type=float, default=0.20)
    ap.add_argument("--overhead-ms", type=float, default=0.0)
    ap.add_argument("--seq-overhead-ms", type=float, default=0.0)
    ap.add_argument("--prefill-slowdown", type=float, default=1.0)
    args = ap.parse_args(argv)
    saved = json.loads(args.results.read_text())
    hw = load_hardware(args.hardware)
    if args.linear is not None:
        eff = Efficiency(args.linear, args.linear, args.memory, step_overhead_s=args.overhead_ms / 1e3,
                         seq_overhead_s=args.seq_overhead_ms / 1e3)  # fmt: skip
        slowdown, source = args.prefill_slowdown, "given"
    else:
        source = args.calibrate_from or args.results
        cal = calibrate_from_run(json.loads(Path(source).read_text()), hw)
        eff, slowdown = cal["efficiency"], cal["prefill_slowdown"]
    config = from_cfg(saved["config"])
    model, slo = sim_model(config.model.name), config.slo
    deployments = {d.name: d for d in config.deployments}
    print(f"{model.name} on {hw.name} ({hw.source}); factors ({source}): linear {eff.linear:.2f}, "
          f"memory {eff.memory:.2f}, overhead {1e3 * eff.step_overhead_s:.1f} ms a step + "
          f"{1e3 * eff.seq_overhead_s:.2f} ms a sequence, prefill slowdown {slowdown:.2f}")  # fmt: skip
    print(f"{'run':<22}{'metric':<10}{'measured ms':>12}{'sim ms':>9}{'error':>8}")
    errors = []
    for rec in saved["runs"]:
        workload = replace(config.workload, rate=rec["rate"])
        d = deployments[rec["deployment"]]
        reqs = sorted(rec["requests"], key=lambda r: r["arrival_s"])
        trace = tuple([r[k] for r in reqs] for k in ("arrival_s", "prompt_tokens", "output_tokens"))
        sim = simulate_deployment(
            d, workload, model, hw, eff, first_token_on="decode", chunked=True, prefill_slowdown=slowdown,
            trace=trace, router="decode",
        )  # fmt: skip
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
