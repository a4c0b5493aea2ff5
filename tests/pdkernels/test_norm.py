"""The residual add + RMSNorm: the C++ pass (pdkernels.cpu) against the torch reference."""

import pytest
import torch

from pdkernels import cpu, ops
from pdkernels.norm import add_rms_norm_ref

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("rows", [1, 37])  # one decode row; more rows than a thread's share
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dim", [576, 40])  # whole 16-lane groups (AVX-512 in bf16), and not
def test_the_cpu_pass_equals_the_reference_and_updates_the_stream(dtype, rows, with_residual, dim):
    if cpu.module() is None:
        pytest.skip("the CPU extension is not built here")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, dim, generator=g).to(dtype)
    residual = torch.randn(rows, dim, generator=g).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype)
    want_x = x.clone()
    want = add_rms_norm_ref(want_x, weight, 1e-5, residual)
    got = ops.add_rms_norm(x, weight, 1e-5, residual)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(x, want_x, atol=0, rtol=0)  # the add: the same rounding as torch's
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_bad_shapes_name_the_field():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight must be"):
        ops.add_rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="residual must be"):
        ops.add_rms_norm(x, torch.ones(8), 1e-5, torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"x must be \[T, D\]"):
        ops.add_rms_norm(torch.randn(8), torch.ones(8), 1e-5)
