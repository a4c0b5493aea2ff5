"""A large MoE on 8-GPU nodes: mixed prefill-decode nodes against one prefill node feeding decode nodes,
with the decode side TP-sharded or data-parallel, in the simulator.

    python -m experiments.repro.moe_study [--model deepseek-r1] [--hardware h200] [--prompt 1024]
        [--output 256] [--requests 3000] [--decode-nodes 1,2,3] [--step-overhead-ms 10]
        [--mtp 1] [--mtp-acceptance 0.85]

Every instance is one node (hardware.devices_per_node GPUs):
- TP8: every layer sharded over the node's 8 GPUs. With MLA the one latent KV head cannot be split, so
  each GPU holds every sequence's KV (and reads it every step).
- DP8: attention data-parallel (each GPU its own sequences and their KV), experts expert-parallel over
  the 8 GPUs with an all-to-all per MoE layer (as SGLang's and vLLM's DP attention + EP for DeepSeek).
Placements: one mixed node (colocated, chunked prefill; N mixed nodes behind a least-loaded router
serve about N times its rate), and 1 prefill node (TP8, whole prompts) + N decode nodes; the request
goes to the prefill node first and its KV streams to a decode node layer by layer over the NICs.

For each placement and SLO tier, the highest Poisson rate meeting the tier at 90% attainment (P90 TTFT,
P90 TPOT), and at that rate: per-user decode tokens/s (1 / P50 TPOT), P50 / P90 TTFT, output tokens/s
per GPU, and QPS per decode node (per node for mixed placements). Prefill node counts are fixed at one,
so a row's rate is capped by that node's prefill throughput once decode nodes are plentiful.

MTP (DeepSeek-V3's multi-token prediction as speculative decoding, --mtp k drafts a step, 0: off): each
placement again with its decode (or mixed) nodes verifying k drafts per sequence a step, each accepted
with --mtp-acceptance while the ones before it were (DeepSeek-V3 reports 85-90% for its one MTP module);
a verify step costs a (k + 1)-token chunk per sequence over its KV. The draft head's own pass (one layer
of 61, plus the LM head) is not costed.

Not modelled: expert load imbalance, all-to-all latency (bandwidth only), prefix caching, FP8 GEMM peaks
(the linear roofline uses the bf16 datasheet peak). The efficiency factors are the cost model's defaults,
not fitted to a GPU, plus a fixed cost per step (--step-overhead-ms, an assumption standing for kernel
launches, routing and collective latencies, which the roofline lacks: alone it puts a TP8 decode step of
one sequence at about 1.2 ms); or, with --efficiency, the factors and overheads that
experiments.sim.calibrate fitted to the engine's own MoE/MLA steps (random-deepseek-v3 timed on a GPU
against the h200 preset). Read the ratios between placements more than the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from experiments.metrics import percentiles
from experiments.sim.cost import CostModel, Efficiency
from experiments.sim.hardware import hardware
from experiments.sim.models import sim_model
from experiments.sim.search import max_rate
from experiments.sim.simulate import (
    Instance,
    poisson_requests,
    simulate_colocated,
    simulate_disaggregated,
)

# per-user decode speed tiers: P90 TPOT 20 ms (50 tok/s per user) and 50 ms (20 tok/s), P90 TTFT 2 s
TIERS = {"50 tok/s/user": (2.0, 0.020), "20 tok/s/user": (2.0, 0.050)}
TARGET = 90.0
CHUNK = 8192  # prefill tokens per step (chunked prefill budget of mixed nodes, whole prompts on prefill)


@dataclass(frozen=True)
class Setup:
    name: str
    mixed: int  # mixed nodes (0: disaggregated)
    decode: int  # decode nodes
    decode_dp: bool  # the decode side (or the mixed nodes) run DP attention + EP
    mtp: int = 0  # drafts verified per sequence a decode step (0: no speculation)

    @property
    def nodes(self) -> int:
        return self.mixed or 1 + self.decode


def setups(decode_nodes: list[int], mtp: int = 0) -> list[Setup]:
    out = []
    for dp in (False, True):
        side = "DP8" if dp else "TP8"
        for k in (0, mtp) if mtp else (0,):
            tag = f" + MTP{k}" if k else ""
            out += [Setup(f"1 mixed {side}{tag}", 1, 0, dp, k)]
            out += [Setup(f"1P TP8 + {n}D {side}{tag}", 0, n, dp, k) for n in decode_nodes]
    return out


def runner(s: Setup, model, hw, eff: Efficiency, acceptance: float = 0.0):
    g = hw.devices_per_node

    def node(dp: bool, chunked: bool = True, mtp: int = 0) -> Instance:
        cost = CostModel(model, hw, 1, eff, dp=g) if dp else CostModel(model, hw, g, eff)
        return Instance(
            cost, budget=CHUNK, max_seqs=4096, chunked=chunked, spec_k=mtp, spec_acceptance=acceptance
        )

    if s.mixed:
        return lambda reqs: simulate_colocated([node(s.decode_dp, mtp=s.mtp) for _ in range(s.mixed)], reqs)
    return lambda reqs: simulate_disaggregated(
        [node(False, chunked=False)], [node(s.decode_dp, mtp=s.mtp) for _ in range(s.decode)], reqs
    )


def measure(s: Setup, model, hw, eff, n, prompt, output, ttft, tpot, acceptance: float = 0.0) -> dict:
    run = runner(s, model, hw, eff, acceptance)
    rate = max_rate(run, n, prompt, output, ttft, tpot, TARGET, tol=0.05)
    row = {"setup": s.name, "rate": rate}
    if rate <= 0:
        return row
    reqs = poisson_requests(rate, n, prompt, output, seed=1)
    run(reqs)
    done = [r for r in reqs if r.done is not None]
    tpot, ttft = percentiles([r.tpot for r in done]), percentiles([r.ttft for r in done])
    span = max(r.done for r in done) - min(r.arrival for r in reqs)
    gpus = s.nodes * hw.devices_per_node
    row.update(
        user_tok_s=1 / tpot["p50"],
        ttft_p50=ttft["p50"],
        ttft_p90=ttft["p90"],
        tok_s_gpu=sum(r.output for r in done) / span / gpus,
        qps_node=rate / (s.mixed or s.decode),
    )
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="deepseek-r1")
    p.add_argument("--hardware", default="h200")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--decode-nodes", default="1,2,3")
    p.add_argument("--step-overhead-ms", type=float, default=10.0, help="fixed cost per step (assumption)")
    p.add_argument("--mtp", type=int, default=1, help="MTP drafts per decode step for the MTP rows (0: none)")
    p.add_argument("--mtp-acceptance", type=float, default=0.85, help="each draft's acceptance, in [0, 1)")
    p.add_argument(
        "--efficiency",
        type=Path,
        help="a JSON that experiments.sim.calibrate --out wrote: step costs fitted to the engine's measured "
        "MoE/MLA steps (then --step-overhead-ms is ignored: the fit has its own)",
    )
    args = p.parse_args(argv)
    if args.mtp < 0 or not 0 <= args.mtp_acceptance < 1:
        p.error(
            f"--mtp must be >= 0 and --mtp-acceptance in [0, 1); got {args.mtp} and {args.mtp_acceptance}"
        )
    model, hw = sim_model(args.model), hardware(args.hardware)
    try:
        decode_nodes = sorted({int(x) for x in args.decode_nodes.split(",")})
    except ValueError:
        decode_nodes = []
    if not decode_nodes or min(decode_nodes) < 1:
        p.error(f"--decode-nodes must be comma-separated integers >= 1, got {args.decode_nodes!r}")
    if args.efficiency:
        try:
            fitted = json.loads(args.efficiency.read_text())
            eff = Efficiency(**fitted["efficiency"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"--efficiency must be a JSON written by experiments.sim.calibrate --out: {e}")
        source = (f"efficiency fitted to {fitted['model']} steps on {fitted['device']} against "
                  f"{fitted['hardware']} (rms error {100 * fitted['rms_relative_error']:.0f}%)")  # fmt: skip
    else:
        eff = Efficiency(step_overhead_s=args.step_overhead_ms / 1e3)
        source = f"datasheet peaks, default efficiencies, {args.step_overhead_ms:g} ms a step"
    weights = model.params() * model.bytes_per_param / 1e9
    node_gb = hw.hbm_bytes * hw.devices_per_node / 1e9
    if weights >= node_gb:
        p.error(f"{model.name} needs {weights:.0f} GB of weights; a node of {hw.devices_per_node} x "
                f"{hw.name} holds {node_gb:.0f} GB")  # fmt: skip
    print(f"{model.name} ({weights:.0f} GB of weights) on nodes of {hw.devices_per_node} x {hw.name} "
          f"({source}); {args.prompt} in / "
          f"{args.output} out, Poisson, "
          f"{args.requests} requests a point; goodput at {TARGET:g}% within P90 TTFT / TPOT"
          + (f"; MTP{args.mtp} rows: each draft accepted with p = {args.mtp_acceptance:g}"
             if args.mtp else ""))  # fmt: skip
    for tier, (ttft, tpot) in TIERS.items():
        print(f"\n{tier}: P90 TTFT <= {ttft} s, P90 TPOT <= {1e3 * tpot:.0f} ms")
        print(f"{'placement':<29}{'nodes':>6}{'req/s':>8}{'QPS/decode node':>17}{'user tok/s':>12}"
              f"{'TTFT p50/p90 s':>16}{'tok/s/GPU':>11}")  # fmt: skip
        for s in setups(decode_nodes, args.mtp):
            row = measure(
                s, model, hw, eff, args.requests, args.prompt, args.output, ttft, tpot, args.mtp_acceptance
            )
            if row["rate"] <= 0:
                print(f"{s.name:<29}{s.nodes:>6}{'-':>8}  (misses the tier at any rate)")
                continue
            print(f"{s.name:<29}{s.nodes:>6}{row['rate']:>8.2f}{row['qps_node']:>17.2f}"
                  f"{row['user_tok_s']:>12.1f}{row['ttft_p50']:>8.2f} /{row['ttft_p90']:>5.2f}"
                  f"{row['tok_s_gpu']:>11.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
