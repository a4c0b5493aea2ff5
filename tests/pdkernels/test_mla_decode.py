"""The absorbed MLA decode: the Triton kernel (interpreted here) and the CPU path against the reference, over
caches that are views of one latent cache as the engine lays it out, and the checks on bad input."""

import pytest
import torch

from pdkernels import ops
from pdkernels.mla_decode import mla_decode_attention, mla_decode_attention_cpu, mla_decode_attention_ref
from pdkernels.testing import all_pairs

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _case(seq_lens, heads, rank, rope, page_size, dtype, seed=0):
    """A latent cache [pages, P, rank + rope] with shuffled page ids, its two views, and the queries."""
    g = torch.Generator().manual_seed(seed)
    per = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(per) + 2
    rows = torch.randn(num_pages, page_size, rank + rope, generator=g).to(dtype)
    tables = (
        torch.tensor([0] + per).cumsum(0).to(torch.int32),
        torch.randperm(num_pages, generator=g)[: sum(per)].to(torch.int32),
        torch.tensor(
            [n - (p - 1) * page_size if p else 0 for n, p in zip(seq_lens, per, strict=True)],
            dtype=torch.int32,
        ),
    )
    q = torch.randn(len(seq_lens), heads, rank + rope, generator=g).to(dtype)
    return q[..., :rank], q[..., rank:], rows[..., :rank], rows[..., rank:], tables


@pytest.mark.parametrize(
    "heads,page_size,dtype,num_splits", all_pairs([3, 16, 20], [4, 16], list(TOL), [1, 3, None])
)
def test_triton_mla_decode_matches_the_reference(heads, page_size, dtype, num_splits):
    q_nope, q_pe, ckv, kpe, tables = _case([1, 17, 70], heads, 32, 8, page_size, dtype)
    got = mla_decode_attention(q_nope, q_pe, ckv, kpe, *tables, sm_scale=0.3, num_splits=num_splits)
    want = mla_decode_attention_ref(q_nope, q_pe, ckv, kpe, *tables, sm_scale=0.3)
    torch.testing.assert_close(got, want, atol=TOL[dtype][0], rtol=TOL[dtype][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_mla_decode_matches_the_reference_and_gives_an_empty_sequence_zeros(dtype):
    q_nope, q_pe, ckv, kpe, tables = _case([5, 0, 33], 4, 48, 16, 8, dtype, seed=2)
    want = mla_decode_attention_ref(q_nope, q_pe, ckv, kpe, *tables, sm_scale=0.2)
    for got in (
        mla_decode_attention_cpu(q_nope, q_pe, ckv, kpe, *tables, sm_scale=0.2),  # views of one cache
        mla_decode_attention_cpu(q_nope, q_pe, ckv, kpe, *tables, sm_scale=0.2, max_seq_len=33),
        mla_decode_attention_cpu(q_nope, q_pe, ckv.contiguous(), kpe.contiguous(), *tables, sm_scale=0.2),
        ops.mla_decode_attention(q_nope, q_pe, ckv, kpe, *tables, sm_scale=0.2),
    ):
        torch.testing.assert_close(got, want, atol=TOL[dtype][0], rtol=TOL[dtype][1])
    assert not want[1].any()


def test_the_absorbed_form_equals_attention_over_decompressed_heads():
    """What the kernel is for: q_nope W_UK . c == (q_nope) . (c W_UK), and softmax-weighted c times W_UV
    is the softmax-weighted c W_UV (the per-head keys and values the latent stands for)."""
    g = torch.Generator().manual_seed(3)
    heads, rank, rope, nope, v_dim, n = 4, 32, 8, 16, 12, 23
    c, k_pe = torch.randn(n, rank, generator=g), torch.randn(n, rope, generator=g)
    w_uk, w_uv = torch.randn(heads, nope, rank, generator=g), torch.randn(heads, v_dim, rank, generator=g)
    q_nope, q_pe = torch.randn(heads, nope, generator=g), torch.randn(heads, rope, generator=g)
    keys = torch.cat([torch.einsum("nr,hdr->hnd", c, w_uk), k_pe.expand(heads, n, rope)], dim=-1)
    values = torch.einsum("nr,hdr->hnd", c, w_uv)
    scores = torch.einsum("hd,hnd->hn", torch.cat([q_nope, q_pe], -1), keys) * 0.25
    want = torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), values)
    q_lat = torch.einsum("hd,hdr->hr", q_nope, w_uk)
    tables = (torch.tensor([0, 6], dtype=torch.int32), torch.arange(6, dtype=torch.int32), torch.tensor([3]))
    pages = lambda t: torch.nn.functional.pad(t, (0, 0, 0, 1)).view(6, 4, -1)  # noqa: E731
    o_lat = mla_decode_attention(q_lat[None], q_pe[None], pages(c), pages(k_pe), *tables, sm_scale=0.25)
    torch.testing.assert_close(torch.einsum("hr,hdr->hd", o_lat[0], w_uv), want, atol=1e-4, rtol=1e-4)


def test_bad_inputs_name_the_field():
    q_nope, q_pe, ckv, kpe, (indptr, indices, last) = _case([5, 9], 4, 32, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="q_pe is .* its cache"):
        ops.mla_decode_attention(q_nope, q_pe[..., :4], ckv, kpe, indptr, indices, last, sm_scale=1.0)
    with pytest.raises(ValueError, match="kv_indices hold page ids"):
        ops.mla_decode_attention(q_nope, q_pe, ckv, kpe, indptr, indices + 100, last, sm_scale=1.0)
    with pytest.raises(ValueError, match="q_nope has 1 sequences, the page table 2"):
        ops.mla_decode_attention(q_nope[:1], q_pe[:1], ckv, kpe, indptr, indices, last, sm_scale=1.0)
    with pytest.raises(ValueError, match="need equal \\[pages, P\\]"):
        ops.mla_decode_attention(q_nope, q_pe, ckv, kpe[:1], indptr, indices, last, sm_scale=1.0)
