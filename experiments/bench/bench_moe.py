"""An MoE layer's MLP against a dense MLP of the same active parameters, per step, on the CPU.

Qwen3-30B-A3B's expert geometry scaled to one layer that fits any machine: hidden 2048, 128 experts of
width 768, top 8, so a token's active MLP is 8 x 768 = 6,144 wide, the dense MLP it is compared with.
A decode step of batch B routes B x 8 (token, expert) pairs: at B = 1 the MoE reads the dense MLP's bytes
(8 experts); at B = 32 it reads most of the 128 experts, which is why MoE decode is bound by the distinct
experts a step touches, not by its active parameters. Prefill (B = 512) is compute-bound for both.
The routing is the model's own (engine.moe.route), on a seeded random router.
PDKERNELS_BENCH_DTYPE=bfloat16 runs in bf16 (default float32: this VM's fast CPU path).
"""

import os

import pytest
import torch

from engine.config import MoEConfig
from engine.moe import experts, route

HIDDEN, NUM_EXPERTS, TOP_K, WIDTH = 2048, 128, 8, 768
DTYPE = getattr(torch, os.environ.get("PDKERNELS_BENCH_DTYPE", "float32"))
ROUNDS = int(os.environ.get("PDKERNELS_BENCH_ROUNDS", "5"))
MOE = MoEConfig(num_experts=NUM_EXPERTS, top_k=TOP_K, intermediate_size=WIDTH, layers=(0,))


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator().manual_seed(0)
    h, f = HIDDEN, WIDTH
    return {
        "router": torch.randn(NUM_EXPERTS, h, generator=g).to(DTYPE) * h**-0.5,
        "gate_up": (torch.randn(NUM_EXPERTS, 2 * f, h, generator=g) * h**-0.5).to(DTYPE),
        "down": (torch.randn(NUM_EXPERTS, h, f, generator=g) * f**-0.5).to(DTYPE),
        "dense_gate_up": (torch.randn(2 * TOP_K * f, h, generator=g) * h**-0.5).to(DTYPE),
        "dense_down": (torch.randn(h, TOP_K * f, generator=g) * f**-0.5).to(DTYPE),
    }


def moe_mlp(w, x):
    weights, ids = route(x, w["router"], MOE)
    return experts(x, weights, ids, w["gate_up"], w["down"])


def dense_mlp(w, x):
    gate, up = torch.nn.functional.linear(x, w["dense_gate_up"]).chunk(2, dim=-1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w["dense_down"])


@pytest.mark.benchmark(group="moe-mlp")
@pytest.mark.parametrize("tokens", [1, 8, 32, 512])
@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_mlp_step(benchmark, weights, kind, tokens):
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(DTYPE)
    fn = moe_mlp if kind == "moe" else dense_mlp
    with torch.inference_mode():
        benchmark.pedantic(fn, args=(weights, x), rounds=ROUNDS, iterations=1, warmup_rounds=1)
        _, ids = route(x, weights["router"], MOE)
    benchmark.extra_info["experts_touched"] = len(ids.unique()) if kind == "moe" else None
