import numpy as np

from experiments.config import LengthDist, WorkloadConfig
from experiments.workload import draw, make_requests


def test_the_simulator_draws_the_requests_a_real_run_sends():
    """Same config, same arrivals and lengths, whether drawn for the simulator or made with token ids."""
    w = WorkloadConfig(
        rate=3.0,
        num_requests=50,
        prompt_len=LengthDist("uniform", low=4, high=300),
        output_len=LengthDist("lognormal", mean=40.0, sigma=0.8),
        seed=7,
    )
    arrivals, prompts, outputs = draw(w, max_position=512)
    reqs = make_requests(w, tokenizer=None, vocab_size=1000, max_position=512)
    assert np.allclose(arrivals, [r.arrival_s for r in reqs])
    assert prompts == [len(r.prompt_ids) for r in reqs] and outputs == [r.max_tokens for r in reqs]
    assert arrivals[0] == 0 and np.all(np.diff(arrivals) >= 0)
    assert len(set(prompts)) > 10  # the lengths do vary


def test_fixed_concurrency_requests_all_arrive_at_once():
    reqs = make_requests(WorkloadConfig(arrival="concurrency", num_requests=5), None, 100, 512)
    assert [r.arrival_s for r in reqs] == [0.0] * 5
