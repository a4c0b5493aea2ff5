"""The CPU paths of a step's attention, SmolLM2's heads (9 query over 3 kv, 64 wide), one thread: the C++
extension (pdkernels.cpu: decode attention over the pages in place, 16 tokens' scores a step on AVX-512
BF16 CPUs for bf16 caches and with AVX2 + FMA for fp32 and bf16 ones; extend attention over the pages with
AVX2 + FMA (oneDNN's bf16 GEMMs with the C++ gather and causal softmax in bf16 on CPUs that compute in it);
rope) against the torch code that serves where it is not built (PDKERNELS_CPU_EXT=0). Rows:
decode in bf16 and fp32 (what AVX2 machines run) at batch 1 x 924 tokens (a shared system prompt's
answer) and batch 20 x 150 (concurrency 20 of 128/32); extend in bf16 and fp32 of the 28 tokens a cached
924-token prompt computes, of a whole 128- and 1,024-token prompt, and of a 1,024-token prompt's second
512-token chunk; rope on one layer's q and k.
"""

import pytest
import torch

from pdkernels import cpu, ops
from pdkernels.rope import rope_ref
from pdkernels.testing import make_paged_cache

HEADS, KV_HEADS, DIM = 9, 3, 64


@pytest.fixture(params=["c++", "torch"])
def path(request, monkeypatch):
    monkeypatch.setenv("PDKERNELS_CPU_EXT", "1" if request.param == "c++" else "0")
    if request.param == "c++" and cpu.module() is None:
        pytest.skip("no C++ extension here")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ops.set_backend("torch")
    yield request.param
    ops.set_backend("auto")
    torch.set_num_threads(threads)


@pytest.mark.benchmark(group="cpu-decode-attention")
@pytest.mark.parametrize("batch,tokens", [(1, 924), (20, 150)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_decode_attention(benchmark, path, batch, tokens, dtype):
    case = make_paged_cache([tokens] * batch, KV_HEADS, DIM, 16, "HND", dtype=dtype)
    q = torch.randn(batch, HEADS, DIM).to(dtype)
    args = (q, case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    benchmark.pedantic(lambda: ops.decode_attention(*args, validate=False), rounds=100, warmup_rounds=5)


@pytest.mark.benchmark(group="cpu-extend-attention")
@pytest.mark.parametrize("new,cached", [(28, 896), (128, 0), (512, 512), (1024, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_extend_attention(benchmark, path, new, cached, dtype):
    case = make_paged_cache([new + cached], KV_HEADS, DIM, 16, "HND", dtype=dtype)
    q = torch.randn(new, HEADS, DIM).to(dtype)
    qo = torch.tensor([0, new], dtype=torch.int32)
    args = (q, qo, case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    rounds = 10 if new >= 1024 else 100
    benchmark.pedantic(lambda: ops.extend_attention(*args, validate=False), rounds=rounds, warmup_rounds=2)


@pytest.mark.benchmark(group="cpu-rope")
@pytest.mark.parametrize("tokens", [1, 28, 512])
def test_rope(benchmark, path, tokens):
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, DIM).to(torch.bfloat16)
    angles = torch.rand(tokens, 1, DIM // 2) * 100
    cos, sin = angles.cos(), angles.sin()
    qk = qkv[:, : HEADS + KV_HEADS]  # as the model has it: a view of the fused projection
    if path == "c++":
        benchmark.pedantic(lambda: ops.rope(qk, cos, sin, validate=False), rounds=200, warmup_rounds=5)
    else:
        benchmark.pedantic(lambda: rope_ref(qk, cos, sin), rounds=200, warmup_rounds=5)
