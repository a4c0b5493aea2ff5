"""The load client (experiments/load.py) reads why a server refused or failed a request."""

from types import SimpleNamespace

import pytest

from experiments.deploy.messages import ErrorKind
from experiments.load import _kind


def _error(status: int, code: str | None):
    """What _kind reads of an openai.APIStatusError: its status and its body's code (openai's `code`)."""
    return SimpleNamespace(status_code=status, code=code)


@pytest.mark.parametrize(
    "status, code, kind",
    [
        (503, "worker_lost", ErrorKind.WORKER_LOST),  # ours: the code says it (before: counted rejected)
        (503, "rejected", ErrorKind.REJECTED),
        (503, "cancelled", ErrorKind.CANCELLED),
        (429, "rate_limit_exceeded", ErrorKind.REJECTED),  # over a client's share
        (503, None, ErrorKind.REJECTED),  # another server shedding load
        (400, None, ErrorKind.BAD_REQUEST),
        (504, None, ErrorKind.DEADLINE),
        (500, "not ours", ErrorKind.INTERNAL),
    ],
)
def test_the_error_s_code_decides_its_kind(status, code, kind):
    assert _kind(_error(status, code)) == kind
