"""Append new K/V rows to a paged KV cache (HND or NHD), and the MLA latent variant.

Addressing follows FlashInfer's ``append_paged_kv_cache``: token ``i`` belongs to request
``batch_indices[i]`` at position ``positions[i]``, and lands in page
``kv_indices[kv_indptr[b] + pos // P]`` at entry ``pos % P``. The page table describes the cache *after*
the append. ``kv_append_slots`` takes flat slots ``page * P + entry`` instead (-1 skips a padded token).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from pdkernels._paging import (
    INDEX_DTYPES,
    cache_geometry,
    cache_strides,
    check_layout,
    check_page_table,
    check_tensor,
    next_pow2,
    page_entry_of,
    require,
    split_kv_cache,
    token_major,
)

__all__ = [
    "kv_append",
    "kv_append_slots",
    "kv_append_mla",
    "kv_append_ref",
    "kv_append_slots_ref",
    "kv_append_mla_ref",
    "check_kv_append",
    "check_kv_append_slots",
    "check_kv_append_mla",
]


@triton.jit
def _store_rows(
    src_ptr,
    src_strides,
    dst_ptr,
    dst_strides,
    t,
    h,
    page,
    entry,
    valid,
    head_dim,
    BLOCK_D: tl.constexpr,
):
    """Copy the rows (token t, head h) [BLOCK_R] of src to (page, entry, h) of dst; invalid rows skip."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (offs_d[None, :] < head_dim)
    src = src_ptr + t[:, None] * src_strides[0] + h[:, None] * src_strides[1] + offs_d[None, :]
    rows = tl.load(src, mask=mask)
    dst = dst_ptr + page[:, None] * dst_strides[0] + entry[:, None] * dst_strides[2]
    tl.store(dst + h[:, None] * dst_strides[1] + offs_d[None, :], rows, mask=mask)


@triton.jit
def _kv_append_kernel(
    # pointers
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    batch_indices_ptr,
    positions_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    # sizes
    num_tokens,
    num_heads,
    head_dim_k,
    head_dim_v,
    page_size,
    # strides: k's and v's (token, head), the K and V caches' (page, head, token)
    k_strides,
    v_strides,
    kc_strides,
    vc_strides,
    # meta
    USE_SLOTS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """BLOCK_R (token, head) rows a program, token-major: for contiguous [T, H, D] input one program reads
    BLOCK_R * D consecutive elements, several tokens' worth where heads are few or narrow (SmolLM2's 3 x
    64, MLA's one latent row), and looks up each token's page once per row."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = r < num_tokens * num_heads
    t = tl.where(in_range, r // num_heads, 0)
    h = r % num_heads
    if USE_SLOTS:
        slot = tl.load(slots_ptr + t, mask=in_range, other=-1).to(tl.int64)
        valid = in_range & (slot >= 0)
        slot = tl.where(valid, slot, 0)
        page = slot // page_size
        entry = slot % page_size
    else:
        b = tl.load(batch_indices_ptr + t, mask=in_range, other=0)
        pos = tl.load(positions_ptr + t, mask=in_range, other=-1).to(tl.int64)
        valid = in_range & (pos >= 0)
        pos = tl.where(valid, pos, 0)
        first = tl.load(kv_indptr_ptr + b, mask=valid, other=0)
        page = tl.load(kv_indices_ptr + first + pos // page_size, mask=valid, other=0).to(tl.int64)
        entry = pos % page_size
    _store_rows(
        k_ptr,
        k_strides,
        k_cache_ptr,
        kc_strides,
        t,
        h,
        page,
        entry,
        valid,
        head_dim_k,
        BLOCK_DK,
    )
    _store_rows(
        v_ptr,
        v_strides,
        v_cache_ptr,
        vc_strides,
        t,
        h,
        page,
        entry,
        valid,
        head_dim_v,
        BLOCK_DV,
    )


# Elements a program copies per tensor: enough bytes in flight per program at any head geometry
ROW_BLOCK_ELEMENTS = 4096


def _launch(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    kv_layout: str,
    page_size: int,
    slots: Tensor | None = None,
    batch_indices: Tensor | None = None,
    positions: Tensor | None = None,
    kv_indptr: Tensor | None = None,
    kv_indices: Tensor | None = None,
) -> None:
    num_tokens, num_heads = k.shape[0], k.shape[1]
    if num_tokens == 0:
        return
    dk, dv = k.shape[2], v.shape[2]
    rows = num_tokens * num_heads
    block_r = min(next_pow2(rows), max(1, ROW_BLOCK_ELEMENTS // next_pow2(max(dk, dv))))
    addressing = [slots, batch_indices, positions, kv_indptr, kv_indices]
    placeholder = next(t for t in addressing if t is not None)  # the unused mode's pointers are never read
    _kv_append_kernel[(triton.cdiv(rows, block_r),)](
        k,
        v,
        k_cache,
        v_cache,
        *[t if t is not None else placeholder for t in addressing],
        num_tokens,
        num_heads,
        dk,
        dv,
        page_size,
        k.stride()[:2],
        v.stride()[:2],
        cache_strides(k_cache, kv_layout),
        cache_strides(v_cache, kv_layout),
        USE_SLOTS=slots is not None,
        BLOCK_R=block_r,
        BLOCK_DK=next_pow2(dk),
        BLOCK_DV=next_pow2(dv),
        num_warps=4 if block_r * next_pow2(max(dk, dv)) >= ROW_BLOCK_ELEMENTS else 2,
    )


def _check_rows(k: Tensor, v: Tensor, k_cache: Tensor, kv_layout: str, names=("append_key", "append_value")):
    check_tensor(names[0], k, 3)
    check_tensor(names[1], v, 3, device=k.device)
    require(k.shape == v.shape, f"{names[0]} {tuple(k.shape)} and {names[1]} {tuple(v.shape)} must match")
    _, num_heads, _, head_dim = cache_geometry(k_cache, kv_layout)
    require(
        k.shape[1:] == (num_heads, head_dim),
        f"{names[0]} rows are [H={k.shape[1]}, D={k.shape[2]}], cache holds [H={num_heads}, D={head_dim}]",
    )
    require(
        k.dtype == k_cache.dtype, f"{names[0]} dtype {k.dtype} must equal the cache dtype {k_cache.dtype}"
    )
    require(k_cache.device == k.device, f"cache is on {k_cache.device}, {names[0]} on {k.device}")


def _check_positions(batch_indices: Tensor, positions: Tensor, num_tokens: int, seq_lens: Tensor) -> None:
    check_tensor("batch_indices", batch_indices, 1, INDEX_DTYPES, contiguous=True)
    check_tensor("positions", positions, 1, INDEX_DTYPES, contiguous=True)
    require(
        batch_indices.numel() == num_tokens and positions.numel() == num_tokens,
        f"batch_indices ({batch_indices.numel()}) and positions ({positions.numel()}) need one entry "
        f"per appended token ({num_tokens})",
    )
    if num_tokens == 0:
        return
    b, pos = batch_indices.cpu().long(), positions.cpu().long()
    require(
        int(b.min()) >= 0 and int(b.max()) < seq_lens.numel(),
        f"batch_indices must lie in [0, batch_size={seq_lens.numel()}), got [{int(b.min())}, {int(b.max())}]",
    )
    over = (pos < 0) | (pos >= seq_lens[b])
    if bool(over.any()):
        i = int(over.nonzero()[0])
        raise ValueError(
            f"token {i}: position {int(pos[i])} of request {int(b[i])} is outside its page table, "
            f"which holds {int(seq_lens[b[i]])} tokens (grow kv_indices/kv_last_page_len first)"
        )


def check_kv_append(
    append_key: Tensor,
    append_value: Tensor,
    batch_indices: Tensor,
    positions: Tensor,
    paged_kv_cache: Tensor | tuple[Tensor, Tensor],
    kv_indices: Tensor,
    kv_indptr: Tensor,
    kv_last_page_len: Tensor,
    kv_layout: str = "HND",
) -> None:
    """Raise ValueError naming the problem unless kv_append's inputs are consistent and in range."""
    k_cache, _ = split_kv_cache(paged_kv_cache, kv_layout)
    num_pages, _, page_size, _ = cache_geometry(k_cache, kv_layout)
    _check_rows(append_key, append_value, k_cache, kv_layout)
    seq_lens = check_page_table(kv_indptr, kv_indices, kv_last_page_len, num_pages, page_size, k_cache.device)
    _check_positions(batch_indices, positions, append_key.shape[0], seq_lens)


def kv_append(
    append_key: Tensor,
    append_value: Tensor,
    batch_indices: Tensor,
    positions: Tensor,
    paged_kv_cache: Tensor | tuple[Tensor, Tensor],
    kv_indices: Tensor,
    kv_indptr: Tensor,
    kv_last_page_len: Tensor,
    kv_layout: str = "HND",
    validate: bool = True,
) -> None:
    """Write append_key/append_value [T, H, D] into paged_kv_cache in place (FlashInfer's argument order).

    paged_kv_cache: [pages, 2, H, P, D] (HND) or [pages, 2, P, H, D] (NHD), or a (k_cache, v_cache) pair.
    batch_indices, positions [T]: request and position of each token; kv_indptr [B + 1], kv_indices,
    kv_last_page_len [B]: the page table after the append. validate=False skips the host-side index
    checks (they synchronise with the device), e.g. while capturing a CUDA graph.
    """
    if validate:
        check_kv_append(
            append_key,
            append_value,
            batch_indices,
            positions,
            paged_kv_cache,
            kv_indices,
            kv_indptr,
            kv_last_page_len,
            kv_layout,
        )
    k_cache, v_cache = split_kv_cache(paged_kv_cache, kv_layout)
    page_size = cache_geometry(k_cache, kv_layout)[2]
    _launch(
        append_key,
        append_value,
        k_cache,
        v_cache,
        kv_layout,
        page_size,
        batch_indices=batch_indices,
        positions=positions,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
    )


def check_kv_append_slots(
    append_key: Tensor,
    append_value: Tensor,
    paged_kv_cache: Tensor | tuple[Tensor, Tensor],
    slots: Tensor,
    kv_layout: str = "HND",
) -> None:
    """Raise ValueError naming the problem unless kv_append_slots' inputs are consistent and in range."""
    k_cache, _ = split_kv_cache(paged_kv_cache, kv_layout)
    num_pages, _, page_size, _ = cache_geometry(k_cache, kv_layout)
    _check_rows(append_key, append_value, k_cache, kv_layout)
    num_tokens, capacity = append_key.shape[0], num_pages * page_size
    check_tensor("slots", slots, 1, INDEX_DTYPES, k_cache.device, contiguous=True)
    require(
        slots.numel() == num_tokens,
        f"slots has {slots.numel()} entries, expected one per token ({num_tokens})",
    )
    if num_tokens:
        lo, hi = int(slots.min()), int(slots.max())
        require(
            lo >= -1 and hi < capacity,
            f"slots hold [{lo}, {hi}], allowed [0, pages * page_size = {capacity}) or -1 to skip",
        )


def kv_append_slots(
    append_key: Tensor,
    append_value: Tensor,
    paged_kv_cache: Tensor | tuple[Tensor, Tensor],
    slots: Tensor,
    kv_layout: str = "HND",
    validate: bool = True,
) -> None:
    """Write append_key/append_value [T, H, D] at flat slots [T] (page * P + entry; -1 skips) in place."""
    if validate:
        check_kv_append_slots(append_key, append_value, paged_kv_cache, slots, kv_layout)
    k_cache, v_cache = split_kv_cache(paged_kv_cache, kv_layout)
    page_size = cache_geometry(k_cache, kv_layout)[2]
    _launch(append_key, append_value, k_cache, v_cache, kv_layout, page_size, slots=slots)


def check_kv_append_mla(
    append_ckv: Tensor,
    append_kpe: Tensor,
    batch_indices: Tensor,
    positions: Tensor,
    ckv_cache: Tensor,
    kpe_cache: Tensor,
    kv_indices: Tensor,
    kv_indptr: Tensor,
    kv_last_page_len: Tensor,
) -> None:
    """Raise ValueError naming the problem unless kv_append_mla's inputs are consistent and in range."""
    check_tensor("ckv_cache", ckv_cache, 3)
    check_tensor("kpe_cache", kpe_cache, 3, device=ckv_cache.device)
    require(
        ckv_cache.shape[:2] == kpe_cache.shape[:2],
        f"ckv_cache {tuple(ckv_cache.shape)} and kpe_cache {tuple(kpe_cache.shape)} need equal [pages, P]",
    )
    num_pages, page_size = ckv_cache.shape[:2]
    check_tensor("append_ckv", append_ckv, 2, device=ckv_cache.device)
    check_tensor("append_kpe", append_kpe, 2, device=ckv_cache.device)
    require(append_ckv.shape[0] == append_kpe.shape[0], "append_ckv and append_kpe need one row per token")
    for name, rows, cache in (("append_ckv", append_ckv, ckv_cache), ("append_kpe", append_kpe, kpe_cache)):
        require(
            rows.shape[1] == cache.shape[2] and rows.dtype == cache.dtype,
            f"{name} is [T, {rows.shape[1]}] {rows.dtype}, its cache [.., {cache.shape[2]}] {cache.dtype}",
        )
    seq_lens = check_page_table(
        kv_indptr, kv_indices, kv_last_page_len, num_pages, page_size, ckv_cache.device
    )
    _check_positions(batch_indices, positions, append_ckv.shape[0], seq_lens)


def kv_append_mla(
    append_ckv: Tensor,
    append_kpe: Tensor,
    batch_indices: Tensor,
    positions: Tensor,
    ckv_cache: Tensor,
    kpe_cache: Tensor,
    kv_indices: Tensor,
    kv_indptr: Tensor,
    kv_last_page_len: Tensor,
    validate: bool = True,
) -> None:
    """MLA latent append: ckv [T, 512] and kpe [T, 64] into [pages, P, 512] and [pages, P, 64].

    The two caches may be views of one [pages, P, 576] tensor (one latent "head" per token).
    """
    if validate:
        check_kv_append_mla(
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
    # One latent "head" per token: rows [T, 1, D] into caches viewed as [pages, P, 1, D] (NHD).
    _launch(
        append_ckv.unsqueeze(1),
        append_kpe.unsqueeze(1),
        ckv_cache.unsqueeze(2),
        kpe_cache.unsqueeze(2),
        "NHD",
        ckv_cache.shape[1],
        batch_indices=batch_indices,
        positions=positions,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
    )


# ---- plain-torch references -------------------------------------------------------------------------


def _scatter_ref(rows: Tensor, cache: Tensor, kv_layout: str, page: Tensor, entry: Tensor) -> None:
    token_major(cache, kv_layout)[page, entry] = rows


def kv_append_ref(
    append_key: Tensor,
    append_value: Tensor,
    batch_indices: Tensor,
    positions: Tensor,
    paged_kv_cache: Tensor | tuple[Tensor, Tensor],
    kv_indices: Tensor,
    kv_indptr: Tensor,
    kv_last_page_len: Tensor,
    kv_layout: str = "HND",
) -> None:
    """Reference for kv_append (same arguments; kv_last_page_len is only checked by the launcher)."""
    k_cache, v_cache = split_kv_cache(paged_kv_cache, kv_layout)
    page_size = cache_geometry(k_cache, kv_layout)[2]
    page, entry = page_entry_of(batch_indices, positions, kv_indptr, kv_indices, page_size)
    _scatter_ref(append_key, k_cache, kv_layout, page, entry)
    _scatter_ref(append_value, v_cache, kv_layout, page, entry)


def kv_append_slots_ref(
    append_key: Tensor,
    append_value: Tensor,
    paged_kv_cache: Tensor | tuple[Tensor, Tensor],
    slots: Tensor,
    kv_layout: str = "HND",
) -> None:
    """Reference for kv_append_slots."""
    check_layout(kv_layout)
    k_cache, v_cache = split_kv_cache(paged_kv_cache, kv_layout)
    page_size = cache_geometry(k_cache, kv_layout)[2]
    keep = slots >= 0
    slots = slots[keep].long()
    for rows, cache in ((append_key[keep], k_cache), (append_value[keep], v_cache)):
        _scatter_ref(rows, cache, kv_layout, slots // page_size, slots % page_size)


def kv_append_mla_ref(
    append_ckv: Tensor,
    append_kpe: Tensor,
    batch_indices: Tensor,
    positions: Tensor,
    ckv_cache: Tensor,
    kpe_cache: Tensor,
    kv_indices: Tensor,
    kv_indptr: Tensor,
    kv_last_page_len: Tensor,
) -> None:
    """Reference for kv_append_mla."""
    page, entry = page_entry_of(batch_indices, positions, kv_indptr, kv_indices, ckv_cache.shape[1])
    ckv_cache[page, entry] = append_ckv
    kpe_cache[page, entry] = append_kpe
