"""The torch backend's paged decode attention on the CPU (pdkernels.ops): in C++ over the pages where the
extension is built (pdkernels/csrc/decode_cpu.cpp), else in torch with fewer passes than
decode_attention_ref."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pdkernels import cpu
from pdkernels._paging import padded_page_table, seq_lens_from_page_table

__all__ = ["decode_attention_cpu"]


def decode_attention_cpu(
    q: Tensor,
    paged_kv_cache: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    sm_scale: float | None = None,
    max_seq_len: int | None = None,
) -> Tensor:
    """The CPU path of pdkernels.ops (backend torch) for a 5-D HND cache: decode_attention_ref's math, in C++
    reading the pages in place (pdkernels.cpu) where it is built; otherwise in torch with fewer passes
    than the reference. Every sequence's pages are gathered once, K and V together (index_select: whole
    pages, no per-token indexing), cast to fp32 and laid out head-major in one copy; each kv head's
    query heads then attend with two batched matmuls. decode_attention_ref pays two strided gathers, a
    relayout and a cast per K and per V, and builds its padding mask for every call, which at batch 1
    costs more than the arithmetic."""
    batch, num_heads, head_dim = q.shape
    _, _, num_kv_heads, page_size, _ = paged_kv_cache.shape
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    ext = cpu.for_cache(paged_kv_cache)
    if ext is not None:  # C++: over the pages where they lie (pdkernels/csrc/decode_cpu.cpp)
        tables = (t.to(torch.int32).contiguous() for t in (kv_indptr, kv_indices, kv_last_page_len))
        return ext.decode_attention(q.float().contiguous(), paged_kv_cache, *tables, scale).to(q.dtype)
    group = num_heads // num_kv_heads
    if max_seq_len is not None:
        n = -(-max_seq_len // page_size)
    else:
        n = int((kv_indptr[1:] - kv_indptr[:-1]).max()) if batch else 0
    if batch == 1 and kv_indices.numel() == n:  # one sequence, its pages in order: the table as is
        table = kv_indices.long()
    else:
        table = padded_page_table(kv_indptr, kv_indices, n).reshape(-1)
    pages = paged_kv_cache.index_select(0, table).view(batch, n, 2, num_kv_heads, page_size, head_dim)
    kv = torch.empty(2, batch, num_kv_heads, n, page_size, head_dim, device=q.device)
    kv.copy_(pages.permute(2, 0, 3, 1, 4, 5))  # fp32, [K|V, B, Hkv, L, D]
    k, v = kv.view(2, batch * num_kv_heads, n * page_size, head_dim)
    qg = q.float().reshape(batch * num_kv_heads, group, head_dim)  # q may be a strided view (qkv)
    scores = torch.baddbmm(qg.new_empty(()), qg, k.transpose(1, 2), beta=0.0, alpha=scale)
    lens = seq_lens_from_page_table(kv_indptr, kv_last_page_len, page_size)
    if batch and (batch > 1 or int(lens[0]) < n * page_size):  # tokens past a sequence's end
        pad = torch.arange(n * page_size, device=q.device) >= lens[:, None]  # [B, L]
        scores = scores.view(batch, num_kv_heads, group, -1).masked_fill_(pad[:, None, None], float("-inf"))
    probs = torch.softmax(scores.view(batch * num_kv_heads, group, -1), dim=-1)
    out = torch.bmm(probs.nan_to_num_(0.0), v)  # a sequence with no token: zeros, as the reference
    return out.view(batch, num_heads, head_dim).to(q.dtype)
