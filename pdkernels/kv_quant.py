"""FP8 (e4m3) KV pages with their scales: quantize and dequantize, torch references.

A page's K (or V) of one head is scaled by its own amax (per page and head: a page written whole by a
prefill pass, one scale per [P, D] block), or a whole tensor by one amax (per tensor: vLLM's static
k_scale / v_scale, here the best such scale, its data's own amax). e4m3 keeps 3 mantissa bits: a value in
range comes back within 2^-4 of itself relative, and values under the scale's 2^-9 flush towards zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pdkernels import cpu

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
TINY = 1e-12  # the scale of an all-zero block (its values come back zero)


def quantize(x: Tensor, dims: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """x (float) -> (e4m3 values, float32 scales): one scale per index of the dims not reduced, x's amax
    over dims over FP8_MAX; scales keep the reduced dims (size 1) so that they broadcast."""
    amax = x.detach().abs().float().amax(dim=dims, keepdim=True)
    scale = (amax / FP8_MAX).clamp_min(TINY)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return (q.float() * scale).to(dtype)


def page_dims(kv_layout: str) -> tuple[int, ...]:
    """The dims of a paged cache [pages, planes, H, P, D] (HND) or [pages, planes, P, H, D] (NHD) that one
    page-and-head scale covers: the page's tokens and the head's dims."""
    if kv_layout not in ("HND", "NHD"):
        raise ValueError(f"kv_layout must be one of ('HND', 'NHD'), got {kv_layout!r}")
    return (3, 4) if kv_layout == "HND" else (2, 4)


def round_trip_pages(cache: Tensor, kv_layout: str = "HND") -> Tensor:
    """A paged cache [pages, planes, ...] through e4m3 with a scale per page, plane and head."""
    q, scale = quantize(cache, page_dims(kv_layout))
    return dequantize(q, scale, cache.dtype)


def round_trip_tensor(cache: Tensor) -> Tensor:
    """The same through one scale per plane (K, V) for the whole cache: per-tensor static scales."""
    dims = tuple(d for d in range(cache.dim()) if d != 1)
    q, scale = quantize(cache, dims)
    return dequantize(q, scale, cache.dtype)


def scales_shape(cache_shape: tuple[int, ...], kv_layout: str) -> tuple[int, ...]:
    """A paged cache's scales: one float32 per page, plane and head (the cache [..., pages, planes, H, P, D]
    in HND or [..., pages, planes, P, H, D] in NHD: the same leading dims, then planes and heads)."""
    heads = cache_shape[-3] if kv_layout == "HND" else cache_shape[-2]
    return (*cache_shape[:-3], heads)


def _broadcast(scales: Tensor, kv_layout: str) -> Tensor:
    """[..., planes, H] -> what multiplies [..., planes, H, P, D] (HND) or [..., planes, P, H, D] (NHD)."""
    return scales[..., None, None] if kv_layout == "HND" else scales[..., None, :, None]


def gather_pages(cache: Tensor, scales: Tensor, kv_indices: Tensor, kv_layout: str, dtype: torch.dtype):
    """The pages kv_indices names, dequantized into a compact cache of their own, and kv_indices renumbered
    into it: (pages [n, planes, ...] in dtype, indices). Any attention over a paged cache then runs over
    an e4m3 one, each page read once however many sequences share it."""
    pages, inverse = torch.unique(kv_indices.long(), return_inverse=True)
    return dequantized_pages(cache, scales, pages, kv_layout, dtype), inverse.to(kv_indices.dtype)


def dequantized_pages(
    cache: Tensor, scales: Tensor, pages: Tensor, kv_layout: str, dtype: torch.dtype
) -> Tensor:
    """cache[pages] dequantized into dtype: on the CPU the C++ extension's one pass (the same bits as
    dequantize; torch's e4m3 conversion ran a byte at a time), else dequantize."""
    ext = cpu.for_cache(cache)
    if ext is not None and scales.dim() == 3 and scales.is_contiguous() and hasattr(ext, "gather_dequantize"):
        return ext.gather_dequantize(cache, scales, pages, kv_layout == "HND", dtype)
    return dequantize(cache[pages], _broadcast(scales[pages], kv_layout), dtype)


def append_pages(
    key: Tensor,
    value: Tensor | None,
    batch_indices: Tensor,
    positions: Tensor,
    cache: Tensor,
    scales: Tensor,
    kv_indices: Tensor,
    kv_indptr: Tensor,
    kv_layout: str = "HND",
) -> None:
    """kv_append into an e4m3 cache with a scale per page, plane and head: token t of sequence
    batch_indices[t] at positions[t] goes to row positions[t] % P of that sequence's page positions[t] // P.
    value None: a cache of one plane (an MLA latent cache, its rows the key's [T, 1, D]).

    Each page written to is scaled again by the amax of its rows filled so far (the rows after the last one
    written are a reused page's leftovers: zeroed, never counted). A page filled over several steps is so
    rounded again whenever a new row raises its amax: its earlier rows lose up to 2^-4 more each time (a
    page written whole, by a prefill pass, is rounded once)."""
    page_size = cache.shape[3] if kv_layout == "HND" else cache.shape[2]
    b, pos = batch_indices.long(), positions.long()
    written = kv_indices.long()[kv_indptr.long()[b] + pos // page_size]
    row = pos % page_size
    pages, inverse = torch.unique(written, return_inverse=True)
    filled = torch.zeros(len(pages), dtype=torch.long, device=cache.device)
    filled.scatter_reduce_(0, inverse, row + 1, "amax")
    x = dequantized_pages(cache, scales, pages, kv_layout, torch.float32)  # [n, planes, ...]
    rows_first = x.permute(0, 3, 1, 2, 4) if kv_layout == "HND" else x.permute(0, 2, 1, 3, 4)  # a view
    rows_first[inverse, row] = (key[:, None] if value is None else torch.stack([key, value], dim=1)).float()
    keep = torch.arange(page_size, device=cache.device)[None, :] < filled[:, None]  # [n, P]
    x *= keep[:, None, None, :, None] if kv_layout == "HND" else keep[:, None, :, None, None]
    q, s = quantize(x, page_dims(kv_layout))
    cache[pages] = q
    scales[pages] = s[..., 0, 0] if kv_layout == "HND" else s[:, :, 0, :, 0]
