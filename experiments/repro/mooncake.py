"""Mooncake's figures (FAST'25, quoted by the PD survey) and its conversation trace at cluster scale, in the
simulator.

- Long context, simulated: Mooncake (prefill and decode instances, KV layer-streamed) against vLLM of
  its time (every instance mixed, no chunked prefill: a long prompt stalls every decode in its batch),
  on the same GPUs; the highest Poisson rate meeting the SLO, over prompt lengths (the paper's "up to").
- Real load: the conversation trace (its first 1,000 lines in data/, the hour in ../shared/traces)
  replayed at its timestamps, compressed by a factor (trace_scale = 1 / factor), against colocated
  instances with prefix caching, PD without a pool (each instance its own cache) and PD with the pool
  every instance shares (Mooncake Store): the highest factor meeting the SLO.

The pool's page load time is the page over the instance's NICs (8 x 400 Gb/s at the comm efficiency),
as Mooncake's transfer engine reads it over RDMA; everything else is the cost model's defaults on
datasheet peaks, plus a fixed cost a step.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from experiments.config import WorkloadConfig
from experiments.repro.claims import SIMULATED, Claim
from experiments.sim.cost import CostModel, Efficiency
from experiments.sim.hardware import hardware
from experiments.sim.instance import TierSpec
from experiments.sim.models import sim_model
from experiments.sim.run import simulate_deployment
from experiments.sim.simulate import Instance, poisson_requests, simulate_colocated, simulate_disaggregated
from serving.config import DeploymentConfig, SloConfig

SOURCE = "survey, quoting Mooncake (FAST'25)"
# the trace's first 1,000 lines, kept here (data/README.md); the whole hour where a checkout has ../shared
TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_1000.jsonl"
WHOLE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
KEPT = 1000


def trace_path(n: int) -> Path:
    """Where the trace's first n lines are: the copy kept here, or the whole trace beside the checkout."""
    if n <= KEPT:
        return TRACE
    if not WHOLE.is_file():
        raise ValueError(
            f"the trace's first {n} requests need the whole trace at {WHOLE}; {TRACE} holds {KEPT}"
        )
    return WHOLE


STEP_S = 0.005  # the fixed cost a step (an assumption: launches, scheduling; the roofline has none)
TTFT_S, TPOT_S, TARGET = 10.0, 0.1, 90.0  # the SLO: P90 TTFT and TPOT, attainment in percent
LONG_PROMPTS = (8192, 16384, 32768)
LONG_OUTPUT = 512
PAGE = 16


def _eff() -> Efficiency:
    return Efficiency(step_overhead_s=STEP_S)


STALL_S = 1.0  # the note's SLO on every token: no gap between two of a request's tokens above this


def _meets(r, stall_s: float | None) -> bool:
    if r.done is None or r.ttft > TTFT_S or r.tpot > TPOT_S:
        return False
    return stall_s is None or max(np.diff(r.token_times), default=0.0) <= stall_s


def _max_rate(run, n: int, prompt: int, stall_s: float | None, tol: float = 0.05) -> float:
    """Highest Poisson rate at which TARGET percent of the requests meet the SLO (double, then bisect)."""

    def ok(rate: float) -> bool:
        reqs = poisson_requests(rate, n, prompt, LONG_OUTPUT, seed=1)
        run(reqs)
        return 100 * sum(_meets(r, stall_s) for r in reqs) / n >= TARGET

    lo, hi = 0.0, 0.25
    while ok(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > tol * max(lo, 0.05):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def long_context_gain(
    model_name: str, hw_name: str, prompt: int, n: int, stall_s: float | None = None
) -> tuple[float, float]:
    """(Mooncake 3P+1D's goodput, vLLM 4 mixed instances' goodput), every instance TP8, in req/s; stall_s:
    also hold every request's longest token gap to it."""
    model, hw = sim_model(model_name), hardware(hw_name)

    def inst(chunked: bool) -> Instance:
        return Instance(CostModel(model, hw, 8, _eff()), budget=max(prompt, 2048), chunked=chunked)

    def mooncake(reqs):
        return simulate_disaggregated([inst(False) for _ in range(3)], [inst(True)], reqs)

    def vllm(reqs):
        return simulate_colocated([inst(False) for _ in range(4)], reqs)

    return _max_rate(mooncake, n, prompt, stall_s), _max_rate(vllm, n, prompt, stall_s)


def _gain(ours: float, theirs: float) -> float:
    """Ours over theirs (a factor: 1.75 is the paper's +75%)."""
    return ours / theirs if theirs > 0 else float("inf")


def long_context_claim(n: int) -> Claim:
    gains = {p: long_context_gain("llama-3-70b", "a100-80gb", p, n) for p in LONG_PROMPTS}
    best = max(gains, key=lambda p: _gain(*gains[p]))
    each = ", ".join(f"{p // 1024}k: {a:.2f} vs {b:.2f} req/s" for p, (a, b) in gains.items())
    stalls = {p: long_context_gain("llama-3-70b", "a100-80gb", p, n, STALL_S) for p in LONG_PROMPTS}
    stall_best = max(_gain(*g) for g in stalls.values())
    stall_each = ", ".join(f"{p // 1024}k: {a:.2f} vs {b:.2f}" for p, (a, b) in stalls.items())
    return Claim(
        "mooncake-long-context",
        "Mooncake against vLLM on long-context simulated scenarios: up to +525% throughput",
        SOURCE + ", abstract",
        6.25,
        "x",
        _gain(*gains[best]),
        SIMULATED,
        f"Llama-3-70B, 4 instances of TP8 on A100-80GB (3 prefill + 1 decode against 4 mixed without chunked "
        f"prefill), {LONG_OUTPUT} out, Poisson, P90 TTFT {TTFT_S:g} s and TPOT {1e3 * TPOT_S:.0f} ms at "
        f"{TARGET:g}%, {n} requests; best of {each}; datasheet peaks, default efficiencies, "
        f"{1e3 * STEP_S:g} ms a step",
        note=f"a mixed instance's prefill stalls its batch for seconds, which a request's mean TPOT hides; "
        f"holding every token gap to {STALL_S:g} s too, the gain is up to {stall_best:.1f}x ({stall_each})",
    )


def trace_workload(n: int, factor: float) -> WorkloadConfig:
    return WorkloadConfig(
        dataset="mooncake",
        dataset_path=str(trace_path(n)),
        arrival="trace",
        num_requests=n,
        trace_scale=1 / factor,
    )


def deployments(nodes: int, model_name: str = "llama-3-70b") -> dict[str, tuple[DeploymentConfig, bool]]:
    """Name -> (deployment, with the shared pool): every instance one node of 8 GPUs, `nodes` in all; PD
    with one decode node (the trace's 12k-token prompts and 343-token replies keep prefill the
    bottleneck). TP8 everywhere but an MLA model's decode node, which runs attention data-parallel
    (DP8, as SGLang and vLLM serve DeepSeek): under TP8 every GPU holds every sequence's latent KV, and at
    3x the trace's rate that node ran out of KV (TPOT P90 1.2 s among the requests admission let in)."""
    mla = sim_model(model_name).mla
    pd = DeploymentConfig(
        name="pd", kind="disaggregated", num_prefill=nodes - 1, num_decode=1, prefill_tp=8,
        decode_tp=1 if mla else 8, decode_dp=8 if mla else 1,
    )  # fmt: skip
    return {
        "colocated": (DeploymentConfig(name="colocated", kind="colocated", num_workers=nodes, tp=8), False),
        "PD": (pd, False),
        "PD + pool": (pd, True),
    }


def replay(
    model_name: str, d: DeploymentConfig, pool: bool, n: int, factor: float, admission: bool = False
) -> dict:
    """One replay of the trace's first n requests at `factor` times its rate: attainment (percent of all
    requests), prefix hit rate, TTFT and TPOT P90 of those served, and the percent turned away at arrival
    (admission: the router's early rejection, deployment.admission=slo, held to the SLO here)."""
    model, hw = sim_model(model_name), hardware("h200")
    page_s = PAGE * model.kv_bytes_per_token() / (8 * hw.nic_bw * _eff().comm)
    tiers = TierSpec(0, 0, 1 << 40, page_s={"host": 0.0, "disk": 0.0, "pool": page_s}) if pool else None
    if admission:
        d = replace(d, admission="slo")
    slo = SloConfig(ttft_s=TTFT_S, tpot_s=TPOT_S, attainment=TARGET)
    run = simulate_deployment(  # the router (and its admission) picks the decode instance, as ours
        d, trace_workload(n, factor), model, hw, _eff(), page_size=PAGE, tiers=tiers, slo=slo, router="decode"
    )
    ttft, tpot, ok, cached, prompts, rejected = [], [], 0, 0, 0, 0
    for rid, r in run.results.items():
        prompts += len(run.requests[int(rid.removeprefix("req-"))].prompt_ids)
        if r.error:
            rejected += r.finish_reason == "rejected"
            continue
        first = r.token_times[0] - run.sent[rid]
        per = (
            (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) if len(r.token_times) > 1 else 0
        )
        ttft.append(first)
        tpot.append(per)
        ok += first <= TTFT_S and per <= TPOT_S
        cached += r.cached_tokens
    return {
        "attainment": 100 * ok / n,
        "hit_rate": cached / prompts,
        "ttft_p90": float(np.percentile(ttft, 90)) if ttft else float("inf"),
        "tpot_p90": float(np.percentile(tpot, 90)) if tpot else float("inf"),
        "rejected": 100 * rejected / n,
    }


def highest_factor(model_name: str, d: DeploymentConfig, pool: bool, n: int, iters: int = 7) -> float:
    """The largest rate factor (0.25-8x the trace's) at which the SLO's attainment holds."""
    lo, hi = 0.25, 8.0
    if replay(model_name, d, pool, n, lo)["attainment"] < TARGET:
        return 0.0
    for _ in range(iters):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if replay(model_name, d, pool, n, mid)["attainment"] >= TARGET else (lo, mid)
    return lo


@functools.lru_cache(maxsize=4)
def trace_table(model_name: str, n: int, nodes: int = 4) -> dict[str, dict]:
    """Per deployment: the highest rate factor meeting the SLO, and the replay at the trace's own rate."""
    out = {}
    for name, (d, pool) in deployments(nodes, model_name).items():
        out[name] = {"factor": highest_factor(model_name, d, pool, n), **replay(model_name, d, pool, n, 1.0)}
    return out


def trace_claim(n: int) -> Claim:
    t = trace_table("llama-3-70b", n)
    base, ours = t["colocated"]["factor"], t["PD + pool"]["factor"]
    return Claim(
        "mooncake-trace",
        "Mooncake on real load (the conversation trace): +75% requests served within the SLO",
        SOURCE + ", abstract",
        1.75,
        "x",
        _gain(ours, base),
        SIMULATED,
        f"the trace's first {n} requests at its timestamps compressed by a factor, the highest factor "
        f"meeting P90 TTFT {TTFT_S:g} s and TPOT {1e3 * TPOT_S:.0f} ms at {TARGET:g}% (colocated "
        f"{base:.2f}x, PD {t['PD']['factor']:.2f}x, PD + pool {ours:.2f}x); Llama-3-70B, 4 nodes of 8 x "
        f"H200 (4 colocated TP8 against 3P1D with the shared pool), prefix caching everywhere, pages of "
        f"{PAGE}; hit rate at 1x {100 * t['colocated']['hit_rate']:.0f}% colocated, "
        f"{100 * t['PD']['hit_rate']:.0f}% PD, {100 * t['PD + pool']['hit_rate']:.0f}% PD + pool",
    )


def claims(n: int) -> list[Claim]:
    return [long_context_claim(n), trace_claim(max(n, 500))]


MODELS = ("llama-3-70b", "deepseek-r1")


def cluster_table(n: int, overload: float, models=MODELS, nodes: int = 4) -> list[dict]:
    """Per model and deployment: the highest rate factor meeting the SLO, the replay at the trace's own
    rate, and at `overload` times it with and without early rejection."""
    rows = []
    for model in models:
        for name, (d, pool) in deployments(nodes, model).items():
            at = trace_table(model, n, nodes)[name]
            over = replay(model, d, pool, n, overload)
            shed = replay(model, d, pool, n, overload, admission=True)
            rows.append({"model": model, "deployment": name, **at, "over": over, "shed": shed})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="The Mooncake conversation trace at cluster scale, simulated")
    p.add_argument("--requests", type=int, default=1000, help="the trace's first N requests (>= 100)")
    p.add_argument("--overload", type=float, default=3.0, help="a rate factor past every deployment's (> 0)")
    p.add_argument("--models", default=",".join(MODELS), help=f"sim models, comma-separated ({MODELS})")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if args.requests < 100 or not args.overload > 0 or not models:
        p.error(f"--requests must be >= 100, --overload > 0 and --models name a model; got {vars(args)}")
    try:
        trace_path(args.requests)
    except ValueError as e:
        p.error(str(e))
    print(
        f"the trace's first {args.requests} requests, 4 nodes of 8 x H200 (colocated: 4 x TP8; PD: 3P1D, "
        "an MLA model's decode node DP8), "
        f"SLO P90 TTFT {TTFT_S:g} s and TPOT {1e3 * TPOT_S:.0f} ms at {TARGET:g}%; {1e3 * STEP_S:g} ms a step"
    )
    head = (
        "| model | deployment | highest rate factor | hit rate at 1x | TTFT p90 at 1x s | TPOT p90 at 1x ms "
        f"| within SLO at {args.overload:g}x | with early rejection: within SLO / turned away |"
    )
    print(head + "\n|" + " --- |" * 8)
    for r in cluster_table(args.requests, args.overload, tuple(models)):
        print(f"| {r['model']} | {r['deployment']} | {r['factor']:.2f} | {100 * r['hit_rate']:.0f}% | "
              f"{r['ttft_p90']:.2f} | {1e3 * r['tpot_p90']:.0f} | {r['over']['attainment']:.0f}% | "
              f"{r['shed']['attainment']:.0f}% / {r['shed']['rejected']:.0f}% |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
