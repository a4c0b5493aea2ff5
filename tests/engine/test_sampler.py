import pytest
import torch

from engine.sampler import sample
from engine.sequence import SamplingParams


def test_greedy_and_top_k_1_pick_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1)] * 2
    assert sample(logits, params, [None] * 4) == logits.argmax(-1).tolist()


def test_seeded_sampling_repeats_and_top_p_keeps_the_head():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=7)
    draws = [sample(logits, [p], [torch.Generator().manual_seed(7)])[0] for _ in range(2)]
    assert draws[0] == draws[1]
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-6)
    assert sample(logits, [tiny_p], [None]) == logits.argmax(-1).tolist()


def test_temperature_spreads_the_draws():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    draws = [sample(logits, [SamplingParams(temperature=1.0)], [g])[0] for _ in range(300)]
    counts = [draws.count(i) for i in range(3)]
    assert counts[0] > counts[1] > counts[2] > 0  # softmax([2, 1, 0]) = 0.67, 0.24, 0.09


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"top_p": 0}, "top_p must be in"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
