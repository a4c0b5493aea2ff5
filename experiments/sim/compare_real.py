"""The simulator against a measured run: same deployments, workload and rates, P50/P90 TTFT and TPOT.

    python -m experiments.sim.compare_real RUN_DIR/results.json [--calibrate-from CAL_DIR/results.json]
        [--hardware cpu-this-machine]
    python -m experiments.sim.compare_real RUN_DIR/results.json --calibrate-rate 0.5 [--save-slim OUT.json]
    python -m experiments.sim.compare_real RUN_DIR/results.json --linear 0.75 --memory 0.2 [--overhead-ms ..]
    ... [--contention CONTENTION.json]

Reads the measured run's config, simulates each deployment at each rate on that run's own requests
(their arrival times and lengths, from results.json), and prints measured and simulated latencies
with the simulator's error. The cost model's factors come from calibrate.calibrate_from_run on the
steps a real run timed (by default the compared run itself; another run of the same config, or the
run's own records at one rate with --calibrate-rate, makes the check held-out), or are given. This
project's workers sample the first token on the decode side and route every request through a decode
worker, so the simulation does too. A multiturn run's later turns are sent when they were, but never
before think_time_s after the simulated reply they extend; each instance's prefix cache is as large as
the run's model.num_pages; the prefix cache hit rate, the KV sent (in tokens: the run's dtype and the
preset's differ) and TTFT p50 per turn are compared too. --contention (a file `python -m
experiments.sim.contention --out` wrote on this machine): the workers share the machine, each step
slowed by its neighbours' (calibrated on the steps' times alone, simulated with the neighbours priced).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from experiments.config import from_cfg
from experiments.metrics import label, request_rows, summarize
from experiments.sim.calibrate import FitAtBound, calibrate_from_run
from experiments.sim.contention import Contention
from experiments.sim.cost import Efficiency
from experiments.sim.hardware import load_hardware
from experiments.sim.instance import TierSpec
from experiments.sim.models import sim_model
from experiments.sim.run import simulate_deployment

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def tier_spec(config, model, summary: dict) -> TierSpec | None:
    """The run's kv_tiers in pages (a slot: header and payload in whole 4 KiB blocks, as engine/kv/pages.py
    lays them out), and each tier's load time per page as the run measured it."""
    from engine.kv.pages import ALIGN, HEADER_BYTES

    t = config.kv_tiers
    if not t.host_bytes:
        return None
    page = config.model.page_size
    payload = page * model.kv_bytes_per_token() // model.activation_bytes * DTYPE_BYTES[config.model.dtype]
    slot = -(-(HEADER_BYTES + payload) // ALIGN) * ALIGN
    spec = TierSpec(
        t.host_bytes // slot,
        t.disk_bytes // slot,
        t.store_bytes // slot if t.store != "none" else 0,
        decode_loads=t.decode_loads,
    )
    for tier, c in summary.get("kv_tiers", {}).items():
        if c["hit_tokens"] and c["loads"]:
            spec.page_s[tier] = c["load_mean_s"] * c["loads"] / (c["hit_tokens"] / page)
    return spec


def with_rates(saved: dict, keep) -> dict:
    """saved with only the runs whose rate keep(rate) accepts."""
    return {**saved, "runs": [rec for rec in saved["runs"] if keep(rec["rate"])]}


_REQUEST_KEYS = ("arrival_s", "prompt_tokens", "output_tokens", "prefill", "prefill_worker", "ttft_s")
_SUMMARY_KEYS = ("ttft_s", "tpot_s", "transfer_bytes", "prefix_hit_rate", "kv_tiers", "by_turn")


def slim(saved: dict, calibrate_rate: float | None, timelines: bool = True) -> dict:
    """What compare and calibrate read of saved, for a check to replay (tests/experiments/sim/fixtures):
    the config; per run its summary's latencies and counters and its requests' arrivals, lengths and
    prefill placement; the step timelines of the runs at calibrate_rate only (none: timelines=False);
    times to 0.1 ms."""

    def short(x):
        return round(x, 4) if isinstance(x, float) else x

    def timeline(t: dict) -> dict:
        steps = [[short(v) for v in s[:5]] + s[5:] for s in t["steps"]]  # the prompt chunks and KV too
        return {"name": t["name"], "role": t["role"], "steps": steps}

    def request(r: dict) -> dict:
        keys = _REQUEST_KEYS + (("conversation", "turn") if "conversation" in r else ())
        return {k: short(r[k]) for k in keys}

    return {
        "config": saved["config"],
        "runs": [
            {
                "deployment": rec["deployment"],
                "rate": rec["rate"],
                "summary": {k: rec["summary"][k] for k in _SUMMARY_KEYS if k in rec["summary"]},
                "requests": [request(r) for r in rec["requests"]],
                "timelines": [
                    timeline(t) for t in rec["timelines"] if timelines and rec["rate"] == calibrate_rate
                ],
            }
            for rec in saved["runs"]
        ],
    }


@dataclass(frozen=True)
class Row:
    run: str  # deployment @rate
    metric: str
    unit: str  # ms | % | tokens
    measured: float
    simulated: float

    @property
    def error(self) -> float:
        return self.simulated / self.measured - 1 if self.measured else 0.0


def with_link(hw, config, d):
    """hw with the run's link where its workers ran on shaped links (launcher=netns): each NIC at the
    link's rate, cluster.nics_per_host of them, shared by the min(prefill, decode) TP ranks the
    simulator sends over."""
    if config.launcher.name != "netns":
        return hw
    from serving.fleet.netns import Link

    cluster = config.launcher.cluster
    links = min(d.prefill_tp, d.decode_tp)
    return replace(hw, nic_bw=Link(**cluster.link).bytes_per_s() * cluster.nics_per_host / links)


def compare(saved: dict, hw, eff: Efficiency, slowdown: float, contention=None) -> list[Row]:
    """Simulate each run of saved (a results.json) on its own requests with the given factors (on its
    own link: with_link; its KV per layer or whole, as transfer.send_mode says; its workers on one
    machine, with contention), and pair what it measured with what the simulator predicts."""
    config = from_cfg(saved["config"])
    layerwise = config.transfer.send_mode != "request"
    model, slo = sim_model(config.model.name), config.slo
    deployments = {d.name: d for d in config.deployments}
    rows = []
    for rec in saved["runs"]:
        workload = replace(config.workload, rate=rec["rate"])
        d = deployments[rec["deployment"]]
        sent = [r for r in rec["requests"] if r["arrival_s"] is not None]
        reqs = sorted(sent, key=lambda r: r["arrival_s"])
        keys = ("arrival_s", "prompt_tokens", "output_tokens")
        keys += ("conversation", "turn") if reqs and "conversation" in reqs[0] else ()
        trace = tuple([r[k] for r in reqs] for k in keys)
        sim = simulate_deployment(
            d, workload, model, with_link(hw, config, d), eff, first_token_on="decode", layerwise=layerwise,
            chunked=True, prefill_slowdown=slowdown,
            trace=trace, router="decode", page_size=config.model.page_size,
            cache_pages=config.model.num_pages, tiers=tier_spec(config, model, rec["summary"]),
            colocated_kv_tokens=config.model.num_pages * config.model.page_size, contention=contention,
        )  # fmt: skip
        simulated = summarize(sim, request_rows(sim, slo), slo, rec["rate"])
        name = label(rec)
        pairs = [
            (f"{key[:4].upper()} {q}", "ms", rec["summary"][key][q], simulated[key][q])
            for key in ("ttft_s", "tpot_s")
            for q in ("p50", "p90")
        ]
        if "by_turn" in rec["summary"]:
            pairs += [
                (f"TTFT turn {real['turn'] + 1}", "ms", real["ttft_p50_s"], ours["ttft_p50_s"])
                for real, ours in zip(rec["summary"]["by_turn"], simulated["by_turn"], strict=False)
                if real["ttft_p50_s"] and ours["ttft_p50_s"]
            ]
        if d.prefix_caching:
            pairs.append(("prefix hit", "%", rec["summary"]["prefix_hit_rate"], simulated["prefix_hit_rate"]))
        for tier, real in rec["summary"].get("kv_tiers", {}).items():
            ours = simulated["kv_tiers"].get(tier, {}).get("hit_tokens", 0)
            pairs.append((f"{tier} hits", "tokens", real["hit_tokens"], ours))
        if not d.colocated:  # in tokens: the run's dtype and the preset's differ
            dtype = config.model.dtype if config.model.dtype != "auto" else "float32"  # auto, on a CPU
            real_bytes = model.kv_bytes_per_token() // model.activation_bytes * DTYPE_BYTES[dtype]
            real_sent = rec["summary"]["transfer_bytes"] / real_bytes
            sim_sent = simulated["transfer_bytes"] / model.kv_bytes_per_token()
            pairs.append(("KV sent", "tokens", real_sent, sim_sent))
        rows += [Row(name, metric, unit, real, ours) for metric, unit, real, ours in pairs]
    return rows


def latency_errors(rows: list[Row]) -> list[float]:
    """|error| of every latency row (TTFT and TPOT p50/p90, TTFT per turn)."""
    return [abs(r.error) for r in rows if r.unit == "ms"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--hardware", default="cpu-this-machine")
    ap.add_argument("--calibrate-from", type=Path, help="a run whose step timelines fit the factors")
    ap.add_argument("--calibrate-rate", type=float, help="fit on the records at this rate, compare the rest")
    ap.add_argument("--save-slim", type=Path, help="with --calibrate-rate: write what the check reads here")
    ap.add_argument("--linear", type=float, help="give the factors instead of calibrating")
    ap.add_argument("--memory", type=float, default=0.20)
    ap.add_argument("--overhead-ms", type=float, default=0.0)
    ap.add_argument("--seq-overhead-ms", type=float, default=0.0)
    ap.add_argument("--prefill-slowdown", type=float, default=1.0)
    ap.add_argument(
        "--contention", type=Path, help="the neighbours' model (experiments.sim.contention --out)"
    )
    args = ap.parse_args(argv)
    saved = json.loads(args.results.read_text())
    hw = load_hardware(args.hardware)
    contention = Contention.load(args.contention) if args.contention else None
    if args.linear is not None:
        eff = Efficiency(args.linear, args.linear, args.memory, step_overhead_s=args.overhead_ms / 1e3,
                         seq_overhead_s=args.seq_overhead_ms / 1e3)  # fmt: skip
        slowdown, source = args.prefill_slowdown, "given"
    else:
        if args.calibrate_rate is not None and args.calibrate_from is not None:
            ap.error("give --calibrate-from or --calibrate-rate, not both")
        if args.save_slim is not None and args.calibrate_rate is None:
            ap.error("--save-slim needs --calibrate-rate (the rate whose step timelines it keeps)")
        if args.calibrate_rate is not None:
            rates = sorted({rec["rate"] for rec in saved["runs"]})
            if args.calibrate_rate not in rates or len(rates) < 2:
                ap.error(f"--calibrate-rate must be one of this run's rates {rates} and it must have another")
            if args.save_slim:
                args.save_slim.write_text(json.dumps(slim(saved, args.calibrate_rate), separators=(",", ":")))
            cal_run = with_rates(saved, lambda rate: rate == args.calibrate_rate)
            saved = with_rates(saved, lambda rate: rate != args.calibrate_rate)
            source = f"{args.results} at {args.calibrate_rate:g} req/s"
        else:
            source = args.calibrate_from or args.results
            cal_run = json.loads(Path(source).read_text())
        try:
            cal = calibrate_from_run(cal_run, hw, contention=contention)
        except FitAtBound as e:
            ap.error(f"--hardware {args.hardware}: {e}")
        eff, slowdown = cal["efficiency"], cal["prefill_slowdown"]
    model = sim_model(from_cfg(saved["config"]).model.name)
    print(f"{model.name} on {hw.name} ({hw.source}); factors ({source}): linear {eff.linear:.2f}, "
          f"memory {eff.memory:.2f}, overhead {1e3 * eff.step_overhead_s:.1f} ms a step + "
          f"{1e3 * eff.seq_overhead_s:.2f} ms a sequence, prefill slowdown {slowdown:.2f}")  # fmt: skip
    print(f"{'run':<22}{'metric':<16}{'measured':>12}{'sim':>9}{'error':>8}")
    rows = compare(saved, hw, eff, slowdown, contention)
    for r in rows:
        scale = {"ms": 1e3, "%": 100}.get(r.unit, 1)
        name = f"{r.metric} {r.unit}"
        print(f"{r.run:<22}{name:<16}{scale * r.measured:>12.0f}{scale * r.simulated:>9.0f}"
              f"{100 * r.error:>7.0f}%")  # fmt: skip
    errors = latency_errors(rows)
    print(f"latencies: mean |error| {100 * sum(errors) / len(errors):.0f}%, worst {100 * max(errors):.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
