"""Two kinds of test run, chosen by PDKERNELS_TEST_COMPILED before any kernel module is imported.

- Default (`make test`, any machine): every Triton kernel runs under the interpreter on CPU tensors, and
  tests marked `gpu` are skipped. The same tests pass on a machine with or without CUDA.
- PDKERNELS_TEST_COMPILED=1 (`make test-gpu`, `make gpu-check`): only the tests marked `gpu` run, with the
  kernels compiled for the CUDA device and CUDA tensors. Without CUDA they are skipped.
"""

import atexit
import ctypes
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

COMPILED = os.environ.get("PDKERNELS_TEST_COMPILED") == "1"
# this user's state folder (the disk tier's MAC keys, engine/kv/disk.py): the run's own, not the home's
_STATE = tempfile.mkdtemp(prefix="pdk-state-")
os.environ["XDG_STATE_HOME"] = _STATE
# measured machine models (experiments/sim/hardware.py measured_here): the run's own, not the home's
os.environ["PDK_CACHE_DIR"] = os.path.join(_STATE, "cache")
atexit.register(shutil.rmtree, _STATE, ignore_errors=True)
if not COMPILED:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One torch thread a test process (and a process it starts that does not set its own): `make test` runs
# two test processes on two cores, and with torch's default (a thread per core) each, their OpenMP pools
# fought over the cores. Four engine and main-job test files took 416 s so on 2 cores of an AVX2 EPYC, 160 s
# on one thread each. A test about threads sets its own (torch.set_num_threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


_LIBC = ctypes.CDLL(None)


def pytest_runtest_logfinish(nodeid, location):
    """Give the heap a test freed back to the system: glibc keeps it, and a worker of `make test` that
    ran 700 tests held 5 GB of freed memory (test_messenger.py alone: 1.4 GB, 0.5 GB trimmed)."""
    if hasattr(_LIBC, "malloc_trim"):  # glibc
        _LIBC.malloc_trim(0)


def pytest_sessionstart(session):
    """Build pdkernels' C++ CPU paths (pdkernels/cpu.py) once, here, before any test starts processes
    that would otherwise each build or wait for them."""
    from pdkernels import cpu

    cpu.module()


@pytest.fixture(autouse=True, scope="module")
def model_backend(request):
    """Engine and transfer tests run models on the torch references (the interpreter would take minutes);
    kernel tests call the kernels directly, and one engine test opts back into Triton. Compiled runs keep
    `auto`: Triton on CUDA tensors."""
    if COMPILED or request.module.__name__.startswith("tests.pdkernels"):
        yield
        return
    from pdkernels import ops

    ops.set_backend("torch")
    yield
    ops.set_backend("auto")


def pytest_collection_modifyitems(config, items):
    if COMPILED:
        cpu_only = pytest.mark.skip(reason="a CPU-tensor test: run by `make test` (interpreter)")
        no_cuda = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" not in item.keywords:
                item.add_marker(cpu_only)
            elif not torch.cuda.is_available():
                item.add_marker(no_cuda)
        return
    compiled = pytest.mark.skip(reason="compiled kernels on CUDA: run by `make test-gpu` / `make gpu-check`")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(compiled)


@pytest.fixture
def short_tmp(tmp_path):
    """tmp_path / "tmp", a link to a new short folder in /tmp (removed after the test), for a TMPDIR whose
    unix-socket paths stay under the kernel's 107 bytes: the runtime puts a run's private folder in
    TMPDIR only while they do (serving/control.py), and pytest-xdist's tmp_path is longer.
    Pass its resolved path as TMPDIR."""
    real = Path(tempfile.mkdtemp(prefix="pdkt-", dir="/tmp"))
    (tmp_path / "tmp").symlink_to(real)
    yield tmp_path / "tmp"
    shutil.rmtree(real, ignore_errors=True)
