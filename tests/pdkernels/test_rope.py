"""Rotary embedding: the C++ pass (pdkernels.cpu) against the torch reference, bit for bit."""

from types import SimpleNamespace

import pytest
import torch

from pdkernels import cpu, ops
from pdkernels.rope import rope_ref


def _tables(tokens, half, seed=0):
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(tokens, 1, half, generator=g) * 100
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cpu_pass_gives_the_references_bits(dtype, monkeypatch):
    """fp32 too: no fused multiply-add, so fp32 greedy parity with transformers keeps holding."""
    if cpu.module() is None:
        pytest.skip("the CPU extension is not built here")
    calls = []
    ext = cpu.module()
    counted = SimpleNamespace(rope=lambda *a: calls.append(1) or ext.rope(*a))
    monkeypatch.setattr(cpu, "module", lambda: counted)
    cos, sin = _tables(37, 32)
    qkv = torch.randn(37, 15, 64).to(dtype)  # the model's q and k are a view of the fused projection
    qk = qkv[:, :12]
    assert torch.equal(ops.rope(qk, cos, sin), rope_ref(qk, cos, sin))
    latent = torch.randn(37, 80).to(dtype)[:, None, 16:]  # MLA's rope slice of a latent row: [T, 1, 64]
    assert torch.equal(ops.rope(latent, cos, sin), rope_ref(latent, cos, sin))
    assert len(calls) == 2


def test_bad_shapes_name_the_field_and_odd_tables_take_the_reference():
    cos, sin = _tables(4, 8)
    with pytest.raises(ValueError, match=r"x must be \[T, H, D\] with D even"):
        ops.rope(torch.randn(4, 2, 15), cos, sin)
    with pytest.raises(ValueError, match=r"cos must be \(4, 1, 8\) float32"):
        ops.rope(torch.randn(4, 2, 16), cos.double(), sin)
    with pytest.raises(ValueError, match=r"sin must be \(4, 1, 8\)"):
        ops.rope(torch.randn(4, 2, 16), cos, sin[:3])
    x = torch.randn(4, 2, 16)
    wide = cos.expand(4, 2, 8)  # a broadcast table: not the C++ pass's layout, so the reference serves
    assert torch.equal(ops.rope(x, wide, sin.expand(4, 2, 8), validate=False), rope_ref(x, wide, sin))
