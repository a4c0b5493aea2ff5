"""pdkernels.invariant: a token's projection and attention are the same bits whatever else its step holds,
and the references' values within their tolerances."""

import pytest
import torch

from pdkernels import cpu, invariant, ops
from pdkernels.extend_attention import extend_attention_ref
from pdkernels.testing import append_positions, make_paged_cache

pytestmark = pytest.mark.skipif(not invariant.available(), reason="the C++ extension is not built here")


def _weights(n: int, k: int) -> dict:
    """Every kind of weight this machine's engine multiplies, packed as the engine packs it, beside the
    weight it stands for: fp32, fp32 that is int8 blocks (Q8Weight, where the extension has the AVX2
    kernel), bf16 (oneDNN's layout where torch has it)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g)
    scales = torch.rand(n, k // 32, 1, generator=g) / 64
    blocks = (torch.randint(-127, 128, (n, k // 32, 32), generator=g) * scales).reshape(n, k)
    kinds = {"fp32": (w, w), "bf16": (cpu.pack(w.bfloat16()), w.bfloat16())}
    if isinstance(q8 := cpu.pack(blocks), cpu.Q8Weight):
        kinds["int8 blocks"] = (q8, blocks)
    return kinds


@pytest.mark.parametrize("m", [1, 7, 33, 70])  # either side of the int8 copy's 32 rows and the 64 of F.linear
def test_a_row_s_product_is_the_same_bits_alone_or_in_any_batch(m):
    for kind, (packed, w) in _weights(72, 96).items():
        x = torch.randn(m + 1, 96, generator=torch.Generator().manual_seed(m)).to(w.dtype)[
            1:
        ]  # unaligned rows
        y = invariant.linear_rows(x, packed)
        for i in range(m):  # the row alone, and as the engine's decode step of one sequence multiplies it
            row = x[i : i + 1].clone()
            assert torch.equal(y[i], invariant.linear_rows(row, packed)[0]), (kind, i)
            assert torch.equal(y[i], ops.linear(row, packed)[0]), (kind, i)
        tol = dict(atol=3e-2, rtol=3e-2) if w.dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(y, (x.float() @ w.float().t()).to(w.dtype), **tol)


def test_no_rows_give_no_rows():
    w, _ = _weights(16, 32)["fp32"]
    assert invariant.linear_rows(torch.empty(0, 32), w).shape == (0, 16)


def test_each_token_sees_the_pages_of_its_own_prefix():
    """Two sequences of pages (5, 2) and (7,) of 4 tokens: a token at position p sees p // 4 + 1 pages of
    its sequence, the last holding p % 4 + 1 tokens."""
    kv_indptr, kv_indices = torch.tensor([0, 2, 3]), torch.tensor([5, 2, 7])
    batch, positions = torch.tensor([0, 0, 0, 1]), torch.tensor([3, 4, 6, 0])
    indptr, indices, last = invariant.token_tables(batch, positions, kv_indptr, kv_indices, 4)
    assert indptr.tolist() == [0, 1, 3, 5, 6]
    assert indices.tolist() == [5, 5, 2, 5, 2, 7]
    assert last.tolist() == [4, 1, 3, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_s_attention_is_the_same_bits_in_a_prompt_s_chunk_or_alone(dtype):
    """A step of two prompts' last chunks (11 and 5 new tokens after 20 and 0) and a decode token: each
    token's attention equals the step of that token alone, and the reference's within tolerance."""
    seq_lens, new = [31, 5, 40], [11, 5, 1]
    case = make_paged_cache(seq_lens, 2, 32, 4, dtype=dtype, seed=3)
    batch, positions = append_positions(case, new)
    q = torch.randn(sum(new), 8, 32, generator=torch.Generator().manual_seed(4)).to(dtype)
    pages = (case.kv_indptr, case.kv_indices, 4)
    o = invariant.causal_attention(q, case.cache, *invariant.token_tables(batch, positions, *pages))
    for t in range(sum(new)):
        tables = invariant.token_tables(batch[t : t + 1], positions[t : t + 1], *pages)
        alone = invariant.causal_attention(q[t : t + 1].clone(), case.cache, *tables)
        assert torch.equal(o[t], alone[0]), t
    qo_indptr = torch.tensor([0, *new]).cumsum(0).to(torch.int32)
    want = extend_attention_ref(
        q, qo_indptr, case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len
    )
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o, want, **tol)


def test_a_cache_the_loop_cannot_read_is_refused_naming_why():
    case = make_paged_cache([8], 2, 32, 4, kv_layout="HND")
    q = torch.randn(1, 2, 32)
    strided = case.cache.transpose(0, 1).contiguous().transpose(0, 1)  # the same shape, not contiguous
    with pytest.raises(ValueError, match="contiguous 5-D HND cache"):
        invariant.causal_attention(q, strided, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
