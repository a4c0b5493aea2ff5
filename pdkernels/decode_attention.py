"""Paged decode attention: one query token per sequence, GQA, split over the KV length with a merge.

Phase 1 runs one program per (sequence, kv head, split): all ``Hq // Hkv`` query heads of the group
share each K/V block they load (padded to 16 rows for tl.dot). Each program writes a partial output and
its log-sum-exp; phase 2 merges the splits. Bytes: the K/V of every sequence once.

Splits are per sequence and decided at run time (one compiled kernel for every batch and length, as SGLang
and vLLM do): the launch sets a split length from the batch's total tokens (a shape: no device sync) so
that the whole batch makes about four programs per SM, and each sequence takes as many splits of that
length as it needs, at most MAX_SPLITS. A long sequence among short ones gets many
splits, a short one a single split.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdkernels._paging import (
    INTERPRET,
    cache_geometry,
    cache_strides,
    check_attention_inputs,
    check_out,
    gather_pages,
    next_pow2,
    padded_page_table,
    require,
    seq_lens_from_page_table,
    split_kv_cache,
)
from pdkernels.extend_attention import (
    LOG2E,
    attend_block,
    grouped_attention_ref,
    num_stages,
)
from pdkernels.splits import BLOCK_N, MAX_SPLITS, _seq_splits, merge_splits, split_plan

__all__ = ["decode_attention", "decode_attention_ref"]


@triton.jit
def _decode_split_kernel(
    # pointers
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    o_part_ptr,
    lse_part_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    kv_last_page_len_ptr,
    split_len_ptr,
    # sizes
    qk_scale,
    group_size,
    head_dim,
    page_size,
    split_len,
    # strides: q's (batch, head), o_part's (batch, head, split), lse_part's (batch, head), and the K and V
    # caches' (page, head, token)
    q_strides,
    o_strides,
    lse_strides,
    k_strides,
    v_strides,
    # meta
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    LIVE_SPLIT: tl.constexpr,
    DIRECT: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    """DIRECT (a grid of one split): o_part_ptr and lse_part_ptr are the output [B, H, D] in q's dtype and
    its LSE [B, H] (natural log; written only with HAS_LSE), and no merge follows."""
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if LIVE_SPLIT:  # under a CUDA graph: the step's plan, written into a buffer before each replay
        split_len = tl.load(split_len_ptr)
    page_lo, seq_len, per_split, used = _seq_splits(
        kv_indptr_ptr, kv_last_page_len_ptr, b, page_size, tl.num_programs(2), split_len, BLOCK_N
    )
    if split < used:  # a split past the sequence's end writes nothing: the merge reads `used` splits
        _decode_split(
            q_ptr,
            k_cache_ptr,
            v_cache_ptr,
            o_part_ptr,
            lse_part_ptr,
            kv_indices_ptr,
            qk_scale,
            group_size,
            head_dim,
            page_size,
            q_strides,
            o_strides,
            lse_strides,
            k_strides,
            v_strides,
            b,
            kv_head,
            split,
            page_lo,
            seq_len,
            per_split,
            BLOCK_G,
            BLOCK_N,
            BLOCK_D,
            UPCAST,
            IEEE,
            DIRECT,
            HAS_LSE,
        )
    elif DIRECT:  # a sequence with no tokens: zeros and LSE -inf, as the merge writes them
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        heads = kv_head * group_size + offs_g
        mask_g = offs_g < group_size
        o = o_part_ptr + b * o_strides[0] + heads[:, None] * o_strides[1] + offs_d[None, :]
        zeros = tl.zeros((BLOCK_G, BLOCK_D), tl.float32).to(o_part_ptr.dtype.element_ty)
        tl.store(o, zeros, mask=mask_g[:, None] & (offs_d[None, :] < head_dim))
        if HAS_LSE:
            empty = tl.full((BLOCK_G,), float("-inf"), tl.float32)
            tl.store(lse_part_ptr + b * lse_strides[0] + heads * lse_strides[1], empty, mask=mask_g)


@triton.jit
def _decode_split(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    o_part_ptr,
    lse_part_ptr,
    kv_indices_ptr,
    qk_scale,
    group_size,
    head_dim,
    page_size,
    q_strides,
    o_strides,
    lse_strides,
    k_strides,
    v_strides,
    b,
    kv_head,
    split,
    page_lo,
    seq_len,
    per_split,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    DIRECT: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * group_size + offs_g
    mask_g = offs_g < group_size
    mask_d = offs_d < head_dim
    q = tl.load(
        q_ptr + b * q_strides[0] + heads[:, None] * q_strides[1] + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for start in range(lo, hi, BLOCK_N):  # every block holds at least one valid token
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        m_i, l_i, acc = attend_block(
            q,
            m_i,
            l_i,
            acc,
            mask_n[None, :],
            k_cache_ptr,
            v_cache_ptr,
            kv_indices_ptr,
            page_lo,
            kv_head,
            offs_n,
            mask_n,
            offs_d,
            head_dim,
            page_size,
            qk_scale,
            k_strides,
            v_strides,
            UPCAST,
            IEEE,
        )
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = o_part_ptr + b * o_strides[0] + heads[:, None] * o_strides[1] + split * o_strides[2] + offs_d[None, :]
    o_val = acc / l_safe[:, None]
    if DIRECT:  # the output itself, in its dtype
        o_val = o_val.to(o_part_ptr.dtype.element_ty)
    tl.store(o, o_val, mask=mask_g[:, None] & mask_d[None, :])
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))  # log2 units; -inf for an empty split
    if not DIRECT:
        tl.store(lse_part_ptr + b * lse_strides[0] + heads * lse_strides[1] + split, lse, mask=mask_g)
    elif HAS_LSE:  # natural log, as the merge writes it
        tl.store(
            lse_part_ptr + b * lse_strides[0] + heads * lse_strides[1], lse / 1.4426950408889634, mask=mask_g
        )


def decode_attention(
    q: Tensor,
    paged_kv_cache: Tensor | tuple[Tensor, Tensor],
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    kv_layout: str = "HND",
    sm_scale: float | None = None,
    out: Tensor | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    validate: bool = True,
    split_len: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of one query per sequence, q [B, Hq, D], over its paged K/V (Hq a multiple of Hkv).

    paged_kv_cache: [pages, 2, Hkv, P, D] (HND) or [pages, 2, P, Hkv, D] (NHD), or a (k, v) pair; page
    table as FlashInfer's (kv_indptr [B + 1], kv_indices, kv_last_page_len [B]). Returns out [B, Hq, D]
    in q's dtype (written into `out` when given) and, with return_lse, the natural-log LSE [B, Hq] fp32.
    A sequence with no tokens gets zeros and LSE -inf. validate=False skips the host-side checks.
    max_seq_len (the longest sequence, when the caller knows it on the host) bounds the splits launched;
    without it the bound is the page table's total. split_len: a one-element int32 device tensor holding
    the step's split length (live_split_len), read by the kernels at run time, for a CUDA graph whose
    buffers are sized for the longest context: num_splits is then the grid's splits (cap_splits), and a
    sequence uses as many as its live length needs, as it would eagerly.
    """
    if validate:
        k_cache, v_cache, seq_lens = check_attention_inputs(
            q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout
        )
        require(
            seq_lens.numel() == q.shape[0], f"q has {q.shape[0]} sequences, the page table {seq_lens.numel()}"
        )
        require(
            num_splits is None or 1 <= num_splits <= MAX_SPLITS,
            f"num_splits must lie in [1, {MAX_SPLITS}] or be None, got {num_splits}",
        )
    else:
        k_cache, v_cache = split_kv_cache(paged_kv_cache, kv_layout)
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = cache_geometry(k_cache, kv_layout)
    out = check_out("out", out, tuple(q.shape), q.dtype, q.device)
    lse = torch.empty((batch, num_heads), dtype=torch.float32, device=q.device) if return_lse else None
    if batch == 0:
        return (out, lse) if return_lse else out
    block_n = BLOCK_N
    group = num_heads // num_kv_heads
    live = split_len
    if live is not None:
        require(num_splits is not None, "split_len (a device tensor) needs num_splits, the grid's splits")
        split_len = block_n  # unused: the kernels read the tensor
    elif num_splits is None:
        num_splits, split_len = split_plan(
            kv_indices.numel() * page_size, max_seq_len, num_kv_heads, block_n, q.device
        )
    else:  # asked for: every sequence long enough is cut into num_splits
        split_len = block_n
    # one split in the grid: each program writes the output itself, and no merge runs (FlashInfer's
    # scheduler skips it likewise)
    direct = num_splits == 1
    if direct:
        o_part = out.unsqueeze(2)  # [B, H, 1, D]: the split's stride is never used
        lse_part = (lse if lse is not None else torch.empty((1, 1), device=q.device)).unsqueeze(2)
    else:
        o_part = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    block_d = max(16, next_pow2(head_dim))
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        o_part,
        lse_part,
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        live if live is not None else kv_last_page_len,  # a placeholder pointer when not live
        sm_scale * LOG2E,
        group,
        head_dim,
        page_size,
        split_len,
        q.stride(),
        o_part.stride(),
        lse_part.stride()[:2],
        cache_strides(k_cache, kv_layout),
        cache_strides(v_cache, kv_layout),
        BLOCK_G=max(16, next_pow2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        UPCAST=INTERPRET and q.dtype == torch.bfloat16,
        IEEE=q.dtype == torch.float32,
        LIVE_SPLIT=live is not None,
        DIRECT=direct,
        HAS_LSE=lse is not None,
        num_stages=num_stages(block_d),
    )
    if not direct:
        merge_splits(
            o_part, lse_part, out, lse, kv_indptr, kv_last_page_len, page_size, split_len, block_n, live
        )
    return (out, lse) if return_lse else out


def decode_attention_ref(
    q: Tensor,
    paged_kv_cache: Tensor | tuple[Tensor, Tensor],
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    kv_layout: str = "HND",
    sm_scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference: every sequence's K/V gathered into one padded batch, one masked softmax for all."""
    k_cache, v_cache = split_kv_cache(paged_kv_cache, kv_layout)
    page_size = cache_geometry(k_cache, kv_layout)[2]
    seq_lens = seq_lens_from_page_table(kv_indptr, kv_last_page_len, page_size)
    max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    page_table = padded_page_table(kv_indptr, kv_indices, -(-max_len // page_size))  # [B, max pages]
    k = gather_pages(k_cache, kv_layout, page_table)[:, :, :max_len]  # [B, Hkv, L, D]
    v = gather_pages(v_cache, kv_layout, page_table)[:, :, :max_len]
    keep = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]  # [B, L]
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = grouped_attention_ref(q[:, None], k, v, keep[:, None], sm_scale, return_lse)
    out = out[:, 0].to(q.dtype)
    return (out, lse[:, 0]) if return_lse else out
