"""The disaggregation blog's figures (Perplexity, "Disaggregated Prefill and Decode", 2025): DeepSeek-R1 and
Qwen3-Coder-480B on nodes of 8 x H200, in the simulator.

The blog gives no workload, so these rows assume one (PROMPT, OUTPUT: long search-context prompts,
answers of a few hundred tokens) and the cost model's default efficiencies on datasheet peaks, plus a
fixed cost a step that the roofline lacks (launches, routing, collective latency). That one cost is
solved so the blog's headline row holds (1 prefill node feeding 3 decode nodes: 90 tok/s per user at 1
QPS a decode node); every other row is then a prediction with nothing left to tune, and a row that
misses says which value of which assumption would reproduce it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

from experiments.metrics import percentiles
from experiments.repro.claims import SIMULATED, Claim
from experiments.repro.moe_study import Setup, runner
from experiments.sim.cost import CostModel, Efficiency
from experiments.sim.hardware import hardware
from experiments.sim.instance import Instance
from experiments.sim.models import sim_model
from experiments.sim.search import max_rate
from experiments.sim.simulate import poisson_requests, simulate_disaggregated

SOURCE = "blog: Perplexity, Disaggregated Prefill and Decode"
PROMPT, OUTPUT = 4096, 512  # the assumed workload: tokens in, tokens out
QPS_PER_DECODE_NODE = 1.0
TARGET_TPS = 90.0  # the headline row's per-user speed, which the step cost is solved for
TTFT_S, TARGET = 2.0, 90.0  # the Qwen3-Coder ratio's SLO: P90 TTFT, attainment in percent
HW = "h200"


def run(
    setup: Setup, rate: float, n: int, overhead_s: float, prompt: int = PROMPT, model: str = "deepseek-r1"
):
    """(per-user tok/s from P50 TPOT, TTFT P50 s, TTFT P90 s) of one placement at one Poisson rate."""
    reqs = poisson_requests(rate, n, prompt, OUTPUT, seed=1)
    runner(setup, sim_model(model), hardware(HW), Efficiency(step_overhead_s=overhead_s))(reqs)
    done = [r for r in reqs if r.done is not None]
    tpot, ttft = percentiles([r.tpot for r in done]), percentiles([r.ttft for r in done])
    return 1 / tpot["p50"], ttft["p50"], ttft["p90"]


def solve(f: Callable[[float], float], target: float, lo: float, hi: float, rising: bool, iters: int = 12):
    """x in [lo, hi] where f(x) reaches target (bisection; f rising or falling in x)."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        if (f(mid) < target) == rising:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


DISAGG = Setup("1P TP8 + 3D TP8", 0, 3, False)
MIXED = Setup("1 mixed TP8", 1, 0, False)
MIXED4 = Setup("4 mixed TP8", 4, 0, False)
MIXED_DP = Setup("1 mixed DP8", 1, 0, True)


@functools.lru_cache(maxsize=4)
def step_overhead(n: int) -> float:
    """The fixed cost a step at which 1P3D serves TARGET_TPS a user at 1 QPS a decode node."""
    rate = QPS_PER_DECODE_NODE * DISAGG.decode
    return solve(lambda s: run(DISAGG, rate, n, s)[0], TARGET_TPS, 0.0, 0.03, rising=False)


def _assumed(n: int, s: float) -> str:
    return (
        f"DeepSeek-R1 (FP8) on nodes of 8 x H200, datasheet peaks, default efficiencies, {1e3 * s:.1f} ms a "
        f"step (solved on `r1-1p3d`); {PROMPT:,} in / {OUTPUT} out, Poisson, {n} requests"
    )


def r1_claims(n: int) -> list[Claim]:
    s = step_overhead(n)
    disagg = run(DISAGG, 3 * QPS_PER_DECODE_NODE, n, s)
    mixed = run(MIXED, QPS_PER_DECODE_NODE, n, s)
    mixed4 = run(MIXED4, 3 * QPS_PER_DECODE_NODE, n, s)
    dp = run(MIXED_DP, 8 * QPS_PER_DECODE_NODE, n, s)
    # which prompt length brings a mixed node's users down to 50 tok/s at 1 QPS
    stall_prompt = solve(lambda p: run(MIXED, 1.0, n, s, prompt=int(p))[0], 50.0, 1024, 65536, rising=False)
    dp_rate = solve(lambda q: run(MIXED_DP, q, n, s)[0], 50.0, 0.25, 8.0, rising=False, iters=8)
    added = disagg[1] - mixed4[1]
    return [
        Claim(
            "r1-1p3d",
            "DeepSeek-R1, 1 prefill node feeding 3 decode nodes: per-user speed at 1 QPS a decode node",
            SOURCE,
            TARGET_TPS,
            "tok/s",
            disagg[0],
            SIMULATED,
            _assumed(n, s),
            bound="above",
            fitted=True,
        ),
        Claim(
            "r1-mixed",
            "DeepSeek-R1 on mixed prefill-decode nodes (prefill stalls the batch): per-user speed",
            SOURCE,
            50.0,
            "tok/s",
            mixed[0],
            SIMULATED,
            f"one mixed TP8 node at 1 QPS, chunked prefill of 8,192 tokens a step; {_assumed(n, s)}",
            bound="below",
            note=f"a mixed node's users fall to 50 tok/s at 1 QPS with prompts of {stall_prompt:,.0f} tokens",
        ),
        Claim(
            "r1-ttft-added",
            "DeepSeek-R1: TTFT that disaggregation adds",
            SOURCE,
            100.0,
            "ms",
            1e3 * added,
            SIMULATED,
            f"TTFT P50 of 1P3D against 4 mixed TP8 nodes, both at 3 QPS (P90: "
            f"{1e3 * (disagg[2] - mixed4[2]):+.0f} ms); KV streamed layer by layer over 8 x 400 Gb/s a node; "
            f"{_assumed(n, s)}",
            note="the layer-streamed KV of a 4k prompt (288 MB) hides behind its prefill; what is left is "
            "the one prefill node's queue, and the hand-off and scheduling latency the simulator does not "
            "model",
        ),
        Claim(
            "r1-dp",
            "DeepSeek-R1, DP attention, 8 ranks a node at 1 QPS a rank: per-user speed",
            SOURCE,
            50.0,
            "tok/s",
            dp[0],
            SIMULATED,
            f"one mixed DP8 + EP8 node at 8 QPS; {_assumed(n, s)}",
            note=f"a DP8 node's users reach 50 tok/s at {dp_rate:.2f} QPS a node: each rank prefills its "
            f"{PROMPT:,}-token prompts alone, stalling its own batch",
        ),
    ]


def _prefill_node(model, s: float) -> Instance:
    return Instance(
        CostModel(model, hardware(HW), 8, Efficiency(step_overhead_s=s)), budget=8192, chunked=False
    )


def decode_node_qps(model, s: float, tpot: float) -> tuple[float, int]:
    """(requests a second, batch) one TP8 decode node serves at steps of at most tpot: the largest batch
    whose step (every sequence at the mean KV length) fits in tpot and in the node's KV, over the time it
    keeps a request (Little's law)."""
    node = _prefill_node(model, s)
    kv = PROMPT + OUTPUT // 2
    fits = int(node.kv_capacity_tokens // (PROMPT + OUTPUT))
    lo, hi = 0, max(fits, 0)
    while lo < hi:  # the step grows with the batch: the largest batch within tpot
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if node.cost.decode_time([kv] * mid) <= tpot else (lo, mid - 1)
    return (lo / (OUTPUT * node.cost.decode_time([kv] * lo)) if lo else 0.0), lo


def qwen_ratio(model, n: int, s: float, tpot: float) -> tuple[float, float, float, int]:
    """(decode nodes per prefill node, the prefill node's goodput, a decode node's, its batch)."""

    def prefill_only(reqs):  # one prefill node judged on TTFT alone, ample decode behind it
        return simulate_disaggregated(
            [_prefill_node(model, s)], [_prefill_node(model, s) for _ in range(8)], reqs
        )

    prefill = max_rate(prefill_only, n, PROMPT, OUTPUT, TTFT_S, None, TARGET, tol=0.05)
    decode, batch = decode_node_qps(model, s, tpot)
    return prefill / decode, prefill, decode, batch


def qwen_claims(n: int) -> list[Claim]:
    """Decode nodes a prefill node keeps busy, both TP8, at the R1 rows' step cost and 50 tok/s a user."""
    s = step_overhead(n)
    model, tpot = sim_model("qwen3-coder-480b-a35b"), 1 / 50
    ratio, prefill, decode, batch = qwen_ratio(model, n, s, tpot)
    fp8 = replace(model, bytes_per_param=1)  # the FP8 checkpoint Qwen publishes beside the bf16 one
    fp8_ratio, fp8_prefill, *_ = qwen_ratio(fp8, n, s, tpot)
    # the step time at which FP8 decode nodes need the blog's 3 per prefill node
    three = solve(
        lambda t: fp8_prefill / max(decode_node_qps(fp8, s, t)[0], 1e-9), 3.0, tpot, 3 * tpot, rising=False
    )
    return [
        Claim(
            "qwen3-coder-ratio",
            "Qwen3-Coder-480B, TP8 on both sides: decode nodes per prefill node",
            SOURCE,
            3.0,
            "D/P",
            ratio,
            SIMULATED,
            f"a prefill node's goodput at P90 TTFT {TTFT_S:g} s ({prefill:.1f} QPS, simulated) over a "
            f"decode node's at steps within {1e3 * tpot:.0f} ms ({decode:.2f} QPS: a batch of {batch}, "
            f"Little's law); "
            f"bf16 weights, 8 x H200 a node, {1e3 * s:.1f} ms a step (from `r1-1p3d`); {PROMPT:,} in / "
            f"{OUTPUT} out, {n} requests",
            note=f"FP8 weights: {fp8_ratio:.1f}; FP8 with steps within {1e3 * three:.0f} ms "
            f"({1 / three:.0f} tok/s a user): 3. A decode step reads every expert its batch's tokens touch, "
            f"so within 20 ms its batch stays small",
        )
    ]


def claims(n: int) -> list[Claim]:
    return r1_claims(n) + qwen_claims(n)
