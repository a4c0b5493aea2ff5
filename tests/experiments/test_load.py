"""The load client (experiments/load.py) reads why a server refused or failed a request, and asks for the
workload's sampling as OpenAI's and vLLM's fields."""

from types import SimpleNamespace

import pytest

from experiments.config import sampling_of
from experiments.load import _kind, _sampling
from serving.messages import ErrorKind


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


def test_the_workload_s_sampling_is_asked_for_as_vllm_s_fields():
    """Defaults: greedy, top_p 1, ignore_eos (the workload's); any other SamplingParams field set in
    workload.sampling goes in the body under vLLM's name, in JSON's types."""
    assert _sampling(sampling_of({}), 8) == {
        "max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    given = {
        "temperature": 0.7, "seed": 3, "top_k": 5, "min_p": 0.1, "stop": ["\n\n"], "logit_bias": {"7": -100},
        "structured_outputs": {"choice": ["yes", "no"]}, "ignore_eos": False, "cache_salt": "a",
    }  # fmt: skip
    args = _sampling(sampling_of(given), 4)
    assert args == {
        "max_tokens": 4, "temperature": 0.7, "top_p": 1.0, "seed": 3,
        "extra_body": {
            "ignore_eos": False, "top_k": 5, "min_p": 0.1, "stop": ["\n\n"], "logit_bias": {"7": -100.0},
            "structured_outputs": {"choice": ["yes", "no"]}, "cache_salt": "a",
        },
    }  # fmt: skip
