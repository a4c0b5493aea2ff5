import pytest
import torch
import triton

from pdkernels.out_proj import LIBRARY_M, make_layer_counter, out_proj, out_proj_ref
from pdkernels.splitk_gemm import tile_tickets

TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (1e-2, 2e-3), torch.bfloat16: (6e-2, 1.6e-2)}
BLOCK_M, BLOCK_N = 16, 32


def _inputs(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)


def _num_tiles(m, n):
    return triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("m", [1, 17, 50])
def test_out_proj_matches_ref_and_bumps_once(m, dtype):
    x, w = _inputs(m, 96, 80, dtype)
    counter, expected_counter = make_layer_counter(4), make_layer_counter(4)
    y = out_proj(x, w, counter=counter, layer=2, block_m=BLOCK_M, block_n=BLOCK_N)
    ref = out_proj_ref(x, w, counter=expected_counter, layer=2)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(y, ref, atol=atol, rtol=rtol)
    assert counter.tolist() == expected_counter.tolist() == [[0, 0, 1, 0], [0, 0, 0, 0]]


def test_out_proj_counter_does_not_change_the_output():
    x, w = _inputs(33, 70, 64, torch.float16)
    plain = out_proj(x, w)
    counted = out_proj(x, w, counter=make_layer_counter(1))
    torch.testing.assert_close(counted, plain, atol=0, rtol=0)


@pytest.mark.parametrize("seed", range(6))
def test_ticket_under_random_tile_orders(seed):
    """Any program-to-tile order: every tile is computed, the counter moves exactly once, tickets reset."""
    m, n = 50, 100
    x, w = _inputs(m, n, 48, torch.float32, seed)
    order = torch.randperm(_num_tiles(m, n), generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    counter = make_layer_counter(3)
    y = torch.full((m, n), float("nan"))
    out_proj(x, w, out=y, counter=counter, layer=1, tile_order=order, block_m=BLOCK_M, block_n=BLOCK_N)
    torch.testing.assert_close(y, out_proj_ref(x, w), atol=1e-4, rtol=1e-5)
    assert counter.tolist() == [[0, 1, 0], [0, 0, 0]]


@pytest.mark.parametrize("seed", range(4))
def test_counter_waits_for_the_last_tile(seed):
    """Tiles split across two launches (some still 'in flight'): no bump until the last one lands."""
    m, n = 40, 64
    x, w = _inputs(m, n, 32, torch.float32, seed)
    tiles = _num_tiles(m, n)
    order = torch.randperm(tiles, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    cut = 1 + seed % (tiles - 1)
    counter = make_layer_counter(2)
    y = torch.full((m, n), float("nan"))
    kwargs = dict(out=y, counter=counter, layer=0, block_m=BLOCK_M, block_n=BLOCK_N)
    out_proj(x, w, tile_order=order[:cut], **kwargs)
    assert counter.tolist() == [[0, 0], [cut, 0]]
    assert torch.isnan(y).any()
    out_proj(x, w, tile_order=order[cut:], **kwargs)
    assert counter.tolist() == [[1, 0], [0, 0]]
    torch.testing.assert_close(y, out_proj_ref(x, w), atol=1e-4, rtol=1e-5)


def test_counter_counts_passes_per_layer():
    x, w = _inputs(20, 40, 16, torch.float32)
    counter = make_layer_counter(3)
    for _ in range(3):
        for layer in range(3):
            out_proj(x, w, counter=counter, layer=layer, block_m=BLOCK_M, block_n=BLOCK_N)
    out_proj(x, w, counter=counter, layer=0, block_m=BLOCK_M, block_n=BLOCK_N)
    assert counter.tolist() == [[4, 3, 3], [0, 0, 0]]


def test_out_proj_rejects_bad_input():
    x, w = _inputs(4, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="counter dtype"):
        out_proj(x, w, counter=torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"counter must be \[2, num_layers\]"):
        out_proj(x, w, counter=torch.zeros(3, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="layer must lie in"):
        out_proj(x, w, counter=make_layer_counter(2), layer=2)
    with pytest.raises(ValueError, match="tile_order must hold distinct"):
        out_proj(x, w, tile_order=torch.tensor([0, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="num_layers must be"):
        make_layer_counter(0)


@pytest.mark.parametrize("split_k", [2, 5])
def test_split_out_proj_bumps_once_in_one_launch(split_k):
    """Split-K: each tile's last slice sums it, the last tile finished bumps the counter; every ticket
    (the tiles' scratch and the layer's) is back to zero."""
    x, w = _inputs(19, 70, 320, torch.float32, seed=5)
    counter = make_layer_counter(3)
    for passes in (1, 2):
        y = out_proj(x, w, counter=counter, layer=1, block_m=BLOCK_M, block_n=BLOCK_N, split_k=split_k)
        torch.testing.assert_close(y, out_proj_ref(x, w), atol=1e-4, rtol=1e-5)
        assert counter.tolist() == [[0, passes, 0], [0, 0, 0]]
    assert int(tile_tickets(x.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("m, gemm", [(130, "auto"), (5, "library")])
def test_library_out_proj_bumps_after_the_gemm(m, gemm):
    """Prefill M (gemm="auto" from LIBRARY_M rows) or gemm="library": torch's GEMM, bit-equal to the
    reference, then one program's bump."""
    assert m < LIBRARY_M or gemm == "auto"
    x, w = _inputs(m, 48, 64, torch.float32, seed=6)
    counter = make_layer_counter(2)
    y = out_proj(x, w, counter=counter, layer=1, gemm=gemm)
    assert torch.equal(y, out_proj_ref(x, w))
    assert counter.tolist() == [[0, 1], [0, 0]]


def test_out_proj_rejects_unknown_gemm():
    x, w = _inputs(4, 8, 16, torch.float32)
    allowed = r"gemm must be one of \('auto', 'triton', 'library'\), got 'cublas'"
    with pytest.raises(ValueError, match=allowed):
        out_proj(x, w, gemm="cublas")
