"""The torch backend's KV append on the CPU (pdkernels.ops): in C++ where the extension is built, else
kv_append_ref's scatter."""

from __future__ import annotations

import torch
from torch import Tensor

from pdkernels import cpu
from pdkernels.kv_append import kv_append_ref

__all__ = ["kv_append_cpu"]


def kv_append_cpu(
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
    """The torch backend's kv_append: C++ row copies (pdkernels.cpu) for a 5-D HND cache on the CPU where
    it is built, kv_append_ref otherwise."""
    ext = cpu.for_cache(paged_kv_cache) if kv_layout == "HND" else None
    if ext is None:
        return kv_append_ref(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices,
                             kv_indptr, kv_last_page_len, kv_layout)  # fmt: skip
    i32 = [t.to(torch.int32).contiguous() for t in (batch_indices, positions, kv_indices, kv_indptr)]
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (append_key, append_value))
    ext.kv_append(k, v, i32[0], i32[1], paged_kv_cache, i32[2], i32[3])
