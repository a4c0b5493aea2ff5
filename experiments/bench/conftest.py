"""CPU benchmark runs use the Triton interpreter: its figures are sanity checks, not speed."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROUNDS = int(os.environ.get("PDKERNELS_BENCH_ROUNDS", "3"))


@pytest.fixture
def run(benchmark):
    """Time fn over a fixed, small number of rounds (interpreted kernels take ~0.1 s a call)."""

    def _run(fn, *args, **kwargs):
        return benchmark.pedantic(fn, args=args, kwargs=kwargs, rounds=ROUNDS, iterations=1, warmup_rounds=1)

    return _run
