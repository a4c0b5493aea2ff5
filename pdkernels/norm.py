"""The residual add and RMSNorm that open each half of a decoder layer.

`add_rms_norm_ref` is the specification (plain torch, as Hugging Face's Llama RMSNorm: fp32 statistics,
the normalized row rounded to the model's dtype, then times the weight); pdkernels.ops.add_rms_norm runs
the C++ pass of pdkernels.cpu on the CPU where it is built, this elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pdkernels._paging import require

__all__ = ["add_rms_norm_ref", "check_add_rms_norm"]


def add_rms_norm_ref(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """x [T, D]: x += residual in place (when given); returns rms_norm(x) * weight, a new tensor."""
    if residual is not None:
        x.add_(residual)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def check_add_rms_norm(x: Tensor, weight: Tensor, residual: Tensor | None) -> None:
    require(x.dim() == 2, f"x must be [T, D], got {tuple(x.shape)}")
    require(
        weight.shape == (x.shape[1],) and weight.dtype == x.dtype,
        f"weight must be [D={x.shape[1]}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}",
    )
    require(
        residual is None or (residual.shape == x.shape and residual.dtype == x.dtype),
        f"residual must be {tuple(x.shape)} {x.dtype}, got {residual is not None and tuple(residual.shape)}",
    )
