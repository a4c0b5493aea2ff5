import pytest

from pdkernels import ops


@pytest.fixture(autouse=True, scope="module")
def torch_backend():
    """Engine tests run the torch references (the kernels have their own tests); one test opts back in."""
    ops.set_backend("torch")
    yield
    ops.set_backend("auto")
