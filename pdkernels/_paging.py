"""Page tables, layouts and input checks shared by the paged kernels, their references and launchers.

Page-table convention (FlashInfer's): the pages of request ``b`` are
``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` and its last page holds ``kv_last_page_len[b]`` tokens
(``1..page_size``; 0 only for a request with no page). Token position ``p`` of request ``b`` lives in
page ``kv_indices[kv_indptr[b] + p // page_size]`` at entry ``p % page_size``.

A paged cache is a 5-D tensor ``[pages, 2, H, P, D]`` (HND) or ``[pages, 2, P, H, D]`` (NHD), or a
``(k_cache, v_cache)`` pair of 4-D tensors ``[pages, H, P, D]`` / ``[pages, P, H, D]``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from torch import Tensor

LAYOUTS = ("HND", "NHD")
INDEX_DTYPES = (torch.int32, torch.int64)
# Read once, as triton.jit does when the kernel modules are imported.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def require(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless cond: launch preconditions that also hold under ``python -O``."""
    if not cond:
        raise ValueError(msg)


def check_layout(kv_layout: str) -> None:
    require(kv_layout in LAYOUTS, f"kv_layout must be one of {LAYOUTS}, got {kv_layout!r}")


def check_tensor(
    name: str,
    t: Tensor,
    ndim: int,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
) -> None:
    """Check rank, dtype and device; the last dim is always stride 1; ``contiguous`` checks all dims."""
    require(isinstance(t, Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    require(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        require(t.dtype in dtypes, f"{name} dtype must be one of {dtypes}, got {t.dtype}")
    if device is not None:
        require(t.device == device, f"{name} is on {t.device}, expected {device}")
    if contiguous:
        require(t.is_contiguous(), f"{name} must be contiguous, got strides {t.stride()}")
    elif t.numel() > 0 and t.shape[-1] > 1:
        require(t.stride(-1) == 1, f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def split_kv_cache(paged_kv_cache: Tensor | tuple[Tensor, Tensor], kv_layout: str) -> tuple[Tensor, Tensor]:
    """Return (k_cache, v_cache), each 4-D in the given layout, from a 5-D cache or a pair."""
    check_layout(kv_layout)
    if isinstance(paged_kv_cache, (tuple, list)):
        require(len(paged_kv_cache) == 2, "paged_kv_cache pair must be (k_cache, v_cache)")
        k_cache, v_cache = paged_kv_cache
        check_tensor("k_cache", k_cache, 4)
        check_tensor("v_cache", v_cache, 4)
        require(
            k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype,
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must match",
        )
        return k_cache, v_cache
    check_tensor("paged_kv_cache", paged_kv_cache, 5)
    require(
        paged_kv_cache.shape[1] == 2,
        f"paged_kv_cache must be [pages, 2, ...] (K and V), got shape {tuple(paged_kv_cache.shape)}",
    )
    return paged_kv_cache[:, 0], paged_kv_cache[:, 1]


def cache_geometry(cache: Tensor, kv_layout: str) -> tuple[int, int, int, int]:
    """(num_pages, num_heads, page_size, head_dim) of a 4-D K or V cache."""
    if kv_layout == "HND":
        num_pages, num_heads, page_size, head_dim = cache.shape
    else:
        num_pages, page_size, num_heads, head_dim = cache.shape
    return num_pages, num_heads, page_size, head_dim


def cache_strides(cache: Tensor, kv_layout: str) -> tuple[int, int, int]:
    """(stride per page, per head, per token) of a 4-D K or V cache: kernels address both layouts this way."""
    if kv_layout == "HND":
        return cache.stride(0), cache.stride(1), cache.stride(2)
    return cache.stride(0), cache.stride(2), cache.stride(1)


def token_major(cache: Tensor, kv_layout: str) -> Tensor:
    """A [pages, P, H, D] view of a 4-D cache in either layout."""
    return cache.transpose(1, 2) if kv_layout == "HND" else cache


def seq_lens_from_page_table(kv_indptr: Tensor, kv_last_page_len: Tensor, page_size: int) -> Tensor:
    """Tokens per request: (pages - 1) * page_size + last_page_len, and 0 for a request with no page."""
    num_pages = (kv_indptr[1:] - kv_indptr[:-1]).long()
    lens = (num_pages - 1) * page_size + kv_last_page_len.long()
    return torch.where(num_pages > 0, lens, torch.zeros_like(lens))


def check_page_table(
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    num_pages: int,
    page_size: int,
    device: torch.device,
) -> Tensor:
    """Validate a FlashInfer-style page table against a cache of num_pages pages; return seq lens [B]."""
    check_tensor("kv_indptr", kv_indptr, 1, INDEX_DTYPES, device, contiguous=True)
    check_tensor("kv_indices", kv_indices, 1, INDEX_DTYPES, device, contiguous=True)
    check_tensor("kv_last_page_len", kv_last_page_len, 1, INDEX_DTYPES, device, contiguous=True)
    batch = kv_indptr.numel() - 1
    require(batch >= 0, "kv_indptr must have batch_size + 1 entries, got 0")
    require(
        kv_last_page_len.numel() == batch,
        f"kv_last_page_len has {kv_last_page_len.numel()} entries, expected batch_size={batch}",
    )
    indptr = kv_indptr.cpu().long()
    require(int(indptr[0]) == 0, f"kv_indptr[0] must be 0, got {int(indptr[0])}")
    require(bool((indptr[1:] >= indptr[:-1]).all()), "kv_indptr must be non-decreasing")
    require(
        int(indptr[-1]) <= kv_indices.numel(),
        f"kv_indptr[-1]={int(indptr[-1])} exceeds len(kv_indices)={kv_indices.numel()}",
    )
    used = kv_indices[: int(indptr[-1])].cpu().long()
    if used.numel():
        lo, hi = int(used.min()), int(used.max())
        require(
            lo >= 0 and hi < num_pages,
            f"kv_indices hold page ids in [{lo}, {hi}], allowed [0, {num_pages}) for this cache",
        )
    last = kv_last_page_len.cpu().long()
    has_pages = indptr[1:] > indptr[:-1]
    require(
        bool(((last >= 1) & (last <= page_size) | ~has_pages).all()),
        f"kv_last_page_len must lie in [1, page_size={page_size}] where pages exist, got {last.tolist()}",
    )
    return seq_lens_from_page_table(indptr, last, page_size)


def page_entry_of(
    batch_indices: Tensor, positions: Tensor, kv_indptr: Tensor, kv_indices: Tensor, page_size: int
) -> tuple[Tensor, Tensor]:
    """Page id and in-page entry of each (request, position) pair."""
    b, pos = batch_indices.long(), positions.long()
    page = kv_indices.long()[kv_indptr.long()[b] + pos // page_size]
    return page, pos % page_size


def padded_page_table(kv_indptr: Tensor, kv_indices: Tensor, width: int) -> Tensor:
    """[B, width] long page ids of each request, padded with page 0 past its last page."""
    num_pages = kv_indptr[1:] - kv_indptr[:-1]
    cols = torch.arange(width, device=kv_indices.device)
    slots = (kv_indptr[:-1, None].long() + cols).clamp(max=max(kv_indices.numel() - 1, 0))
    return torch.where(cols < num_pages[:, None], kv_indices.long()[slots], 0)


def gather_pages(cache: Tensor, kv_layout: str, page_table: Tensor) -> Tensor:
    """Whole pages of a 4-D K or V cache, head-major: page_table [B, n] -> [B, H, n * P, D].

    Copies pages as blocks (cheap for HND, where a page is [H, P, D]); token t of row b is at [b, :, t].
    """
    batch, n = page_table.shape
    # index_select, not cache[page_table]: on the CPU it copies whole pages instead of indexing each token
    pages = cache.index_select(0, page_table.reshape(-1).long()).view(batch, n, *cache.shape[1:])
    if kv_layout == "HND":
        return pages.transpose(1, 2).reshape(batch, pages.shape[2], -1, pages.shape[-1])
    return pages.reshape(batch, -1, pages.shape[3], pages.shape[-1]).transpose(1, 2)


def batch_indices_positions(append_indptr: Tensor, seq_lens: Tensor) -> tuple[Tensor, Tensor]:
    """Request index and position of every appended token (FlashInfer's ``get_batch_indices_positions``).

    append_indptr [B + 1]: tokens appended per request; seq_lens [B]: request lengths after the append.
    The appended tokens of request b take the last positions ``seq_lens[b] - n_b .. seq_lens[b] - 1``.
    """
    counts = (append_indptr[1:] - append_indptr[:-1]).long()
    require(bool((counts <= seq_lens.long()).all()), "each request's appended tokens must fit in its seq_len")
    batch_indices = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    offsets = torch.arange(int(append_indptr[-1]), device=counts.device) - append_indptr.long()[batch_indices]
    positions = seq_lens.long()[batch_indices] - counts[batch_indices] + offsets
    return batch_indices.to(torch.int32), positions.to(torch.int32)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check_attention_inputs(
    q: Tensor,
    paged_kv_cache: Tensor | tuple[Tensor, Tensor],
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    kv_layout: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Check q [T, Hq, D] against the cache and page table; return (k_cache, v_cache, seq_lens)."""
    k_cache, v_cache = split_kv_cache(paged_kv_cache, kv_layout)
    num_pages, num_kv_heads, page_size, head_dim = cache_geometry(k_cache, kv_layout)
    check_tensor("q", q, 3, (torch.float16, torch.bfloat16, torch.float32), k_cache.device)
    require(q.dtype == k_cache.dtype, f"q dtype {q.dtype} must equal the cache dtype {k_cache.dtype}")
    require(q.shape[2] == head_dim, f"q head_dim {q.shape[2]} differs from the cache's {head_dim}")
    require(
        q.shape[1] % num_kv_heads == 0,
        f"q heads ({q.shape[1]}) must be a multiple of the cache's kv heads ({num_kv_heads})",
    )
    seq_lens = check_page_table(kv_indptr, kv_indices, kv_last_page_len, num_pages, page_size, k_cache.device)
    return k_cache, v_cache, seq_lens


def check_out(name: str, t: Tensor | None, shape: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor(name, t, len(shape), (dtype,), device)
    require(tuple(t.shape) == shape, f"{name} must have shape {shape}, got {tuple(t.shape)}")
    return t
