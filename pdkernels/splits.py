"""Split-KV decode's shared parts (decode_attention and mla_decode): how a batch's sequences split over
their KV length (split_plan: about four programs per SM, each sequence as many splits as it needs), and
phase 2, the merge of each (sequence, head)'s partial outputs by their log-sum-exps."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdkernels._paging import next_pow2
from pdkernels.splitk_gemm import sm_count


@triton.jit
def _seq_splits(
    kv_indptr_ptr, kv_last_page_len_ptr, b, page_size, num_splits, split_len, BLOCK_N: tl.constexpr
):
    """(page_lo, seq_len, tokens a split, splits used) of sequence b: split_len tokens a split, or fewer
    longer ones when the grid has too few; a sequence with no tokens uses none."""
    page_lo = tl.load(kv_indptr_ptr + b)
    num_pages = tl.load(kv_indptr_ptr + b + 1) - page_lo
    seq_len = tl.where(num_pages > 0, (num_pages - 1) * page_size + tl.load(kv_last_page_len_ptr + b), 0)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, split_len)
    return page_lo, seq_len, per_split, tl.cdiv(seq_len, per_split)


@triton.jit
def _decode_merge_kernel(
    o_part_ptr,
    lse_part_ptr,
    o_ptr,
    lse_ptr,
    kv_indptr_ptr,
    kv_last_page_len_ptr,
    split_len_ptr,
    head_dim,
    page_size,
    num_splits,
    split_len,
    # strides: o_part's (batch, head, split), lse_part's (batch, head), out's (batch, head), lse's per batch
    o_part_strides,
    lse_part_strides,
    o_strides,
    lse_stride,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_BLOCK_N: tl.constexpr,
    HAS_LSE: tl.constexpr,
    LIVE_SPLIT: tl.constexpr,
):
    b, head = tl.program_id(0), tl.program_id(1)
    if LIVE_SPLIT:
        split_len = tl.load(split_len_ptr)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    _, _, _, used = _seq_splits(
        kv_indptr_ptr, kv_last_page_len_ptr, b, page_size, num_splits, split_len, SPLIT_BLOCK_N
    )
    mask_s = offs_s < used
    lse = tl.load(
        lse_part_ptr + b * lse_part_strides[0] + head * lse_part_strides[1] + offs_s,
        mask=mask_s,
        other=float("-inf"),
    )
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)  # [BLOCK_S]; 0 for empty splits
    parts = tl.load(
        o_part_ptr
        + b * o_part_strides[0]
        + head * o_part_strides[1]
        + offs_s[:, None] * o_part_strides[2]
        + offs_d[None, :],
        mask=mask_s[:, None] & (offs_d[None, :] < head_dim),
        other=0.0,
    )
    total = tl.sum(w, 0)
    total_safe = tl.where(total > 0, total, 1.0)
    o = tl.sum(parts * w[:, None], 0) / total_safe
    tl.store(
        o_ptr + b * o_strides[0] + head * o_strides[1] + offs_d,
        o.to(o_ptr.dtype.element_ty),
        mask=offs_d < head_dim,
    )
    if HAS_LSE:
        tl.store(
            lse_ptr + b * lse_stride + head,
            tl.where(total > 0, (m_safe + tl.log2(total_safe)) / 1.4426950408889634, float("-inf")),
        )


MAX_SPLITS = 32  # the merge kernel's compile-time width
BLOCK_N = 64  # keys per block of the split kernel
MIN_SPLIT_TOKENS = 256  # no split shorter (a short sequence stays whole)


def split_plan(
    total_tokens: int, max_seq_len: int | None, num_kv_heads: int, block_n: int, device: torch.device
) -> tuple[int, int]:
    """(splits in the grid, tokens a split): about four programs per SM over the batch's total tokens
    (an upper bound read off the page table's shape), no split under MIN_SPLIT_TOKENS; the grid covers
    the longest sequence (max_seq_len, else the total)."""
    per_program = triton.cdiv(total_tokens * num_kv_heads, 4 * sm_count(device))
    split_len = max(MIN_SPLIT_TOKENS, triton.cdiv(per_program, block_n) * block_n)
    longest = total_tokens if max_seq_len is None else min(max_seq_len, total_tokens)
    return max(1, min(MAX_SPLITS, triton.cdiv(longest, split_len))), split_len


def cap_splits(max_seq_len: int) -> int:
    """The grid's splits that cover any plan for sequences up to max_seq_len (a graph's capture)."""
    return max(1, min(MAX_SPLITS, triton.cdiv(max_seq_len, MIN_SPLIT_TOKENS)))


def live_split_len(total_tokens: int, max_seq_len: int, num_kv_heads: int, device: torch.device) -> int:
    """The split length an eager launch would plan for a step whose page tables hold total_tokens (pages
    x page size) and whose longest sequence is max_seq_len: what a graph's replay writes into
    decode_attention's split_len buffer, from the live step rather than the buffers' size."""
    return split_plan(max(total_tokens, 1), max(max_seq_len, 1), num_kv_heads, BLOCK_N, device)[1]


def merge_splits(
    o_part: Tensor,
    lse_part: Tensor,
    out: Tensor,
    lse: Tensor | None,
    kv_indptr: Tensor,
    kv_last_page_len: Tensor,
    page_size: int,
    split_len: int,
    block_n: int,
    live: Tensor | None = None,
) -> None:
    """Phase 2: each (sequence, head)'s splits o_part [B, H, S, D] merged by their LSEs lse_part [B, H, S]
    into out [B, H, D] (and lse [B, H], natural log, when given). The split plan is phase 1's: the grid's
    splits S, split_len and block_n, or the live split length when phase 1 read one."""
    batch, num_heads, num_splits, head_dim = o_part.shape
    lse_arg = lse if lse is not None else lse_part  # never written without HAS_LSE
    _decode_merge_kernel[(batch, num_heads)](
        o_part,
        lse_part,
        out,
        lse_arg,
        kv_indptr,
        kv_last_page_len,
        live if live is not None else kv_last_page_len,  # a placeholder pointer when not live
        head_dim,
        page_size,
        num_splits,
        split_len,
        o_part.stride(),
        lse_part.stride()[:2],
        out.stride()[:2],
        lse_arg.stride(0),
        BLOCK_S=MAX_SPLITS,
        BLOCK_D=max(16, next_pow2(head_dim)),
        SPLIT_BLOCK_N=block_n,
        HAS_LSE=lse is not None,
        LIVE_SPLIT=live is not None,
    )
