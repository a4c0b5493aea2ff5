"""Prefill/extend attention over a paged KV cache, for chunked prefill.

Request ``b`` brings ``q_len = qo_indptr[b+1] - qo_indptr[b]`` new query tokens whose K/V are already
appended, so the cache holds ``seq_len`` tokens (page table) of which the last ``q_len`` are the new
ones. Query ``i`` sits at position ``seq_len - q_len + i`` and, when causal, attends to the cached
prefix and to the new tokens up to itself. GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``.
FLOPs: 4 * Hq * D * sum over queries of the keys they attend to.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from pdkernels._paging import (
    INDEX_DTYPES,
    INTERPRET,
    cache_geometry,
    cache_strides,
    check_attention_inputs,
    check_out,
    check_tensor,
    gather_pages,
    next_pow2,
    require,
    split_kv_cache,
)

__all__ = [
    "extend_attention",
    "extend_attention_ref",
    "check_extend_attention",
]

LOG2E = 1.4426950408889634


def num_stages(block_d: int) -> int:
    """Software-pipelining depth whose K/V buffers fit in shared memory: 3 up to head_dim 128, 2 above
    (a 256-wide head with three stages of 64-row K and V tiles overflows Hopper's 227 KiB)."""
    return 3 if block_d <= 128 else 2


@triton.jit
def load_kv_block(
    cache_ptr,
    kv_indices_ptr,
    page_lo,
    kv_head,
    offs_n,
    mask_n,
    offs_d,
    head_dim,
    page_size,
    strides,
    MASK: tl.constexpr = True,
):
    """[BLOCK_N, BLOCK_D] rows of one kv head at token positions offs_n of one request (MASK=False: every
    position lies inside the sequence, and mask_n is not read)."""
    if MASK:
        page = tl.load(kv_indices_ptr + page_lo + offs_n // page_size, mask=mask_n, other=0).to(tl.int64)
        rows_mask = mask_n[:, None] & (offs_d[None, :] < head_dim)
    else:
        page = tl.load(kv_indices_ptr + page_lo + offs_n // page_size).to(tl.int64)
        rows_mask = offs_d[None, :] < head_dim
    rows = cache_ptr + page * strides[0] + kv_head * strides[1] + (offs_n % page_size) * strides[2]
    return tl.load(rows[:, None] + offs_d[None, :], mask=rows_mask, other=0.0)


@triton.jit
def attend_block(
    q,
    m_i,
    l_i,
    acc,
    keep,
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
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    MASK: tl.constexpr = True,
):
    """One online-softmax step over the keys offs_n: returns the updated (max, sum, acc), log2 units.
    MASK=False: a block every row sees whole (keep and mask_n are not read)."""
    k = load_kv_block(
        k_cache_ptr,
        kv_indices_ptr,
        page_lo,
        kv_head,
        offs_n,
        mask_n,
        offs_d,
        head_dim,
        page_size,
        k_strides,
        MASK,
    )
    v = load_kv_block(
        v_cache_ptr,
        kv_indices_ptr,
        page_lo,
        kv_head,
        offs_n,
        mask_n,
        offs_d,
        head_dim,
        page_size,
        v_strides,
        MASK,
    )
    if UPCAST:  # the interpreter's bf16 arithmetic is wrong
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if IEEE:  # fp32 inputs: full precision (tl.dot's default on CUDA is TF32)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    if MASK:
        s = tl.where(keep, qk * qk_scale, float("-inf"))  # [rows, BLOCK_N]
    else:
        s = qk * qk_scale
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing to attend to yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _extend_attention_kernel(
    # pointers
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    o_ptr,
    lse_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    kv_last_page_len_ptr,
    # sizes
    qk_scale,
    group_size,
    head_dim,
    page_size,
    # strides: (token, head) of q and o, lse's per token, (page, head, token) of the K and V caches
    q_strides,
    o_strides,
    lse_stride,
    k_strides,
    v_strides,
    # meta
    BLOCK_M: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    """One program: BLOCK_M rows = BLOCK_M // GROUP query tokens x the GROUP query heads (group_size of
    them real) of one kv head, so each K/V block loaded serves the whole GQA group. Query blocks run
    latest (heaviest under the causal mask) first. The keys every row sees whole go through an unmasked
    loop; only the blocks on the causal diagonal (and a partial last block) are masked."""
    kv_head, b = tl.program_id(0), tl.program_id(1)
    pid_m = tl.num_programs(2) - 1 - tl.program_id(2)
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    q_lo = tl.load(qo_indptr_ptr + b)
    q_len = tl.load(qo_indptr_ptr + b + 1) - q_lo
    page_lo = tl.load(kv_indptr_ptr + b)
    num_pages = tl.load(kv_indptr_ptr + b + 1) - page_lo
    seq_len = tl.where(num_pages > 0, (num_pages - 1) * page_size + tl.load(kv_last_page_len_ptr + b), 0)
    rows = tl.arange(0, BLOCK_M)
    tok = pid_m * TOKENS + rows // GROUP
    g = rows % GROUP
    head = kv_head * group_size + g
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = (tok < q_len) & (g < group_size)
    mask_md = mask_m[:, None] & (offs_d[None, :] < head_dim)
    q_pos = seq_len - q_len + tok  # absolute position of each row's query
    q_rows = (q_lo + tok[:, None]).to(tl.int64) * q_strides[0] + head[:, None] * q_strides[1]
    q = tl.load(q_ptr + q_rows + offs_d[None, :], mask=mask_md, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    if pid_m * TOKENS < q_len:
        if CAUSAL:
            first_pos = seq_len - q_len + pid_m * TOKENS  # the block's first query sees keys [0, first_pos]
            kv_hi = tl.minimum(seq_len, first_pos + TOKENS)
            full_hi = ((first_pos + 1) // BLOCK_N) * BLOCK_N
        else:
            kv_hi = seq_len
            full_hi = (seq_len // BLOCK_N) * BLOCK_N
        for start in range(0, full_hi, BLOCK_N):  # blocks every row sees whole: no mask
            offs_n = start + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = attend_block(
                q,
                m_i,
                l_i,
                acc,
                None,
                k_cache_ptr,
                v_cache_ptr,
                kv_indices_ptr,
                page_lo,
                kv_head,
                offs_n,
                None,
                offs_d,
                head_dim,
                page_size,
                qk_scale,
                k_strides,
                v_strides,
                UPCAST,
                IEEE,
                False,
            )
        for start in range(full_hi, kv_hi, BLOCK_N):  # the causal diagonal and a partial last block
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < kv_hi
            keep = mask_n[None, :]
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= q_pos[:, None])
            m_i, l_i, acc = attend_block(
                q,
                m_i,
                l_i,
                acc,
                keep,
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
    o_rows = (q_lo + tok[:, None]).to(tl.int64) * o_strides[0] + head[:, None] * o_strides[1]
    tl.store(
        o_ptr + o_rows + offs_d[None, :], (acc / l_safe[:, None]).to(o_ptr.dtype.element_ty), mask=mask_md
    )
    if HAS_LSE:
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
        tl.store(lse_ptr + (q_lo + tok).to(tl.int64) * lse_stride + head, lse, mask=mask_m)


def check_extend_attention(
    q: Tensor,
    qo_indptr: Tensor,
    paged_kv_cache: Tensor | tuple[Tensor, Tensor],
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    kv_layout: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Check extend_attention's inputs; return (k_cache, v_cache, queries per request [B])."""
    k_cache, v_cache, seq_lens = check_attention_inputs(
        q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout
    )
    check_tensor("qo_indptr", qo_indptr, 1, INDEX_DTYPES, q.device, contiguous=True)
    require(
        qo_indptr.numel() == seq_lens.numel() + 1
        and int(qo_indptr[0]) == 0
        and int(qo_indptr[-1]) == q.shape[0],
        f"qo_indptr must be [0 .. T={q.shape[0]}] with batch_size + 1 = {seq_lens.numel() + 1} entries",
    )
    q_lens = (qo_indptr[1:] - qo_indptr[:-1]).cpu().long()
    require(
        bool(((q_lens >= 0) & (q_lens <= seq_lens)).all()),
        f"each request's queries (q_lens {q_lens.tolist()}) must fit its cached tokens ({seq_lens.tolist()})",
    )
    return k_cache, v_cache, q_lens


def extend_attention(
    q: Tensor,
    qo_indptr: Tensor,
    paged_kv_cache: Tensor | tuple[Tensor, Tensor],
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    kv_layout: str = "HND",
    causal: bool = True,
    sm_scale: float | None = None,
    out: Tensor | None = None,
    return_lse: bool = False,
    max_q_len: int | None = None,
    validate: bool = True,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of q [T, Hq, D] (ragged by qo_indptr [B + 1]) over each request's paged K/V.

    Returns out [T, Hq, D] in q's dtype (written into `out` when given) and, with return_lse, the
    natural-log log-sum-exp [T, Hq] fp32 of each query's scores. validate=False skips the input checks;
    max_q_len (the longest query run) then saves a device sync.
    """
    if validate:
        k_cache, v_cache, q_lens = check_extend_attention(
            q, qo_indptr, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout
        )
    else:
        k_cache, v_cache = split_kv_cache(paged_kv_cache, kv_layout)
        q_lens = qo_indptr[1:] - qo_indptr[:-1]
    num_tokens, num_heads, head_dim = q.shape
    out = check_out("out", out, tuple(q.shape), q.dtype, q.device)
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q.device) if return_lse else out
    batch = q_lens.numel()
    max_q_len = (max_q_len or int(q_lens.max())) if batch else 0  # max_q_len given: no sync
    if num_tokens and max_q_len:
        _, num_kv_heads, page_size, _ = cache_geometry(k_cache, kv_layout)
        sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        group = num_heads // num_kv_heads
        group_pad = next_pow2(group)
        block_m, block_n = (16, 64) if INTERPRET else (64, 64)
        block_m = max(block_m, group_pad)  # rows: tokens x the padded group
        grid = (num_kv_heads, batch, triton.cdiv(max_q_len, block_m // group_pad))
        _extend_attention_kernel[grid](
            q,
            k_cache,
            v_cache,
            out,
            lse,
            qo_indptr,
            kv_indptr,
            kv_indices,
            kv_last_page_len,
            sm_scale * LOG2E,
            group,
            head_dim,
            page_size,
            q.stride(),
            out.stride(),
            lse.stride(0),
            cache_strides(k_cache, kv_layout),
            cache_strides(v_cache, kv_layout),
            BLOCK_M=block_m,
            GROUP=group_pad,
            BLOCK_N=block_n,
            BLOCK_D=max(16, next_pow2(head_dim)),
            CAUSAL=causal,
            UPCAST=INTERPRET and q.dtype == torch.bfloat16,
            IEEE=q.dtype == torch.float32,
            HAS_LSE=return_lse,
            num_stages=num_stages(max(16, next_pow2(head_dim))),
        )
    return (out, lse) if return_lse else out


def grouped_attention_ref(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor, sm_scale: float, return_lse: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Softmax attention with GQA, in plain torch.

    q [B, n, Hq, D]; k, v [B, Hkv, L, D] (head-major, as gather_pages returns); keep [B, n, L] bool.
    Returns out [B, n, Hq, D] (zeros where a query keeps nothing) and, with return_lse, the natural-log
    LSE [B, n, Hq] fp32. Mostly torch's fused SDPA (the engine's CPU path); with the LSE, the scores
    are formed explicitly in fp32, grouping each kv head's query heads (no K/V repeat).
    """
    # SDPA is the faster CPU path except for bf16 single-query rows (measured on AVX-512 cores: 2.7 ms
    # against 0.7 ms for 32 decode rows), where the explicit path below wins.
    if not return_lse and (q.shape[1] > 1 or q.dtype != torch.bfloat16):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=keep[:, None], scale=sm_scale, enable_gqa=True
        )
        return out.transpose(1, 2), None
    batch, n, num_heads, head_dim = q.shape
    num_kv_heads, group = k.shape[1], num_heads // k.shape[1]
    # rows of one kv head: its `group` query heads x n queries
    qg = q.float().view(batch, n, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(batch, num_kv_heads, group * n, head_dim)
    rows_keep = (
        keep[:, None, None].expand(batch, 1, group, n, keep.shape[-1]).reshape(batch, 1, group * n, -1)
    )
    scores = (qg @ k.float().transpose(-1, -2) * sm_scale).masked_fill(~rows_keep, float("-inf"))
    lse = scores.logsumexp(-1)  # [B, Hkv, g * n]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # a query with nothing to keep: all zeros
    out = (probs @ v.float()).view(batch, num_kv_heads, group, n, head_dim)
    return (
        out.permute(0, 3, 1, 2, 4).reshape(batch, n, num_heads, head_dim),
        lse.view(batch, num_kv_heads, group, n).permute(0, 3, 1, 2).reshape(batch, n, num_heads),
    )


def extend_attention_ref(
    q: Tensor,
    qo_indptr: Tensor,
    paged_kv_cache: Tensor | tuple[Tensor, Tensor],
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    kv_layout: str = "HND",
    causal: bool = True,
    sm_scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference: gather each request's K/V and attend with the causal offset, one request at a time."""
    num_tokens, num_heads, head_dim = q.shape
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), device=q.device)
    for lo, hi, k, v in requests_kv(
        qo_indptr, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout
    ):
        n, seq_len = hi - lo, k.shape[1]
        keep = torch.ones(n, seq_len, dtype=torch.bool, device=q.device)
        if causal:  # query i sits at position seq_len - n + i
            keep = (
                torch.arange(seq_len, device=q.device)[None, :]
                <= (seq_len - n + torch.arange(n, device=q.device))[:, None]
            )
        out_b, lse_b = grouped_attention_ref(
            q[None, lo:hi], k[None], v[None], keep[None], sm_scale, return_lse
        )
        out[lo:hi] = out_b[0]
        if return_lse:
            lse[lo:hi] = lse_b[0]
    return (out, lse) if return_lse else out


def requests_kv(qo_indptr, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout, ext=None):
    """(first query, end query, K [Hkv, L, D], V) per request with queries and keys, its pages gathered
    (by `ext`, pdkernels.cpu's module, in one C++ pass where it serves the cache)."""
    k_cache, v_cache = split_kv_cache(paged_kv_cache, kv_layout)
    page_size = cache_geometry(k_cache, kv_layout)[2]
    indptr, qo, last = kv_indptr.tolist(), qo_indptr.tolist(), kv_last_page_len.tolist()
    ext = ext if kv_layout == "HND" and kv_indices.dtype == torch.int32 else None
    for b in range(len(indptr) - 1):
        pages = kv_indices[indptr[b] : indptr[b + 1]]
        seq_len = (len(pages) - 1) * page_size + last[b] if len(pages) else 0
        if qo[b + 1] == qo[b] or seq_len == 0:
            continue
        if ext is not None:
            k, v = ext.gather_kv(paged_kv_cache, pages, seq_len)
        else:
            k = gather_pages(k_cache, kv_layout, pages[None])[0, :, :seq_len]
            v = gather_pages(v_cache, kv_layout, pages[None])[0, :, :seq_len]
        yield qo[b], qo[b + 1], k, v
