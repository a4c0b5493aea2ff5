"""What converting KV between a prefill and a decode worker of other page sizes or layouts costs, on
SmolLM2-135M's geometry (30 layers, 3 kv heads of 64, fp32 and bf16) and a 2,048-token request: planning
its writes (units of the smaller page size: more, smaller writes than equal pages), and the decode side
turning its landed pages into its own layout in place (transfer.decode.relayout), beside a plain copy of
the same bytes (the floor any conversion pays once).

    python -m pytest experiments/bench/bench_kv_conversion.py --benchmark-enable -q
"""

from __future__ import annotations

import pytest
import torch

from transfer.decode import relayout
from transfer.plan import ShardSpec, plan_array

LAYERS, HEADS, DIM, TOKENS = 30, 3, 64, 2048
GEOMETRY = dict(tp=1, num_kv_heads=HEADS, num_layers=LAYERS, head_dim=DIM)


@pytest.mark.benchmark(group="kv-plan")
@pytest.mark.parametrize("src_page, dst_page", [(16, 16), (16, 64), (64, 16)])
def test_plan_a_request(benchmark, src_page, dst_page):
    src = ShardSpec(num_pages=TOKENS // src_page, page_size=src_page, itemsize=2, **GEOMETRY)
    dst = ShardSpec(num_pages=TOKENS // dst_page, page_size=dst_page, itemsize=2, **GEOMETRY)
    src_pages, dst_pages = list(range(src.num_pages)), list(range(dst.num_pages))[::-1]
    rows = benchmark(plan_array, src, dst, src_pages, dst_pages)
    benchmark.extra_info["writes"] = len(rows)
    benchmark.extra_info["bytes_per_write"] = int(rows[:, 5].mean())


def _cache(dtype, page):
    pages = TOKENS // page
    return torch.randn(LAYERS, pages, 2, HEADS, page, DIM).to(dtype), list(range(pages))


@pytest.mark.benchmark(group="kv-relayout")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_relayout_a_request(benchmark, dtype):
    cache, pages = _cache(dtype, 16)
    benchmark(relayout, [cache], pages)
    benchmark.extra_info["bytes"] = cache.numel() * cache.element_size()


@pytest.mark.benchmark(group="kv-relayout")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_copy_a_request(benchmark, dtype):
    cache, _ = _cache(dtype, 16)
    out = torch.empty_like(cache)
    benchmark(out.copy_, cache)
    benchmark.extra_info["bytes"] = cache.numel() * cache.element_size()
