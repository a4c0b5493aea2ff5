"""Batch-invariant forms of a step's two batch-dependent operations on the CPU: a token's result is the same
bits whatever else its step holds (other sequences, more of its own prompt, a decode or a prefill step).

- `linear_rows`: x @ w^T one row at a time, each row the product a decode step of one sequence computes
  (one shape for every call, so one kernel and one summation order, whatever the kernel picks by M: the
  int8 copy of a Q8Weight up to 32 rows and torch's GEMM past them, oneDNN's blocking by M); a
  PanelWeight's panels sum each row alone at any M, so all its rows go in one call.
- `causal_attention`: every query token attends over its own causal prefix (`token_tables`: a page
  table per token, made once a step) as a decode query would
  (pdkernels.ops.decode_attention's C++ loop: one sequence a thread, one order over its pages), whether it
  is a decode token or one of a prompt's chunk: a prompt computed in one step, in chunks, or beside other
  requests gives each of its tokens the same attention, and so the same KV to the next layer.

What it costs is measured by `make profile-cpu` (docs/results/engine-cpu.md). The C++ extension is needed:
without it the torch fallback of the attention pads each batch to its longest sequence, and a sum over a
padded row is another tree of additions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pdkernels import cpu, ops
from pdkernels.decode_attention_cpu import decode_attention_cpu


def available() -> bool:
    """Whether this machine can run these (the C++ extension is built and loads)."""
    return cpu.module() is not None


def linear_rows(x: Tensor, w) -> Tensor:
    """x [M, K] @ w^T -> [M, N], each row alone (w: a tensor or pdkernels.cpu.PackedWeight)."""
    if isinstance(w, cpu.Q8Weight):  # one C++ call: passes of up to 3 rows, each row summed as alone
        return cpu.module().q8_linear(x.contiguous(), w.q, w.scales, w.offsets, w.shape[0], rows_alone=True)
    if isinstance(w, cpu.PanelWeight):  # one C++ call: the panels sum each row alone whatever M
        return cpu.module().bf16_linear(x.contiguous(), w.panels, w.shape[0])
    if x.shape[0] == 1:
        return ops.linear(_aligned(x), w, validate=False)
    rows = [ops.linear(_aligned(x[m : m + 1]), w, validate=False) for m in range(x.shape[0])]
    if not rows:
        return x.new_empty((0, w.shape[0]))
    return torch.cat(rows)


def _aligned(row: Tensor) -> Tensor:
    """row contiguous at a 64-byte boundary, as a fresh tensor is: a kernel may start a row elsewhere
    differently (a first partial vector), which would make its sums depend on the row's place in x."""
    row = row.contiguous()
    return row if row.data_ptr() % 64 == 0 else row.clone()


def token_tables(
    batch_indices: Tensor, positions: Tensor, kv_indptr: Tensor, kv_indices: Tensor, page_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Page tables (kv_indptr, kv_indices, kv_last_page_len) of one pseudo-sequence per token: token t of
    sequence b at position p sees the pages of b holding positions 0..p, the last of them p % page_size + 1
    tokens."""
    b, p = batch_indices.long(), positions.long()
    pages = p // page_size + 1  # [T]
    indptr = torch.zeros(pages.numel() + 1, dtype=torch.int64, device=pages.device)
    torch.cumsum(pages, 0, out=indptr[1:])
    total = int(indptr[-1])
    token = torch.repeat_interleave(
        torch.arange(pages.numel(), device=pages.device), pages, output_size=total
    )
    within = torch.arange(total, device=pages.device) - indptr[token]  # the page's index in its sequence
    indices = kv_indices.long()[kv_indptr.long()[b[token]] + within]
    last = p % page_size + 1
    return indptr.to(torch.int32), indices.to(torch.int32), last.to(torch.int32)


def causal_attention(
    q: Tensor, paged_kv_cache: Tensor, kv_indptr: Tensor, kv_indices: Tensor, kv_last_page_len: Tensor
) -> Tensor:
    """q [T, Hq, D]: each token's attention over its causal prefix in a 5-D HND cache that already holds
    this step's KV, given each token's own page table (token_tables) -> [T, Hq, D]."""
    if cpu.for_cache(paged_kv_cache) is None:
        raise ValueError(
            "batch-invariant attention runs the C++ decode loop over a contiguous 5-D HND cache on the CPU; "
            f"got a {tuple(paged_kv_cache.shape)} cache on {paged_kv_cache.device} (contiguous: "
            f"{paged_kv_cache.is_contiguous()}), C++ extension built: {available()}"
        )
    return decode_attention_cpu(q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len)
