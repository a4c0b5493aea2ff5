"""The torch backend's causal extend attention on the CPU (pdkernels.ops): in C++ over the pages where the
extension is built with AVX2 + FMA (pdkernels/csrc/extend_cpu.cpp), except in bf16 on CPUs that compute in
it; else extend_attention_ref's page gathers, then each request's attention over its keys with the masked
blocks skipped: torch's flash kernel, or, in bf16 on CPUs with AVX-512 BF16 but no AMX, blocks of query
rows on oneDNN's bf16 GEMMs with the C++ softmax.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from pdkernels import cpu
from pdkernels.cpuinfo import amx_bf16, native_bf16
from pdkernels.extend_attention import requests_kv

__all__ = ["extend_attention_cpu", "causal_attention", "blocked_causal_attention"]


def causal_attention(q: Tensor, k: Tensor, v: Tensor, sm_scale: float) -> Tensor:
    """The last n = len(q) positions of a sequence attending causally over its L keys: q [n, Hq, D], k, v
    [Hkv, L, D] -> [n, Hq, D]. What extend_attention_ref's masked SDPA computes, with the masked blocks
    skipped: torch's flash kernel with is_causal over the chunk's own keys (upper-left aligned,
    which for the chunk's square is the causal mask), and over the context before the chunk, when there
    is one, with no mask, the two merged by their log-sum-exps: no work on the masked half. In bf16 on AMX
    CPUs our own (pdkernels/csrc/attention_amx.cpp: oneDNN's brgemm tiles, each kv head's keys packed once
    for its group); in bf16 on AVX-512 BF16 CPUs without AMX, blocked_causal_attention. Each is the faster
    where it is picked (timings: docs/results/kernels.md)."""
    n, L = q.shape[0], k.shape[1]
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and native_bf16():
        ext = cpu.module()
        if not amx_bf16():
            return blocked_causal_attention(q, k, v, sm_scale)
        if hasattr(ext, "causal_attention_amx") and q.shape[-1] % 32 == 0 and q.stride(-1) == 1:
            return ext.causal_attention_amx(q, k.contiguous(), v.contiguous(), sm_scale)
    qh = q.transpose(0, 1)[None]  # [1, Hq, n, D]
    group = q.shape[1] // k.shape[0]
    if n == L:
        out = F.scaled_dot_product_attention(
            qh, k[None], v[None], is_causal=True, scale=sm_scale, enable_gqa=True
        )
        return out[0].transpose(0, 1)
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is None or q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16):
        keep = (
            torch.arange(L, device=q.device)[None, :] <= (L - n + torch.arange(n, device=q.device))[:, None]
        )
        out = F.scaled_dot_product_attention(
            qh, k[None], v[None], attn_mask=keep, scale=sm_scale, enable_gqa=True
        )
        return out[0].transpose(0, 1)
    kh, vh = (t.repeat_interleave(group, 0)[None] for t in (k, v))  # the private op has no GQA
    o_new, lse_new = flash(qh, kh[:, :, L - n :], vh[:, :, L - n :], 0.0, True, scale=sm_scale)[:2]
    o_old, lse_old = flash(qh, kh[:, :, : L - n], vh[:, :, : L - n], 0.0, False, scale=sm_scale)[:2]
    top = torch.maximum(lse_new, lse_old)
    w_new, w_old = torch.exp(lse_new - top), torch.exp(lse_old - top)  # [1, Hq, n] fp32
    out = (o_new.float() * w_new[..., None] + o_old.float() * w_old[..., None]) / (w_new + w_old)[..., None]
    return out[0].transpose(0, 1).to(q.dtype)


BLOCK_ROWS = 64  # query positions per block of blocked_causal_attention (the fastest of 64-512 where timed)


def blocked_causal_attention(q: Tensor, k: Tensor, v: Tensor, sm_scale: float) -> Tensor:
    """causal_attention in blocks of BLOCK_ROWS query positions, each against the keys up to its last
    position: one batched GEMM for the scores and one for the values per block (a GQA group's heads
    stacked as rows), the softmax in fp32, only the diagonal block masked. On CPUs that compute in bf16
    these are oneDNN's bf16 GEMMs: faster than torch's flash kernel on AVX-512 BF16 without AMX, slower
    with AMX and in fp32, so causal_attention picks it in bf16 on AVX-512 BF16 CPUs without AMX only
    (timings: docs/results/kernels.md)."""
    n, num_heads, dim = q.shape
    num_kv_heads, L, _ = k.shape
    group = num_heads // num_kv_heads
    qg = q.view(n, num_kv_heads, group, dim).permute(1, 2, 0, 3)  # [Hkv, group, n, D]
    out = torch.empty(num_kv_heads, group, n, dim, dtype=q.dtype, device=q.device)
    offset = L - n  # the positions before the chunk (a cached prefix or earlier chunks)
    ext = cpu.module() if q.device.type == "cpu" else None
    for i in range(0, n, BLOCK_ROWS):
        rows = min(BLOCK_ROWS, n - i)
        end = offset + i + rows  # the keys these positions see
        qi = qg[:, :, i : i + rows].reshape(num_kv_heads, group * rows, dim)
        scores = torch.bmm(qi, k[:, :end].transpose(1, 2)).view(num_kv_heads * group, rows, end)
        if ext is not None:  # the scale, mask, fp32 softmax and cast in one C++ pass
            probs = ext.causal_softmax(scores, sm_scale)
        else:
            scores = scores.float().mul_(sm_scale)
            diagonal = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu_(1)
            scores[..., end - rows :].masked_fill_(diagonal, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
        probs = probs.view(num_kv_heads, group * rows, end)
        out[:, :, i : i + rows] = torch.bmm(probs, v[:, :end]).view(num_kv_heads, group, rows, dim)
    return out.permute(2, 0, 1, 3).reshape(n, num_heads, dim)


def extend_attention_cpu(
    q: Tensor,
    qo_indptr: Tensor,
    paged_kv_cache: Tensor | tuple[Tensor, Tensor],
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    kv_layout: str = "HND",
    sm_scale: float | None = None,
) -> Tensor:
    """The torch backend's causal extend attention (pdkernels.ops). On a 5-D HND cache where the CPU
    extension has it (built with AVX2 + FMA), in C++ over the pages where they lie (extend_cpu.cpp: a
    flash-style online softmax in fp32, the query heads of a GQA group sharing each key's load), except in
    bf16 on CPUs that compute in it: there, with AMX, each request's pages gathered and its attention on
    AMX tiles, all in C++ (attention_amx.cpp), else oneDNN's bf16 GEMMs (blocked_causal_attention). Else
    extend_attention_ref's gathers, then each request's attention by causal_attention."""
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    ext = cpu.for_cache(paged_kv_cache)
    if (
        ext is not None
        and hasattr(ext, "extend_attention")
        and kv_layout == "HND"
        and q.shape[-1] % 32 == 0
        and not (q.dtype == torch.bfloat16 and native_bf16())
    ):
        tables = (
            t.to(torch.int32).contiguous() for t in (qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
        )
        return ext.extend_attention(q.float().contiguous(), paged_kv_cache, *tables, sm_scale).to(q.dtype)
    if (  # bf16 on AMX: every request in C++ (attention_amx.cpp's loop, which the C++ layers run too)
        hasattr(ext, "extend_attention_amx")
        and kv_layout == "HND"
        and q.dtype == torch.bfloat16
        and amx_bf16()
        and q.shape[-1] % 32 == 0
        and q.stride(-1) == 1
    ):
        tables = (
            t.to(torch.int32).contiguous() for t in (qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
        )
        return ext.extend_attention_amx(q, paged_kv_cache, *tables, sm_scale)
    parts = [
        (lo, hi, causal_attention(q[lo:hi], k, v, sm_scale))
        for lo, hi, k, v in requests_kv(
            qo_indptr, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout, ext
        )
    ]
    if len(parts) == 1 and parts[0][:2] == (0, q.shape[0]):  # one request, every row: no zeros, no copy
        return parts[0][2]
    out = torch.zeros_like(q)
    for lo, hi, o in parts:
        out[lo:hi] = o
    return out
