"""The PD survey's figures: DistServe's OPT-13B example, its prefill-decode interference figure, OPT-175B's
KV transfer against an A100 decode step.

DistServe's factors (`single-phase`, experiments/repro/distserve.py) are solved once so that a
prefill-only GPU serves the paper's 5.6 rps and a decode-only GPU its 10 rps; every other row here takes
them as they are, so the colocated and 2P1D goodputs, the interference ratios and OPT-175B's decode step
are predictions with nothing left to tune.
"""

from __future__ import annotations

import functools

from experiments.repro import distserve
from experiments.repro.claims import SIMULATED, Claim
from experiments.sim import attention_ops
from experiments.sim.cost import CostModel, Efficiency
from experiments.sim.hardware import hardware
from experiments.sim.models import sim_model
from experiments.sim.operator_cost import OperatorCost

SOURCE = "survey, quoting DistServe (OSDI'24)"
INTERFERENCE = {128: 1.8, 1024: 12.6}  # decode step with one prompt of this many tokens / without it
BATCH = 1  # the decode batch the interference is read at (the figure's smallest: its largest ratio)
OPT175_TOKENS = 2048
NVLINK_A100 = 600e9  # bytes/s, A100 SXM NVLink, both directions (the figure's link)


@functools.lru_cache(maxsize=4)
def fitted(n: int) -> Efficiency:
    """DistServe's single-phase factors at n requests a point (cached: several rows read them)."""
    return distserve.single_phase_efficiency(n)


def _assumed(e: Efficiency) -> str:
    return (
        f"A100-80GB datasheet; linear {e.linear:.2f}, memory {e.memory:.2f} solved on the prefill-only "
        f"and decode-only rows"
    )


def distserve_claims(n: int) -> list[Claim]:
    e = fitted(n)
    got = distserve.goodputs({"colocated": e, "disaggregated": e}, n)
    # the operator model, nothing solved: the layers from the A100 fits, the LM head at default efficiency
    base = Efficiency()
    operator = distserve.goodputs({"colocated": base, "disaggregated": base}, n, cost=OperatorCost)
    words = {
        "colocated": "colocated (vLLM) goodput",
        "prefill-only": "a prefill-only GPU's goodput (TTFT alone)",
        "decode-only": "a decode-only GPU's goodput (TPOT alone)",
        "2P1D": "2 prefill + 1 decode GPUs, goodput per GPU",
    }
    work = (
        f"OPT-13B, 512 in / 64 out, Poisson, P90 TTFT 0.4 s and TPOT 40 ms at 90%, {n} requests a point, "
        "no chunked prefill"
    )
    return [
        Claim(
            f"distserve-{key}",
            f"DistServe's example: {words[key]}",
            SOURCE + ", Fig. 1",
            paper,
            "rps/GPU",
            got[key],
            SIMULATED,
            f"{work}; {_assumed(e)}",
            fitted=key in ("prefill-only", "decode-only"),
            operator=operator[key],
        )
        for key, paper in distserve.PAPER.items()
    ]


def interference_ratio(cost: CostModel, prompt: int, batch: int, kv: int) -> float:
    """A decode step of `batch` sequences at KV length kv with one prompt of `prompt` tokens in it,
    against the same step without it."""
    decode = [kv] * batch
    return cost.step_time([(prompt, 0)], decode, sampled=batch + 1) / cost.decode_time(decode)


def profile_ratio(prompt: int, batch: int, kv: int, engine: str = "vllm") -> float:
    """The same ratio from DistServe's published A100 step profile (distserve.PROFILES), reading a mixed
    step as its prefill's time plus the decode batch's."""
    (a, b, c), (d0, d1, d2) = distserve.PROFILES[engine]["prefill"], distserve.PROFILES[engine]["decode"]
    decode = d0 + d1 * batch * kv + d2 * batch
    return (a + b * prompt + c * prompt**2 + decode) / decode


def operator_ratio(prompt: int, batch: int, kv: int) -> float:
    """The same ratio from the operator-level model: OPT-13B's layer on one A100, each operator priced by
    its fit on Vidur's A100 profiles of other models (attention_ops.PARAMS), per layer."""
    ops, attention, gpu = attention_ops.load_params()
    return attention_ops.interference(
        ops, attention, attention_ops.SHAPES["opt-13b"], gpu, 1, prompt, batch, kv
    )


def interference_claims(n: int) -> list[Claim]:
    e = fitted(n)
    cost = CostModel(sim_model("opt-13b"), hardware("a100-80gb"), 1, e)
    kv = distserve.PROMPT + distserve.OUTPUT // 2
    out = []
    for prompt, paper in INTERFERENCE.items():
        at16 = interference_ratio(cost, prompt, 16, kv)
        profile = profile_ratio(prompt, BATCH, kv)
        operator = operator_ratio(prompt, BATCH, kv)
        out.append(
            Claim(
                f"interference-{prompt}",
                f"a decode step with one {prompt:,}-token prompt batched in, against without",
                SOURCE + ", Fig. 2",
                paper,
                "x",
                interference_ratio(cost, prompt, BATCH, kv),
                SIMULATED,
                f"OPT-13B on one A100, a decode batch of {BATCH} at {kv} tokens of KV (at 16: {at16:.2f}x); "
                f"{_assumed(e)}",
                note=f"the roofline overlaps a step's GEMM time with its weight reads (the larger of the two "
                f"counts), where a real mixed step pays more of both; DistServe's own vLLM profile, read as "
                f"prefill time + decode time, gives {profile:.1f}x; the operator model ({operator:.2f}x, a "
                f"layer's operators fitted on Vidur's A100 profiles of other models, nothing on this row) "
                f"prices both near the ridge",
                operator=operator,
            )
        )
    return out


def opt175_claims(n: int) -> list[Claim]:
    model, hw = sim_model("opt-175b"), hardware("a100-80gb")
    kv_bytes = model.kv_bytes_per_token() * OPT175_TOKENS
    transfer_ms = 1e3 * kv_bytes / NVLINK_A100
    implied = kv_bytes / 17.6e-3 / 1e9
    e = fitted(n)
    cost = CostModel(model, hw, 8, e)
    step_ms = {b: 1e3 * cost.decode_time([OPT175_TOKENS] * b) for b in (1, 8)}
    operator_ms = 1e3 * OperatorCost(model, hw, 8, Efficiency()).decode_time([OPT175_TOKENS])
    return [
        Claim(
            "opt175b-kv-transfer",
            f"OPT-175B: moving a {OPT175_TOKENS:,}-token request's KV between GPUs",
            SOURCE,
            17.6,
            "ms",
            transfer_ms,
            SIMULATED,
            f"{kv_bytes / 1e9:.2f} GB of fp16 KV (96 layers x 12,288 x K and V) at NVLink's full 600 GB/s",
            note=f"17.6 ms is {implied:.0f} GB/s, {100 * implied / 600:.0f}% of NVLink's 600",
        ),
        Claim(
            "opt175b-decode-step",
            "OPT-175B: an A100 decode step, against which that transfer is small",
            SOURCE,
            30.0,
            "ms",
            step_ms[1],
            SIMULATED,
            f"TP 8 over 8 A100-80GB, one sequence at {OPT175_TOKENS:,} tokens of KV (8 sequences: "
            f"{step_ms[8]:.0f} ms); {_assumed(e)}",
            bound="range",
            paper_hi=50.0,
            operator=operator_ms,
        ),
    ]


def claims(n: int) -> list[Claim]:
    return distserve_claims(n) + interference_claims(n) + opt175_claims(n)


def measure_interference(
    model: str = "smollm2-135m",
    prompts=tuple(INTERFERENCE),
    batch: int = BATCH,
    rounds: int = 5,
    threads: int = 1,
) -> dict[int, float]:
    """The engine's own interference on this machine: the median decode step of `batch` sequences, and
    the median step that batches one prompt of each length in with them (bf16, `threads` threads, the
    torch kernels), as their ratio per prompt length."""
    import statistics
    import time

    import torch

    from engine import LLM, SamplingParams
    from pdkernels import ops

    torch.set_num_threads(threads)
    ops.set_backend("torch")
    budget = max(prompts) + batch
    llm = LLM(model, device="cpu", dtype="bfloat16", num_pages=512, max_num_batched_tokens=budget)
    long = SamplingParams(max_tokens=10_000, ignore_eos=True)
    running = {llm.add_request(list(range(100, 100 + 64 + i)), long) for i in range(batch)}
    waiting = set(running)
    while waiting:  # their prompts, until each decodes
        waiting -= {o.request_id for o in llm.step() if o.token_ids}

    def timed() -> float:
        t = time.perf_counter()
        llm.step()
        return time.perf_counter() - t

    decode = statistics.median(timed() for _ in range(3 * rounds))
    out = {}
    for n in prompts:
        mixed = []
        for r in range(rounds):
            llm.add_request(list(range(200 + r, 200 + r + n)), SamplingParams(max_tokens=1, ignore_eos=True))
            mixed.append(timed())  # the prompt, whole, beside the batch's decode
            timed()  # a decode step between, as the batch goes on
        out[n] = statistics.median(mixed) / decode
    return out
