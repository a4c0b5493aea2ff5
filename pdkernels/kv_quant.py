"""FP8 (e4m3) KV pages with their scales: quantize and dequantize, torch references.

A page's K (or V) of one head is scaled by its own amax (per page and head: a page written whole by a
prefill pass, one scale per [P, D] block), or a whole tensor by one amax (per tensor: vLLM's static
k_scale / v_scale, here the best such scale, its data's own amax). e4m3 keeps 3 mantissa bits: a value in
range comes back within 2^-4 of itself relative, and values under the scale's 2^-9 flush towards zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

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
