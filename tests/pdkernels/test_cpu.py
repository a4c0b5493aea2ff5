"""pdkernels.cpu's prepacked bf16 and int8-block fp32 weights behind pdkernels.ops (the C++ paged-cache
paths are tested beside their references in test_decode_attention.py and test_kv_append.py)."""

from pathlib import Path

import pytest
import torch

from pdkernels import cpu, cpuinfo, ops
from pdkernels.out_proj import make_layer_counter


def _packed(n=96, k=64, seed=0, onednn_only=False):
    """A bf16 weight and what cpu.pack makes of it (PanelWeight on AVX-512 BF16 without AMX), or with
    onednn_only oneDNN's layout alone (whose bits are torch.mm's at any M)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    p = cpu.pack(w)
    if not isinstance(p, cpu.PackedWeight):
        pytest.skip("this torch has no oneDNN weight packing")
    return w, cpu.PackedWeight(w) if onednn_only else p


@pytest.mark.parametrize("m", [1, 7, 20, 65, 300])
def test_a_packed_weight_gives_the_plain_gemms_bits(m):
    w, p = _packed(onednn_only=True)
    x = torch.randn(m, 64).to(torch.bfloat16)
    assert torch.equal(ops.linear(x, p), torch.mm(x, w.t()))
    out = torch.empty(m, 96, dtype=torch.bfloat16)
    assert ops.linear(x, p, out=out) is out and torch.equal(out, torch.mm(x, w.t()))
    strided = torch.randn(m, 128).to(torch.bfloat16)[:, ::2]  # a view, as the model's slices are
    assert torch.equal(ops.linear(strided, p), torch.mm(strided, w.t()))


@pytest.mark.parametrize("m", [256, 600])
def test_on_two_threads_each_takes_its_rows_and_inference_mode_holds(m):
    """Two threads and a weight that fits a core's L2: each thread multiplies its half of the rows
    (linear_cpu.cpp packed_linear), inside InferenceMode as the engine calls it (the worker thread is not in
    it, and an in-place copy into the output there raised)."""
    w, p = _packed()
    x = torch.randn(m, 128).to(torch.bfloat16)[:, ::2]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            y = ops.linear(x, p)
            out = ops.linear(x, p, out=torch.empty(m, 96, dtype=torch.bfloat16))
    finally:
        torch.set_num_threads(before)
    half = (m + 1) // 2
    want = torch.cat([torch.mm(x[:half], w.t()), torch.mm(x[half:], w.t())])
    assert torch.equal(y, want) and torch.equal(out, want)
    assert torch.allclose(y.float(), x.float() @ w.float().t(), rtol=2e-2, atol=2e-2)


def test_out_proj_on_a_packed_weight_bumps_its_layer_once():
    w, p = _packed(onednn_only=True)
    counter = make_layer_counter(4, torch.device("cpu"))
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(ops.out_proj(x, p, counter=counter, layer=2), torch.mm(x, w.t()))
    assert counter[0].tolist() == [0, 0, 1, 0]


def test_only_bf16_cpu_weights_are_packed_and_bad_inputs_are_named(monkeypatch):
    w32 = torch.randn(8, 4)
    assert cpu.pack(w32) is w32  # fp32 that is not int8 blocks: left as is
    _, p = _packed()
    with pytest.raises(ValueError, match=r"x must be \[M, K=64\] torch.bfloat16"):
        ops.linear(torch.randn(2, 64), p)  # fp32 x
    with pytest.raises(ValueError, match=r"x must be \[M, K=64\]"):
        ops.linear(torch.randn(2, 32).to(torch.bfloat16), p)
    monkeypatch.setenv("PDKERNELS_CPU_EXT", "0")
    w = torch.randn(8, 4).to(torch.bfloat16)
    assert cpu.pack(w) is w  # turned off: the plain weight


def test_a_build_killed_mid_way_does_not_hang_the_next_process(tmp_path, monkeypatch):
    """torch's build lock outlives a builder that was killed; the next process waited on it forever.
    Here: a copy of the built extension with such a lock beside it, in a private extensions folder."""
    import os
    import shutil
    import subprocess
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    if cpu.module() is None:
        pytest.skip("no C++ extension on this machine")
    name = f"pdkernels_paged_cpu_{cpu._build_tag()}"
    built = _get_build_directory(name, verbose=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    target = _get_build_directory(name, verbose=False)  # where the child looks
    shutil.copytree(built, target, dirs_exist_ok=True)
    target = Path(target)
    (target / "lock").write_text("")  # what a killed build leaves
    code = "from pdkernels import cpu; print(cpu.module() is not None)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=os.getcwd()
    )
    assert out.stdout.strip() == "True", out.stderr[-2000:]
    assert not (target / "lock").exists()


def test_native_bf16_is_read_off_the_cpus_flags(monkeypatch):
    """model.dtype=auto picks bf16 only where the CPU computes in it (serving.config.ModelSpec)."""
    for flags, want in [
        ("flags : fpu sse2 avx2 fma f16c", False),
        ("flags : avx2 avx512f avx512_bf16", True),
        ("flags : avx2 avx512f amx_tile amx_bf16", True),
        ("flags : avx512f avx512_bf16x", False),  # whole flags only
    ]:
        monkeypatch.setattr(cpuinfo, "flags", lambda flags=flags: flags)
        assert cpuinfo.native_bf16() is want, flags


def test_the_extension_builds_wherever_a_compiler_is():
    """A C++ error must fail here, not quietly turn the CPU paths off (their tests would then skip)."""
    import shutil

    if shutil.which("c++") is None or shutil.which("ninja") is None and not _has_ninja():
        pytest.skip("no C++ compiler or ninja: the torch code serves")
    assert cpu.module() is not None, "the CPU extension did not build: see the warning logged above"


def _has_ninja() -> bool:
    import importlib.util

    return importlib.util.find_spec("ninja") is not None


def _int8_blocks(n, k, kind, seed=0):
    """An fp32 weight [n, k] as a GGUF file dequantizes it: per 32 of a row an fp16 scale and q in [-127,
    127] (Q8_0), or fp16 scale and min and q in [0, 15] (Q4_1), w = q * scale + min rounded once."""
    g = torch.Generator().manual_seed(seed)
    blocks = k // 32
    scale = (torch.rand(n, blocks, 1, generator=g) * 0.02 + 1e-3).half().float()
    if kind == "q8_0":
        q = torch.randint(-127, 128, (n, blocks, 32), generator=g).float()
        q[..., 0] = 127  # the block's largest |w| sets its scale, as the quantizer does
        return (q * scale).view(n, k)
    q = torch.randint(0, 16, (n, blocks, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # the block's min and max
    low = (torch.randn(n, blocks, 1, generator=g) * 0.05).half().float()
    return (q * scale + low).view(n, k)


def _ext():
    if cpu.module() is None:
        pytest.skip("pdkernels' CPU extension could not be built here (no C++ compiler)")
    if not hasattr(cpu.module(), "q8_linear"):
        pytest.skip("the int8-block kernel is built for AVX2 + FMA CPUs only")


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
@pytest.mark.parametrize("m", [1, 3, 13, 25, 32, 33])
@pytest.mark.parametrize("n", [96, 101])
def test_an_int8_block_weight_is_packed_and_multiplies_like_the_fp32_one(kind, m, n):
    """Up to Q8_MAX_M rows from the int8 copy (the same weights, another summation order; passes of up to
    12 rows, 13 and 25 split unevenly; 101 columns leave a part-filled last panel of 8), more rows the fp32
    GEMM itself (its bits); the copy holds the weights exactly."""
    _ext()
    w = _int8_blocks(n, 320, kind)
    p = cpu.pack(w)
    assert isinstance(p, cpu.Q8Weight) and p.q.dtype == torch.int8 and p.q.shape == (-(-n // 8), 320, 8)
    assert torch.equal(p.dequantized(), w)
    x = torch.randn(m, 400, generator=torch.Generator().manual_seed(m))[:, :320]  # a view, as the model's
    y = ops.linear(x, p)
    if m > cpu.Q8_MAX_M:
        assert torch.equal(y, torch.mm(x, w.t()))
    else:  # any summation order of fp32 products is within K * eps * sum |x w| of the exact sum
        exact = x.double() @ w.double().t()
        bound = (x.abs().double() @ w.abs().double().t()) * 320 * 2.0**-24
        assert bool(((y.double() - exact).abs() <= bound).all())
    out = torch.full((m, n), float("nan"))
    assert ops.linear(x, p, out=out) is out and torch.equal(out, y)


def test_the_int8_kernel_refuses_a_copy_that_does_not_fit():
    """q8_linear checks the panels against x and N (a wrong call is an error, not a read past the end)."""
    _ext()
    p = cpu.pack(_int8_blocks(16, 64, "q8_0"))
    ext = cpu.module()
    with pytest.raises(RuntimeError, match="N must be"):
        ext.q8_linear(torch.randn(2, 64), p.q, p.scales, p.offsets, 17)
    with pytest.raises(RuntimeError, match="K = x's columns"):
        ext.q8_linear(torch.randn(2, 96), p.q, p.scales, p.offsets, 16)
    with pytest.raises(RuntimeError, match="scales and offsets"):
        ext.q8_linear(torch.randn(2, 64), p.q, p.scales[:1], p.offsets, 16)


def test_an_fp32_weight_that_is_not_exactly_int8_blocks_stays_as_it_is():
    """Random weights, a block one ulp off, K not a multiple of 32: the plain weight (the int8 copy is
    only taken where it holds the same numbers)."""
    _ext()
    for w in (torch.randn(8, 64), torch.randn(8, 40)):
        assert cpu.pack(w) is w
    near = _int8_blocks(16, 128, "q4_1", seed=3)
    near[7, 77] = torch.nextafter(near[7, 77], torch.tensor(1.0))
    assert cpu.pack(near) is near
    zeros = torch.zeros(4, 64)  # all-zero blocks are exact (scale 0)
    assert isinstance(cpu.pack(zeros), cpu.Q8Weight) and torch.equal(
        ops.linear(torch.ones(1, 64), cpu.pack(zeros)), torch.zeros(1, 4)
    )


def test_out_proj_on_an_int8_block_weight_bumps_its_layer_once():
    _ext()
    w = _int8_blocks(64, 64, "q8_0", seed=4)
    counter = make_layer_counter(2, torch.device("cpu"))
    x = torch.randn(2, 64)
    torch.testing.assert_close(ops.out_proj(x, cpu.pack(w), counter=counter, layer=1), x @ w.t())
    assert counter[0].tolist() == [0, 1]


def _panels_ext():
    if cpu.module() is None or not hasattr(cpu.module(), "bf16_linear"):
        pytest.skip("the bf16 panel kernel is built for AVX-512 BF16 CPUs only")
    return cpu.module()


@pytest.mark.parametrize("m", [1, 5, 12, 13, 20, 32, 40])
@pytest.mark.parametrize("n", [96, 101])
def test_bf16_panels_give_the_exact_sum_rounded_once_where_every_sum_is_exact(m, n):
    """Small integers (|x|, |w| <= 8, K 320: every partial sum below 2^24, exact in fp32 in any order): each
    output is the exact product rounded to bf16 once, so any slip of the packing, a pass's rows (12 a pass;
    13, 20 and 40 split unevenly) or the masked last panel (101 columns) shows as a wrong bit."""
    ext = _panels_ext()
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = torch.randint(-8, 9, (n, 320), generator=g).to(torch.bfloat16)
    x = torch.randint(-8, 9, (m, 400), generator=g).to(torch.bfloat16)[:, :320]  # a view: rows 400 apart
    y = ext.bf16_linear(x, ext.bf16_pack_panels(w), n)
    assert y.dtype == torch.bfloat16 and torch.equal(y, (x.double() @ w.double().t()).to(torch.bfloat16))


@pytest.mark.parametrize("m", [1, 7, 20, 32, 33, 70])
def test_a_panel_weight_multiplies_within_bf16_s_rounding_and_each_row_as_alone(m):
    """Random weights: each output within half a bf16 ulp of an fp32 sum that is itself within K * eps of the
    exact one; up to PANEL_MAX_M rows through the panels, each row the same bits as that row alone (the
    sums run per lane in k's order, whatever the pass holds), more rows oneDNN's GEMM (its bits)."""
    _panels_ext()
    w, p = _packed(n=101, k=576, seed=m)
    assert isinstance(p, cpu.PanelWeight) == cpu.panels_serve()
    if not isinstance(p, cpu.PanelWeight):
        pytest.skip("this CPU keeps oneDNN's kernels (AMX): panels are not made")
    assert p.panels.shape == (4, 288, 32, 2) and torch.equal(
        p.panels[3, :, 5:], torch.zeros(288, 27, 2).bfloat16()
    )
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    y = ops.linear(x, p)
    if m > cpu.PANEL_MAX_M:
        assert torch.equal(y, cpu.module().packed_linear(x, p.data))
        return
    exact = x.double() @ w.double().t()
    bound = (x.abs().double() @ w.abs().double().t()) * 576 * 2.0**-24 + exact.abs() * 2.0**-8
    assert bool(((y.double() - exact).abs() <= bound * 1.01).all())
    for i in range(m):
        assert torch.equal(y[i], ops.linear(x[i : i + 1].clone(), p)[0])


def test_the_bf16_panel_kernel_refuses_what_does_not_fit():
    """Shapes and dtypes are checked against the panels (a wrong call is an error naming what it must be,
    not a read past the end); an odd K gets no panels (vdpbf16ps takes pairs) and multiplies as before."""
    ext = _panels_ext()
    panels = ext.bf16_pack_panels(torch.randn(40, 64).to(torch.bfloat16))
    assert panels.shape == (2, 32, 32, 2)
    x = torch.randn(3, 64).to(torch.bfloat16)
    for bad, match in (
        ((x, panels, 65), "N must be"),
        ((x, panels, 32), "N must be"),
        ((torch.randn(3, 66).to(torch.bfloat16), panels, 40), "K = x's columns"),
        ((x.float(), panels, 40), r"x must be \[M, K\] bf16"),
        ((x, panels.float(), 40), "panels must be"),
        ((x, panels[:, :, :16].contiguous(), 40), "panels must be"),
        ((torch.randn(3, 65).to(torch.bfloat16)[:, :64], panels, 40), "even columns"),
    ):
        with pytest.raises(RuntimeError, match=match):
            ext.bf16_linear(*bad)
    with pytest.raises(RuntimeError, match="even number of columns"):
        ext.bf16_pack_panels(torch.randn(8, 63).to(torch.bfloat16))
    assert ext.bf16_linear(x[:0], panels, 40).shape == (0, 40)
    odd = torch.randn(8, 63).to(torch.bfloat16)
    p = cpu.pack(odd)
    assert type(p) is cpu.PackedWeight
    ones = torch.ones(2, 63).to(torch.bfloat16)
    assert torch.equal(ops.linear(ones, p), torch.mm(ones, odd.t()))
