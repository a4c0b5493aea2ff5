"""Rotary position embedding in Hugging Face's half-split layout, as the engine applies it to Q and K.

`rope_ref` is the specification (plain torch: the two halves of each head rotated in fp32, rounded to x's
dtype); pdkernels.ops.rope runs the C++ pass of pdkernels.cpu on the CPU where it is built (bit-identical:
no fused multiply-add), this elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pdkernels._paging import require

__all__ = ["check_rope", "rope_ref"]


def rope_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D], cos and sin [T, 1, D/2] fp32: [x1 cos - x2 sin, x2 cos + x1 sin] per head (new)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def check_rope(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    require(x.dim() == 3 and x.shape[-1] % 2 == 0, f"x must be [T, H, D] with D even, got {tuple(x.shape)}")
    want = (x.shape[0], 1, x.shape[-1] // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        require(
            tuple(t.shape) == want and t.dtype == torch.float32,
            f"{name} must be {want} float32, got {tuple(t.shape)} {t.dtype}",
        )
