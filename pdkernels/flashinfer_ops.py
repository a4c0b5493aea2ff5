"""FlashInfer's kernels behind our signatures (GPU only): the baseline the benchmarks compare against.

Imported lazily by pdkernels.ops; this module imports flashinfer on first use, so it stays importable
without it. FlashInfer returns base-2 log-sum-exps; ours are natural logs.
"""

from __future__ import annotations

import math
from functools import cache

import torch
from torch import Tensor

from pdkernels._paging import cache_geometry, split_kv_cache

__all__ = [
    "available",
    "kv_append",
    "kv_append_mla",
    "decode_attention",
    "extend_attention",
    "mla_decode_attention",
    "mla_decode_wrapper",
]

WORKSPACE_BYTES = 128 * 1024 * 1024


def available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@cache
def _workspace(device: torch.device) -> Tensor:
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def kv_append(
    append_key,
    append_value,
    batch_indices,
    positions,
    paged_kv_cache,
    kv_indices,
    kv_indptr,
    kv_last_page_len,
    kv_layout: str = "HND",
    validate: bool = True,
) -> None:
    import flashinfer

    flashinfer.page.append_paged_kv_cache(
        append_key,
        append_value,
        batch_indices,
        positions,
        paged_kv_cache,
        kv_indices,
        kv_indptr,
        kv_last_page_len,
        kv_layout=kv_layout,
    )


def kv_append_mla(
    append_ckv,
    append_kpe,
    batch_indices,
    positions,
    ckv_cache,
    kpe_cache,
    kv_indices,
    kv_indptr,
    kv_last_page_len,
    validate: bool = True,
) -> None:
    import flashinfer

    flashinfer.page.append_paged_mla_kv_cache(
        append_ckv,
        append_kpe,
        batch_indices,
        positions,
        ckv_cache,
        kpe_cache,
        kv_indices,
        kv_indptr,
        kv_last_page_len,
    )


def decode_attention(
    q,
    paged_kv_cache,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    kv_layout: str = "HND",
    sm_scale: float | None = None,
    out: Tensor | None = None,
    return_lse: bool = False,
    **_ignored,
):
    import flashinfer

    k_cache, _ = split_kv_cache(paged_kv_cache, kv_layout)
    _, num_kv_heads, page_size, head_dim = cache_geometry(k_cache, kv_layout)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        _workspace(q.device), kv_layout, use_tensor_cores=q.shape[1] // num_kv_heads >= 4
    )
    wrapper.plan(
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        q.shape[1],
        num_kv_heads,
        head_dim,
        page_size,
        q_data_type=q.dtype,
        kv_data_type=k_cache.dtype,
        sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim),
    )
    return _natural_lse(wrapper.run(q, paged_kv_cache, out=out, return_lse=return_lse), return_lse)


def mla_decode_wrapper(q_nope, q_pe, kv_indptr, kv_indices, kv_last_page_len, page_size, sm_scale, kv_dtype):
    """FlashInfer's absorbed MLA (BatchMLAPagedAttentionWrapper) planned for one query token per sequence;
    .run(q_nope, q_pe, ckv_cache, kpe_cache) attends."""
    import flashinfer

    batch, num_heads, rank = q_nope.shape
    kv_len = (kv_indptr[1:] - kv_indptr[:-1] - 1).clamp(min=0) * page_size + kv_last_page_len
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(_workspace(q_nope.device))
    wrapper.plan(
        torch.arange(batch + 1, dtype=torch.int32, device=q_nope.device),
        kv_indptr.to(torch.int32),
        kv_indices.to(torch.int32),
        kv_len.to(torch.int32),
        num_heads,
        rank,
        q_pe.shape[2],
        page_size,
        False,
        sm_scale,
        q_nope.dtype,
        kv_dtype,
    )
    return wrapper


def mla_decode_attention(
    q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale: float
) -> Tensor:
    tables = (kv_indptr, kv_indices, kv_last_page_len, ckv_cache.shape[1], sm_scale, ckv_cache.dtype)
    return mla_decode_wrapper(q_nope, q_pe, *tables).run(q_nope, q_pe, ckv_cache, kpe_cache)


def extend_attention(
    q,
    qo_indptr,
    paged_kv_cache,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    kv_layout: str = "HND",
    causal: bool = True,
    sm_scale: float | None = None,
    out: Tensor | None = None,
    return_lse: bool = False,
    **_ignored,
):
    import flashinfer

    k_cache, _ = split_kv_cache(paged_kv_cache, kv_layout)
    _, num_kv_heads, page_size, head_dim = cache_geometry(k_cache, kv_layout)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(q.device), kv_layout)
    wrapper.plan(
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        q.shape[1],
        num_kv_heads,
        head_dim,
        page_size,
        causal=causal,
        sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim),
        q_data_type=q.dtype,
        kv_data_type=k_cache.dtype,
    )
    return _natural_lse(wrapper.run(q, paged_kv_cache, out=out, return_lse=return_lse), return_lse)


def _natural_lse(result, return_lse: bool):
    if not return_lse:
        return result
    out, lse = result
    return out, lse * math.log(2.0)
