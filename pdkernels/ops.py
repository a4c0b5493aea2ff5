"""The one place that picks each op's implementation.

Backends: ``triton`` (our kernels: on CUDA tensors, or on CPU under TRITON_INTERPRET=1), ``torch`` (the
plain references), ``flashinfer`` (CUDA only, for the appends and the attentions; the GEMMs stay
Triton). ``auto`` takes triton on CUDA tensors and torch on CPU tensors (the interpreter is for testing
the kernels: ask for ``triton`` to use it). Choose with ``set_backend`` or the
environment variable PDKERNELS_BACKEND. Every backend gets the same input checks (``validate=False``
skips them where a launcher allows it, e.g. during CUDA-graph capture).
"""

from __future__ import annotations

import os

import torch

from pdkernels import cpu as _cpu
from pdkernels import decode_attention as _dec
from pdkernels import extend_attention as _ext
from pdkernels import kv_append as _kv
from pdkernels import mla_decode as _mla
from pdkernels import norm as _norm
from pdkernels import out_proj as _op
from pdkernels import rope as _rope
from pdkernels import splitk_gemm as _gemm
from pdkernels._paging import INTERPRET, check_attention_inputs, require
from pdkernels.decode_attention_cpu import decode_attention_cpu
from pdkernels.extend_attention_cpu import extend_attention_cpu
from pdkernels.kv_append_cpu import kv_append_cpu

BACKENDS = ("auto", "triton", "torch", "flashinfer")
FLASHINFER_OPS = (
    "kv_append",
    "kv_append_mla",
    "decode_attention",
    "extend_attention",
    "mla_decode_attention",
)
_backend = os.environ.get("PDKERNELS_BACKEND", "auto")


def set_backend(name: str) -> None:
    require(name in BACKENDS, f"backend must be one of {BACKENDS}, got {name!r}")
    global _backend
    _backend = name


def get_backend() -> str:
    return _backend


def resolve(op: str, device: torch.device) -> str:
    """The backend that runs `op` on `device` under the current setting: 'triton', 'torch' or 'flashinfer'."""
    require(_backend in BACKENDS, f"PDKERNELS_BACKEND must be one of {BACKENDS}, got {_backend!r}")
    triton_ok = device.type == "cuda" or INTERPRET
    if _backend == "torch" or (_backend == "auto" and device.type != "cuda"):
        return "torch"
    if _backend == "flashinfer" and op in FLASHINFER_OPS:
        from pdkernels import flashinfer_ops

        require(
            device.type == "cuda" and flashinfer_ops.available(),
            "backend 'flashinfer' needs a CUDA device and the flashinfer-python package (pip install .[gpu])",
        )
        return "flashinfer"
    require(
        triton_ok, f"backend 'triton' needs a CUDA tensor or TRITON_INTERPRET=1, got a {device.type} tensor"
    )
    return "triton"


def _flashinfer():
    from pdkernels import flashinfer_ops

    return flashinfer_ops


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
    """See pdkernels.kv_append.kv_append."""
    args = (
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
    kind = resolve("kv_append", append_key.device)
    if kind == "triton":
        return _kv.kv_append(*args, validate=validate)
    if validate:
        _kv.check_kv_append(*args)
    (kv_append_cpu if kind == "torch" else _flashinfer().kv_append)(*args)


def kv_append_slots(
    append_key, append_value, paged_kv_cache, slots, kv_layout: str = "HND", validate: bool = True
) -> None:
    """See pdkernels.kv_append.kv_append_slots."""
    args = (append_key, append_value, paged_kv_cache, slots, kv_layout)
    if resolve("kv_append_slots", append_key.device) == "triton":
        return _kv.kv_append_slots(*args, validate=validate)
    if validate:
        _kv.check_kv_append_slots(*args)
    _kv.kv_append_slots_ref(*args)


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
    """See pdkernels.kv_append.kv_append_mla."""
    args = (
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
    kind = resolve("kv_append_mla", append_ckv.device)
    if kind == "triton":
        return _kv.kv_append_mla(*args, validate=validate)
    if validate:
        _kv.check_kv_append_mla(*args)
    (_kv.kv_append_mla_ref if kind == "torch" else _flashinfer().kv_append_mla)(*args)


def add_rms_norm(x, weight, eps: float, residual=None, validate: bool = True):
    """x += residual in place (when given), then rms_norm(x) * weight; see pdkernels.norm. On the CPU the
    C++ pass (pdkernels.cpu) where it is built, else the torch reference."""
    if validate:
        _norm.check_add_rms_norm(x, weight, residual)
    ext = _cpu.module() if x.device.type == "cpu" else None
    if ext is not None and x.is_contiguous() and (residual is None or residual.is_contiguous()):
        return ext.add_rms_norm(x, residual, weight.contiguous(), eps)
    return _norm.add_rms_norm_ref(x, weight, eps, residual)


def rope(x, cos, sin, validate: bool = True):
    """Rotary embedding of x [T, H, D] by cos, sin [T, 1, D/2] fp32, a new tensor; see pdkernels.rope. On
    the CPU the C++ pass (pdkernels.cpu) where it is built, else the torch reference."""
    if validate:
        _rope.check_rope(x, cos, sin)
    ext = _cpu.module() if x.device.type == "cpu" else None
    fits = x.dim() == 3 and x.stride(-1) == 1 and x.shape[-1] % 2 == 0
    tables = all(
        t.dtype == torch.float32 and t.is_contiguous() and t.numel() * 2 == x.shape[0] * x.shape[-1]
        for t in (cos, sin)
    )
    if ext is not None and fits and tables:
        return ext.rope(x, cos, sin)
    return _rope.rope_ref(x, cos, sin)


def silu_mul(gate_up):
    """SwiGLU's silu(gate) * up of gate_up [T, 2F] (gate, then up) -> [T, F]; on the CPU the C++ pass
    (pdkernels.cpu) where it is built (each product rounded to the dtype as torch's two ops round it)."""
    ext = _cpu.module() if gate_up.device.type == "cpu" else None
    if ext is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0:
        return ext.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def argmax(x):
    """x.argmax(-1) for logits [R, N]: on the CPU, fp32 with a contiguous last dim, the C++ pass
    (pdkernels.cpu) where it is built (the same indices: the first of equal maxima, a NaN's first)."""
    ext = _cpu.module() if x.device.type == "cpu" else None
    if ext is not None and x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] and x.stride(1) == 1:
        return ext.argmax_rows(x)
    return x.argmax(-1)


def _check_packed(x, w, out) -> None:
    require(
        x.dim() == 2 and x.dtype == w.dtype and x.shape[1] == w.shape[1] and x.device == w.device,
        f"x must be [M, K={w.shape[1]}] {w.dtype} on {w.device} for this packed weight, got "
        f"{list(x.shape)} {x.dtype} on {x.device}",
    )
    require(out is None or tuple(out.shape) == (x.shape[0], w.shape[0]), "out must be [M, N]")


def linear(x, w, out=None, validate: bool = True):
    """y = x @ w^T for decode-sized x [M, K] (split-K GEMM); see pdkernels.splitk_gemm. w may be a
    pdkernels.cpu.PackedWeight (bf16 on the CPU, any M): oneDNN's GEMM on the prepacked weight."""
    if isinstance(w, _cpu.PackedWeight):
        if validate:
            _check_packed(x, w, out)
        return _cpu.linear(x, w, out)
    if validate:
        _gemm.check_linear(x, w, out)
    if resolve("splitk_gemm", x.device) == "triton":
        return _gemm.splitk_gemm(x, w, out=out, validate=False)
    return _gemm.splitk_gemm_ref(x, w, out=out)


def out_proj(x, w, out=None, counter=None, layer: int = 0, validate: bool = True):
    """Attention output projection that bumps counter[0, layer] once; see pdkernels.out_proj."""
    if isinstance(w, _cpu.PackedWeight):  # the CPU: the GEMM, then the bump (as out_proj_ref)
        if validate:
            _check_packed(x, w, out)
            if counter is not None:
                _op.check_counter(counter, layer, x.device)
        y = _cpu.linear(x, w, out)
        if counter is not None:
            counter[0, layer] += 1
        return y
    if validate:
        _gemm.check_linear(x, w, out)
        if counter is not None:
            _op.check_counter(counter, layer, x.device)
    if resolve("out_proj", x.device) == "triton":
        return _op.out_proj(x, w, out=out, counter=counter, layer=layer, validate=False)
    return _op.out_proj_ref(x, w, out=out, counter=counter, layer=layer)


def decode_attention(
    q,
    paged_kv_cache,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    kv_layout: str = "HND",
    sm_scale: float | None = None,
    out=None,
    return_lse: bool = False,
    max_seq_len: int | None = None,
    validate: bool = True,
    split_len=None,
    num_splits: int | None = None,
):
    """See pdkernels.decode_attention.decode_attention (max_seq_len from the host bounds its splits;
    split_len, a device tensor, and num_splits: a CUDA graph's live plan, for the Triton kernel)."""
    args = (q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout)
    kind = resolve("decode_attention", q.device)
    if kind == "triton":
        return _dec.decode_attention(
            *args,
            sm_scale=sm_scale,
            out=out,
            return_lse=return_lse,
            max_seq_len=max_seq_len,
            validate=validate,
            split_len=split_len,
            num_splits=num_splits,
        )
    if validate:
        check_attention_inputs(*args)
    if kind == "flashinfer":
        return _flashinfer().decode_attention(*args, sm_scale=sm_scale, out=out, return_lse=return_lse)
    if kv_layout == "HND" and not return_lse and isinstance(paged_kv_cache, torch.Tensor):
        o = decode_attention_cpu(*args[:5], sm_scale=sm_scale, max_seq_len=max_seq_len)
        return _into(out, o, False)  # the reference's math: in C++ over the pages in place, or fewer passes
    return _into(out, _dec.decode_attention_ref(*args, sm_scale=sm_scale, return_lse=return_lse), return_lse)


def mla_decode_attention(
    q_nope,
    q_pe,
    ckv_cache,
    kpe_cache,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    sm_scale: float,
    out=None,
    max_seq_len: int | None = None,
    validate: bool = True,
):
    """See pdkernels.mla_decode.mla_decode_attention (the absorbed MLA decode)."""
    args = (q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_last_page_len)
    kind = resolve("mla_decode_attention", q_nope.device)
    if kind == "triton":
        return _mla.mla_decode_attention(
            *args, sm_scale=sm_scale, out=out, max_seq_len=max_seq_len, validate=validate
        )
    if validate:
        _mla.check_mla_decode(*args)
    if kind == "flashinfer":
        return _into(out, _flashinfer().mla_decode_attention(*args, sm_scale=sm_scale), False)
    return _into(out, _mla.mla_decode_attention_cpu(*args, sm_scale=sm_scale, max_seq_len=max_seq_len), False)


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
    out=None,
    return_lse: bool = False,
    max_q_len: int | None = None,
    validate: bool = True,
):
    """See pdkernels.extend_attention.extend_attention (max_q_len from the host saves a device sync)."""
    args = (q, qo_indptr, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout)
    kind = resolve("extend_attention", q.device)
    kwargs = {"causal": causal, "sm_scale": sm_scale, "return_lse": return_lse}
    if kind == "triton":
        return _ext.extend_attention(*args, out=out, max_q_len=max_q_len, validate=validate, **kwargs)
    if validate:
        _ext.check_extend_attention(*args)
    if kind == "flashinfer":
        return _flashinfer().extend_attention(*args, out=out, **kwargs)
    if causal and not return_lse:  # the reference's math, the masked blocks skipped
        return _into(out, extend_attention_cpu(*args, sm_scale=sm_scale), False)
    return _into(out, _ext.extend_attention_ref(*args, **kwargs), return_lse)


def _into(out, result, return_lse: bool):
    """Give a reference's result the launchers' `out=` behaviour."""
    if out is None:
        return result
    out.copy_(result[0] if return_lse else result)
    return (out, result[1]) if return_lse else out
