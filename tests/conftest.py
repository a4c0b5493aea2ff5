"""Run Triton kernels under the interpreter when no GPU is present; must happen before kernels import."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="module")
def model_backend(request):
    """Engine and transfer tests run models on the torch references (the interpreter would take minutes);
    kernel tests call the kernels directly, and one engine test opts back into Triton."""
    if request.module.__name__.startswith("tests.pdkernels"):
        yield
        return
    from pdkernels import ops

    ops.set_backend("torch")
    yield
    ops.set_backend("auto")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
