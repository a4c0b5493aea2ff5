"""Paged MLA decode attention in the absorbed form (FlashMLA's and FlashInfer's BatchMLAPagedAttention's).

Each sequence's cache is a list of latent rows, [c | k_pe] per token (kv_lora_rank + rope wide, no heads);
the query of head h is [q_nope W_UK[h] | q_pe] (absorbed by the caller) and its output the softmax-weighted
sum of the c rows (the caller applies W_UV). So every head reads the same rows: one program takes a block
of heads and a split of one sequence's tokens, loads each block of rows once for all of them, and keeps
an fp32 [heads, kv_lora_rank] accumulator; the splits merge as in decode_attention (its merge kernel and
split plan). Bytes: each sequence's latent rows once per head block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdkernels._paging import (
    INTERPRET,
    check_page_table,
    check_tensor,
    next_pow2,
    padded_page_table,
    require,
    seq_lens_from_page_table,
)
from pdkernels.extend_attention import LOG2E, load_kv_block
from pdkernels.splits import MAX_SPLITS, _seq_splits, merge_splits, split_plan

__all__ = ["mla_decode_attention", "mla_decode_attention_ref", "mla_decode_attention_cpu", "check_mla_decode"]


@triton.jit
def _mla_decode_split_kernel(
    q_nope_ptr,
    q_pe_ptr,
    ckv_ptr,
    kpe_ptr,
    o_part_ptr,
    lse_part_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    kv_last_page_len_ptr,
    qk_scale,
    num_heads,
    rank,
    rope_dim,
    page_size,
    split_len,
    # strides: q_nope's and q_pe's (batch, head), o_part's (batch, head, split), lse_part's (batch, head),
    # the latent and rope caches' (page, head, token) as load_kv_block takes them (their one head: 0)
    qn_strides,
    qp_strides,
    o_strides,
    lse_strides,
    ckv_strides,
    kpe_strides,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_PE: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    b, head_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    page_lo, seq_len, per_split, used = _seq_splits(
        kv_indptr_ptr, kv_last_page_len_ptr, b, page_size, tl.num_programs(2), split_len, BLOCK_N
    )
    if split < used:  # a split past the sequence's end writes nothing: the merge reads `used` splits
        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = heads < num_heads
        offs_r, offs_pe = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_PE)
        q_nope = tl.load(
            q_nope_ptr + b * qn_strides[0] + heads[:, None] * qn_strides[1] + offs_r[None, :],
            mask=mask_h[:, None] & (offs_r[None, :] < rank),
            other=0.0,
        )
        q_pe = tl.load(
            q_pe_ptr + b * qp_strides[0] + heads[:, None] * qp_strides[1] + offs_pe[None, :],
            mask=mask_h[:, None] & (offs_pe[None, :] < rope_dim),
            other=0.0,
        )
        if UPCAST:  # the interpreter's bf16 arithmetic is wrong
            q_nope, q_pe = q_nope.to(tl.float32), q_pe.to(tl.float32)
        m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_R), tl.float32)
        lo = split * per_split
        hi = tl.minimum(lo + per_split, seq_len)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            ckv = load_kv_block(
                ckv_ptr, kv_indices_ptr, page_lo, 0, offs_n, mask_n, offs_r, rank, page_size,
                ckv_strides,
            )  # fmt: skip
            kpe = load_kv_block(
                kpe_ptr, kv_indices_ptr, page_lo, 0, offs_n, mask_n, offs_pe, rope_dim, page_size,
                kpe_strides,
            )  # fmt: skip
            if UPCAST:
                ckv, kpe = ckv.to(tl.float32), kpe.to(tl.float32)
            if IEEE:  # fp32 inputs: full precision (tl.dot's default on CUDA is TF32)
                qk = tl.dot(q_nope, tl.trans(ckv), input_precision="ieee")
                qk += tl.dot(q_pe, tl.trans(kpe), input_precision="ieee")
            else:
                qk = tl.dot(q_nope, tl.trans(ckv)) + tl.dot(q_pe, tl.trans(kpe))
            s = tl.where(mask_n[None, :], qk * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])  # every block holds a valid token: m_new is finite
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(ckv.dtype), ckv, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(ckv.dtype), ckv)
            m_i = m_new
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = o_part_ptr + b * o_strides[0] + heads[:, None] * o_strides[1] + split * o_strides[2]
        tl.store(o + offs_r[None, :], acc / l_safe[:, None], mask=mask_h[:, None] & (offs_r[None, :] < rank))
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_part_ptr + b * lse_strides[0] + heads * lse_strides[1] + split, lse, mask=mask_h)


def check_mla_decode(
    q_nope: Tensor,
    q_pe: Tensor,
    ckv_cache: Tensor,
    kpe_cache: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
) -> None:
    """Raise ValueError naming the problem unless mla_decode_attention's inputs are consistent."""
    check_tensor("ckv_cache", ckv_cache, 3)
    check_tensor("kpe_cache", kpe_cache, 3, device=ckv_cache.device)
    check_tensor("q_nope", q_nope, 3, device=ckv_cache.device)
    check_tensor("q_pe", q_pe, 3, device=ckv_cache.device)
    require(
        ckv_cache.shape[:2] == kpe_cache.shape[:2],
        f"ckv_cache {tuple(ckv_cache.shape)} and kpe_cache {tuple(kpe_cache.shape)} need equal [pages, P]",
    )
    require(
        q_nope.shape[:2] == q_pe.shape[:2],
        f"q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} need equal [batch, heads]",
    )
    for name, q, cache in (("q_nope", q_nope, ckv_cache), ("q_pe", q_pe, kpe_cache)):
        require(
            q.shape[2] == cache.shape[2] and q.dtype == cache.dtype,
            f"{name} is [B, H, {q.shape[2]}] {q.dtype}, its cache [.., {cache.shape[2]}] {cache.dtype}",
        )
        require(q.stride(2) == 1 and cache.stride(2) == 1, f"{name} and its cache need a unit last stride")
    seq_lens = check_page_table(
        kv_indptr, kv_indices, kv_last_page_len, ckv_cache.shape[0], ckv_cache.shape[1], ckv_cache.device
    )
    require(
        seq_lens.numel() == q_nope.shape[0],
        f"q_nope has {q_nope.shape[0]} sequences, the page table {seq_lens.numel()}",
    )


def mla_decode_attention(
    q_nope: Tensor,
    q_pe: Tensor,
    ckv_cache: Tensor,
    kpe_cache: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    sm_scale: float,
    out: Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    validate: bool = True,
) -> Tensor:
    """Absorbed MLA attention of one query per sequence: q_nope [B, H, R] (already times W_UK), q_pe
    [B, H, rope] against ckv_cache [pages, P, R] and kpe_cache [pages, P, rope] (views of one latent cache
    are fine: only the last stride must be 1); page table as FlashInfer's. Returns [B, H, R] in q's dtype,
    the softmax(sm_scale * (q_nope c + q_pe k_pe))-weighted sum of the c rows; zeros for an empty sequence.
    """
    if validate:
        check_mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_last_page_len)
        require(
            num_splits is None or 1 <= num_splits <= MAX_SPLITS,
            f"num_splits must lie in [1, {MAX_SPLITS}] or be None, got {num_splits}",
        )
    batch, num_heads, rank = q_nope.shape
    page_size, rope_dim = ckv_cache.shape[1], q_pe.shape[2]
    out = out if out is not None else torch.empty_like(q_nope, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    block_n = 32 if rank > 256 else 64  # the [heads, R] accumulator and a block of R-wide rows in registers
    block_h = max(16, min(64, next_pow2(num_heads)))
    if num_splits is None:
        num_splits, split_len = split_plan(
            kv_indices.numel() * page_size,
            max_seq_len,
            triton.cdiv(num_heads, block_h),
            block_n,
            q_nope.device,
        )
    else:
        split_len = block_n
    o_part = torch.empty((batch, num_heads, num_splits, rank), dtype=torch.float32, device=q_nope.device)
    lse_part = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q_nope.device)
    _mla_decode_split_kernel[(batch, triton.cdiv(num_heads, block_h), num_splits)](
        q_nope,
        q_pe,
        ckv_cache,
        kpe_cache,
        o_part,
        lse_part,
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        sm_scale * LOG2E,
        num_heads,
        rank,
        rope_dim,
        page_size,
        split_len,
        q_nope.stride()[:2],
        q_pe.stride()[:2],
        o_part.stride(),
        lse_part.stride()[:2],
        (ckv_cache.stride(0), 0, ckv_cache.stride(1)),
        (kpe_cache.stride(0), 0, kpe_cache.stride(1)),
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_R=max(16, next_pow2(rank)),
        BLOCK_PE=max(16, next_pow2(rope_dim)),
        UPCAST=INTERPRET and q_nope.dtype == torch.bfloat16,
        IEEE=q_nope.dtype == torch.float32,
        num_warps=8 if rank > 256 else 4,
        num_stages=1 if rank > 256 else 2,
    )
    merge_splits(o_part, lse_part, out, None, kv_indptr, kv_last_page_len, page_size, split_len, block_n)
    return out


def mla_decode_attention_ref(
    q_nope: Tensor,
    q_pe: Tensor,
    ckv_cache: Tensor,
    kpe_cache: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    sm_scale: float,
) -> Tensor:
    """Reference: one sequence at a time, its rows gathered token by token, fp32 softmax."""
    page_size = ckv_cache.shape[1]
    lens = seq_lens_from_page_table(kv_indptr, kv_last_page_len, page_size).tolist()
    out = torch.zeros(q_nope.shape, dtype=torch.float32, device=q_nope.device)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        pos = torch.arange(n, device=q_nope.device)
        pages = kv_indices.long()[int(kv_indptr[b]) + pos // page_size]
        c = ckv_cache[pages, pos % page_size].float()  # [n, R]
        k_pe = kpe_cache[pages, pos % page_size].float()
        scores = (q_nope[b].float() @ c.T + q_pe[b].float() @ k_pe.T) * sm_scale  # [H, n]
        out[b] = torch.softmax(scores, dim=-1) @ c
    return out.to(q_nope.dtype)


def _joined(ckv_cache: Tensor, kpe_cache: Tensor) -> Tensor | None:
    """The one [pages, P, R + rope] latent cache that ckv_cache and kpe_cache are views of (as the engine
    lays it out: each token's row [c | k_pe]), or None when they are separate tensors."""
    rank = ckv_cache.shape[2]
    row = rank + kpe_cache.shape[2]
    if (
        ckv_cache.stride() == kpe_cache.stride() == (ckv_cache.shape[1] * row, row, 1)
        and kpe_cache.data_ptr() == ckv_cache.data_ptr() + rank * ckv_cache.element_size()
    ):
        return ckv_cache.as_strided((*ckv_cache.shape[:2], row), ckv_cache.stride())
    return None


def mla_decode_attention_cpu(
    q_nope: Tensor,
    q_pe: Tensor,
    ckv_cache: Tensor,
    kpe_cache: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    sm_scale: float,
    max_seq_len: int | None = None,
) -> Tensor:
    """The CPU path of pdkernels.ops: the reference's math batched. Each sequence's pages are gathered as
    whole blocks (index_select; one gather of the joined [c | k_pe] rows when the two caches are views of
    one latent cache, as in the engine), cast to fp32 once, and all heads attend with two batched
    matmuls, the query [q_nope | q_pe] against the whole row; padding past a sequence's end is masked."""
    batch, num_heads, rank = q_nope.shape
    page_size = ckv_cache.shape[1]
    if batch == 0:
        return torch.empty_like(q_nope)
    if max_seq_len is not None:
        n = -(-max_seq_len // page_size)
    else:
        n = int((kv_indptr[1:] - kv_indptr[:-1]).max())
    if batch == 1 and kv_indices.numel() == n:  # one sequence, its pages in order: the table as is
        table = kv_indices.long()
    else:
        table = padded_page_table(kv_indptr, kv_indices, n).reshape(-1)
    rows = _joined(ckv_cache, kpe_cache)
    if rows is not None:
        kv = rows.index_select(0, table).view(batch, n * page_size, -1).float()  # [B, L, R + rope]
        scores = torch.bmm(torch.cat([q_nope, q_pe], dim=-1).float(), kv.transpose(1, 2))  # [B, H, L]
        c = kv[..., :rank]
    else:
        c = ckv_cache.index_select(0, table).view(batch, n * page_size, rank).float()
        k_pe = kpe_cache.index_select(0, table).view(batch, n * page_size, -1).float()
        scores = torch.baddbmm(
            torch.bmm(q_pe.float(), k_pe.transpose(1, 2)), q_nope.float(), c.transpose(1, 2)
        )
    lens = seq_lens_from_page_table(kv_indptr, kv_last_page_len, page_size)
    scores.mul_(sm_scale)
    if batch > 1 or int(lens[0]) < n * page_size:  # tokens past a sequence's end
        pad = torch.arange(n * page_size, device=q_nope.device) >= lens[:, None]  # [B, L]
        scores.masked_fill_(pad[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # an empty sequence: zeros, as the reference
    return torch.bmm(probs, c).to(q_nope.dtype)
