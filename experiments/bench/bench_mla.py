"""MLA decode attention on the CPU: the absorbed form over the latent rows against decompressing them.

DeepSeek-V3's latent (kv_lora_rank 512, rope 64; nope and v 128) for the 16 heads one of 8 TP ranks
holds, a decode step of B sequences of L tokens each. Three ways to the same output (before o_proj):
- "absorbed": q_nope W_UK, then pdkernels.ops.mla_decode_attention over the 576-wide rows as they lie
  (the CPU path: one gather per sequence, two batched matmuls for all heads), then W_UV;
- "reference": the same absorbed math, one sequence at a time, token by token (mla_decode_attention_ref);
- "decompressed": the context's rows through kv_b_proj into per-head 192-wide keys and 128-wide values
  (engine.mla.decompress, what prefill does), then the paged decode attention over them.
Decompressing costs L x heads x 512 x 256 multiply-adds per sequence a step; the absorbed form reads the
latent once. PDKERNELS_BENCH_DTYPE=bfloat16 runs in bf16 (default float32: this VM's fast CPU path).
"""

import os

import pytest
import torch

from engine.mla import decompress
from pdkernels import ops
from pdkernels.mla_decode import mla_decode_attention_ref
from pdkernels.testing import make_paged_cache

HEADS, RANK, ROPE, NOPE, V = 16, 512, 64, 128, 128
PAGE = 16
DTYPE = getattr(torch, os.environ.get("PDKERNELS_BENCH_DTYPE", "float32"))
ROUNDS = int(os.environ.get("PDKERNELS_BENCH_ROUNDS", "5"))
SCALE = (NOPE + ROPE) ** -0.5


def _case(batch: int, tokens: int):
    g = torch.Generator().manual_seed(batch * tokens)
    case = make_paged_cache([tokens] * batch, 1, 1, PAGE, fill=False)  # the page table
    rows = torch.randn(case.cache.shape[0], PAGE, RANK + ROPE, generator=g).to(DTYPE)
    layer = {
        "w_uk": (torch.randn(HEADS, NOPE, RANK, generator=g) * RANK**-0.5).to(DTYPE),
        "w_uv": (torch.randn(HEADS, V, RANK, generator=g) * RANK**-0.5).to(DTYPE),
    }
    q_nope = torch.randn(batch, HEADS, NOPE, generator=g).to(DTYPE)
    q_pe = torch.randn(batch, HEADS, ROPE, generator=g).to(DTYPE)
    tables = (case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    return layer, rows, q_nope, q_pe, tables


def absorbed(layer, rows, q_nope, q_pe, tables, reference=False):
    q_lat = torch.bmm(q_nope.transpose(0, 1), layer["w_uk"]).transpose(0, 1)
    args = (q_lat, q_pe, rows[..., :RANK], rows[..., RANK:], *tables)
    o = (
        mla_decode_attention_ref(*args, SCALE)
        if reference
        else ops.mla_decode_attention(*args, SCALE, validate=False)
    )
    return torch.bmm(o.transpose(0, 1), layer["w_uv"].transpose(1, 2)).transpose(0, 1)


def decompressed(layer, rows, q_nope, q_pe, tables):
    indptr, indices, last = tables
    cache = decompress(layer, rows[..., :RANK], rows[..., RANK:], indices, NOPE)
    dim = cache.shape[-1]
    q = torch.nn.functional.pad(torch.cat([q_nope, q_pe], -1), (0, dim - NOPE - ROPE))
    local = torch.arange(len(indices), dtype=indices.dtype)
    return ops.decode_attention(q, cache, indptr, local, last, sm_scale=SCALE)[..., :V]


@pytest.mark.benchmark(group="mla-decode")
@pytest.mark.parametrize("batch,tokens", [(1, 4096), (8, 1024), (32, 512)])
@pytest.mark.parametrize("kind", ["absorbed", "decompressed", "reference"])
def test_mla_decode_step(benchmark, kind, batch, tokens):
    case = _case(batch, tokens)
    fn = {
        "absorbed": absorbed,
        "decompressed": decompressed,
        "reference": lambda *a: absorbed(*a, reference=True),
    }[kind]
    with torch.inference_mode():
        out = benchmark.pedantic(fn, args=case, rounds=ROUNDS, iterations=1, warmup_rounds=1)
        want = absorbed(*case, reference=True)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)  # the same attention
