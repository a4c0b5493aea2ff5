import pytest
import torch

from pdkernels import ops
from pdkernels.out_proj import make_layer_counter
from pdkernels.testing import append_positions, make_paged_cache


@pytest.fixture
def backend():
    yield ops.set_backend
    ops.set_backend("auto")


def _everything(case, q, k, v, batch_indices, positions, x, w):
    """Run each op once through ops and return what it produced."""
    tables = (case.kv_indices, case.kv_indptr, case.kv_last_page_len)
    cache = case.cache.clone()
    ops.kv_append(k, v, batch_indices, positions, cache, *tables)
    page_tables = (cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    counter = make_layer_counter(2)
    qo_indptr = torch.tensor([0, 1, 3, 6], dtype=torch.int32)
    return dict(
        cache=cache,
        decode=ops.decode_attention(q[:3], *page_tables),
        extend=ops.extend_attention(q, qo_indptr, *page_tables),
        linear=ops.linear(x, w),
        out_proj=ops.out_proj(x, w, counter=counter, layer=1),
        counter=counter,
    )


def test_triton_and_torch_backends_agree(backend):
    case = make_paged_cache([1, 17, 50], 2, 16, 4)
    batch_indices, positions = append_positions(case, [1, 2, 3])
    k, v = torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    q, x, w = torch.randn(6, 4, 16), torch.randn(3, 64), torch.randn(24, 64)
    assert ops.resolve("decode_attention", q.device) == "torch"  # auto: the references on CPU tensors
    backend("triton")  # the interpreter is on in tests
    assert ops.resolve("decode_attention", q.device) == "triton"
    got = _everything(case, q, k, v, batch_indices, positions, x, w)
    backend("torch")
    assert ops.resolve("decode_attention", q.device) == "torch"
    ref = _everything(case, q, k, v, batch_indices, positions, x, w)
    for name in ref:
        exact = name in ("cache", "counter")
        torch.testing.assert_close(got[name], ref[name], atol=0 if exact else 1e-4, rtol=0 if exact else 1e-5)
    assert ref["counter"].tolist() == [[0, 1], [0, 0]]


def test_torch_backend_checks_inputs_too(backend):
    backend("torch")
    case = make_paged_cache([8], 2, 16, 4)
    k = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="outside its page table"):
        ops.kv_append(
            k,
            k,
            torch.tensor([0]),
            torch.tensor([8]),
            case.cache,
            case.kv_indices,
            case.kv_indptr,
            case.kv_last_page_len,
        )
    with pytest.raises(ValueError, match="K must match"):
        ops.linear(torch.randn(1, 4), torch.randn(2, 5))


def test_out_parameter_on_torch_backend(backend):
    backend("torch")
    case = make_paged_cache([5, 9], 2, 16, 4)
    q = torch.randn(2, 2, 16)
    out = torch.empty_like(q)
    got, lse = ops.decode_attention(
        q, case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len, out=out, return_lse=True
    )
    assert got.data_ptr() == out.data_ptr() and lse.shape == (2, 2)


def test_backend_names_are_checked(backend):
    with pytest.raises(ValueError, match="backend must be one of"):
        backend("cutlass")
    backend("flashinfer")
    with pytest.raises(ValueError, match="'flashinfer' needs a CUDA device"):
        ops.resolve("decode_attention", torch.device("cpu"))
    assert ops.resolve("linear", torch.device("cpu")) == "triton"  # GEMMs are never FlashInfer's


@pytest.mark.parametrize("rows, n", [(1, 1), (3, 15), (20, 49152), (4, 100)])
def test_argmax_gives_torchs_indices(rows, n):
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(n))
    assert torch.equal(ops.argmax(x), x.argmax(-1))
    ties = torch.zeros(rows, n)  # equal maxima: the first
    assert torch.equal(ops.argmax(ties), ties.argmax(-1)) and ops.argmax(ties).tolist() == [0] * rows


def test_argmax_on_nan_inf_and_strided_rows_is_torchs():
    x = torch.randn(5, 40)
    x[0, 7] = float("nan")
    x[0, 30] = float("inf")  # a NaN beats an infinity: torch's rule
    x[1, 33] = float("inf")
    x[2] = float("-inf")
    x[3, 39] = float("nan")  # in the tail past the last 16 lanes
    x[3, 2] = float("nan")
    x[4, 35] = 1e30
    assert torch.equal(ops.argmax(x), x.argmax(-1))
    assert ops.argmax(x).tolist()[:4] == [7, 33, 0, 2]
    wide = torch.randn(6, 80)[::2, :50]  # rows of a larger tensor
    assert torch.equal(ops.argmax(wide), wide.argmax(-1))
    assert torch.equal(ops.argmax(x.double()), x.double().argmax(-1))  # other dtypes: torch's own


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, width", [(1, 16), (7, 40), (64, 1536)])
def test_silu_mul_is_swiglus_two_ops(dtype, rows, width):
    gate_up = (torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(width)) * 4).to(dtype)
    gate_up[0, :3] = torch.tensor([-200.0, 200.0, 0.0])  # far out on both sides, and zero
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = ops.silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == (rows, width)
    # the same roundings; exp may differ from torch's in fp32's last bit, so a bf16 result by one unit
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6,
                               atol=1e-6)  # fmt: skip
    if dtype == torch.bfloat16:
        assert int((got != want).sum()) <= max(1, got.numel() // 100)
    strided = torch.cat([gate_up, gate_up], dim=1)[:, : 2 * width]  # rows of a wider tensor
    assert torch.equal(ops.silu_mul(strided), got)
