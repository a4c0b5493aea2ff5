"""The C++ extension's AVX2 paths on a CPU that also has AVX-512: under PDKERNELS_CPU_ISA=avx2 the extension
is built without AVX-512 and AMX and the process sees an AVX2-only CPU (fp32 by `dtype: auto`, the int8-block
kernel, no bf16 panels), and the CPU kernels' tests against their references run again in such a process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdkernels import cpu, cpuinfo

ROOT = Path(__file__).resolve().parents[2]
# the tests of every kernel with an AVX2 and an AVX-512 path (decode attention, the projections, the C++
# step against the Python layers, batch invariance)
FILES = [
    "tests/pdkernels/test_decode_attention.py",
    "tests/pdkernels/test_cpu.py",
    "tests/pdkernels/test_invariant.py",
    "tests/engine/test_model.py",
]
CHECK = """
from pdkernels import cpu, cpuinfo
ext = cpu.module()
assert cpuinfo.isa() == "avx2" and cpuinfo.auto_dtype() == "float32" and not cpu.panels_serve()
assert hasattr(ext, "q8_linear") and not hasattr(ext, "bf16_linear"), "the extension was built with AVX-512"
print("avx2 build", ext.__name__)
"""


def test_a_bad_value_is_refused_naming_the_allowed_ones(monkeypatch):
    monkeypatch.setenv("PDKERNELS_CPU_ISA", "avx1024")
    with pytest.raises(ValueError, match="PDKERNELS_CPU_ISA='avx1024': the allowed values are native, avx2"):
        cpuinfo.forced_isa()


def test_the_avx2_paths_pass_the_kernels_tests_on_a_cpu_with_avx512(tmp_path):
    if not cpuinfo.isa().startswith("avx512") and cpuinfo.isa() != "amx":
        pytest.skip(f"this CPU computes with {cpuinfo.isa()}: its AVX2 paths are what the suite runs already")
    if cpu.module() is None or "avx2" not in cpuinfo.flags().split():
        pytest.skip("the C++ extension is not built here, or the CPU has no AVX2")
    env = {**os.environ, "PDKERNELS_CPU_ISA": "avx2", "TMPDIR": str(tmp_path)}
    check = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert check.returncode == 0, check.stderr[-3000:]
    pytest_args = ["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-m", "not slow", *FILES]
    run = subprocess.run([sys.executable, "-m", "pytest", *pytest_args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=840)  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:]
    assert " passed" in run.stdout.splitlines()[-1]
