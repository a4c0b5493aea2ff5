import pytest
import torch

from pdkernels.splitk_gemm import splitk_gemm, splitk_gemm_ref, tile_tickets

# (dtype, atol, rtol): fp32 accumulation in both; they differ by summation order and the final cast
TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (1e-2, 2e-3), torch.bfloat16: (6e-2, 1.6e-2)}


def _inputs(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("m", [1, 4, 17, 64])
@pytest.mark.parametrize("n, k, split_k", [(70, 300, 3), (64, 1000, None), (33, 129, 7), (16, 64, 1)])
def test_splitk_gemm_matches_ref(m, n, k, split_k, dtype):
    x, w = _inputs(m, n, k, dtype)
    y = splitk_gemm(x, w, split_k=split_k)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(y, splitk_gemm_ref(x, w), atol=atol, rtol=rtol)


def test_splitk_gemm_out_and_strided_input():
    """out= is filled in place; x may be a column slice of a wider activation (row stride != K)."""
    wide = torch.randn(5, 400)
    x = wide[:, 100:300]
    w = torch.randn(48, 200)
    out = torch.full((5, 48), float("nan"))
    y = splitk_gemm(x, w, out=out, split_k=4)
    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, splitk_gemm_ref(x, w), atol=1e-4, rtol=1e-5)


def test_splitk_gemm_split_count_does_not_change_result_much():
    x, w = _inputs(3, 40, 1024, torch.float32, seed=1)
    ys = [splitk_gemm(x, w, split_k=s) for s in (1, 2, 8)]
    for y in ys[1:]:
        torch.testing.assert_close(y, ys[0], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: (torch.randn(2, 8), torch.randn(4, 9)), "K must match"),
        (lambda: (torch.randn(2, 8), torch.randn(4, 8).half()), "w dtype"),
        (lambda: (torch.randn(2, 3, 8), torch.randn(4, 8)), "x must have 2 dims"),
        (lambda: (torch.randn(8, 2).t(), torch.randn(4, 8)), "contiguous in its last dim"),
        (lambda: (torch.randint(0, 3, (2, 8)), torch.randint(0, 3, (4, 8))), "x dtype"),
    ],
)
def test_splitk_gemm_rejects_bad_input(make, message):
    x, w = make()
    with pytest.raises(ValueError, match=message):
        splitk_gemm(x, w)


def test_splitk_gemm_rejects_bad_out_and_split():
    x, w = _inputs(2, 4, 8, torch.float32)
    with pytest.raises(ValueError, match=r"out must be \[M, N\]"):
        splitk_gemm(x, w, out=torch.empty(4, 2))
    with pytest.raises(ValueError, match="split_k must be"):
        splitk_gemm(x, w, split_k=0)


@pytest.mark.parametrize("m, n, k, split_k", [(3, 40, 1000, 3), (17, 130, 640, 5), (1, 64, 128 * 7, 4)])
def test_splitk_gemm_reduces_in_one_launch_and_leaves_tickets_zero(m, n, k, split_k):
    """The last K-slice of each tile sums the partials (uneven block counts: 8 blocks in 3 slices, 7 in
    4); the ticket scratch is back to zero for the next launch, and a second call gives the same bits."""
    x, w = _inputs(m, n, k, torch.float32, seed=2)
    y = splitk_gemm(x, w, split_k=split_k)
    torch.testing.assert_close(y, splitk_gemm_ref(x, w), atol=1e-4, rtol=1e-5)
    assert int(tile_tickets(x.device, 1).abs().sum()) == 0
    assert torch.equal(splitk_gemm(x, w, split_k=split_k), y)


def test_splitk_gemm_more_slices_than_blocks():
    """split_k above K's block count is cut to one slice a block (no empty slice reads garbage)."""
    x, w = _inputs(2, 24, 200, torch.float32, seed=3)
    torch.testing.assert_close(splitk_gemm(x, w, split_k=64), splitk_gemm_ref(x, w), atol=1e-4, rtol=1e-5)
    assert int(tile_tickets(x.device, 1).abs().sum()) == 0
