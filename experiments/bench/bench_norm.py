"""The residual add + RMSNorm that opens each half of a layer, on the CPU: the torch ops the model ran
(an add, then the norm's float/pow/mean/rsqrt/mul/cast/mul) against the fused C++ pass behind
pdkernels.ops.add_rms_norm. SmolLM2's hidden 576; rows: a batch-1 decode step, batch 20, a 512-token
chunk. A SmolLM2 step makes 61 such calls. PDKERNELS_BENCH_DTYPE=bfloat16 runs in bf16.
"""

import os

import pytest
import torch

from pdkernels import cpu, ops
from pdkernels.norm import add_rms_norm_ref

DTYPE = getattr(torch, os.environ.get("PDKERNELS_BENCH_DTYPE", "float32"))
HIDDEN = 576


@pytest.mark.benchmark(group="add-rms-norm")
@pytest.mark.parametrize("rows", [1, 20, 512])
@pytest.mark.parametrize("kind", ["torch", "fused"])
def test_add_rms_norm(benchmark, kind, rows):
    if kind == "fused" and cpu.module() is None:
        pytest.skip("no C++ extension here")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, HIDDEN, generator=g).to(DTYPE)
    residual = (torch.randn(rows, HIDDEN, generator=g) * 1e-3).to(DTYPE)
    weight = torch.ones(HIDDEN, dtype=DTYPE)
    if kind == "torch":  # what engine.model ran before: a new stream tensor, then the norm

        def step():
            return add_rms_norm_ref(x + residual, weight, 1e-5)
    else:

        def step():
            return ops.add_rms_norm(x, weight, 1e-5, residual, validate=False)

    benchmark.pedantic(step, rounds=200 if rows < 512 else 30, iterations=1, warmup_rounds=10)
