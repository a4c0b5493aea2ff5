"""pdkernels.cpu's prepacked bf16 weights behind pdkernels.ops (the C++ paged-cache paths are tested
beside their references in test_decode_attention.py and test_kv_append.py)."""

from pathlib import Path

import pytest
import torch

from pdkernels import cpu, ops
from pdkernels.out_proj import make_layer_counter


def _packed(n=96, k=64, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    p = cpu.pack(w)
    if not isinstance(p, cpu.PackedWeight):
        pytest.skip("this torch has no oneDNN weight packing")
    return w, p


@pytest.mark.parametrize("m", [1, 7, 20, 65, 300])
def test_a_packed_weight_gives_the_plain_gemms_bits(m):
    w, p = _packed()
    x = torch.randn(m, 64).to(torch.bfloat16)
    assert torch.equal(ops.linear(x, p), torch.mm(x, w.t()))
    out = torch.empty(m, 96, dtype=torch.bfloat16)
    assert ops.linear(x, p, out=out) is out and torch.equal(out, torch.mm(x, w.t()))
    strided = torch.randn(m, 128).to(torch.bfloat16)[:, ::2]  # a view, as the model's slices are
    assert torch.equal(ops.linear(strided, p), torch.mm(strided, w.t()))


def test_out_proj_on_a_packed_weight_bumps_its_layer_once():
    w, p = _packed()
    counter = make_layer_counter(4, torch.device("cpu"))
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(ops.out_proj(x, p, counter=counter, layer=2), torch.mm(x, w.t()))
    assert counter[0].tolist() == [0, 0, 1, 0]


def test_only_bf16_cpu_weights_are_packed_and_bad_inputs_are_named(monkeypatch):
    w32 = torch.randn(8, 4)
    assert cpu.pack(w32) is w32  # fp32: oneDNN's packed fp32 GEMM rounds differently; left as is
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
    """model.dtype=auto picks bf16 only where the CPU computes in it (experiments.deploy.config.ModelSpec)."""
    for flags, want in [
        ("flags : fpu sse2 avx2 fma f16c", False),
        ("flags : avx2 avx512f avx512_bf16", True),
        ("flags : avx2 avx512f amx_tile amx_bf16", True),
        ("flags : avx512f avx512_bf16x", False),  # whole flags only
    ]:
        monkeypatch.setattr(cpu, "_flags", lambda flags=flags: flags)
        assert cpu.native_bf16() is want, flags


def test_the_extension_builds_wherever_a_compiler_is():
    """A C++ error must fail here, not quietly turn the CPU paths off (their tests would then skip)."""
    import shutil

    if shutil.which("c++") is None or shutil.which("ninja") is None and not _has_ninja():
        pytest.skip("no C++ compiler or ninja: the torch code serves")
    assert cpu.module() is not None, "the CPU extension did not build: see the warning logged above"


def _has_ninja() -> bool:
    import importlib.util

    return importlib.util.find_spec("ninja") is not None
