"""workload.load: the Poisson rate as a multiple of one worker's prefill capacity, measured here first."""

import logging

import pytest

from experiments import capacity
from experiments.config import LengthDist, from_cfg
from experiments.run import run
from tests.experiments.runs import TINY, _cfg


def test_the_rate_is_load_times_the_measured_capacity(monkeypatch, caplog):
    config = from_cfg(_cfg([*TINY[:1], "workload.load=1.5", "workload.prompt_len.value=200"]))
    seen = []

    def measured(cfg, prompt):
        seen.append(prompt)
        return 1000.0  # prompt tokens/s

    monkeypatch.setattr(capacity, "prefill_tokens_s", measured)
    with caplog.at_level(logging.INFO, logger="experiments.capacity"):
        assert capacity.rate_for_load(config) == 7.5  # 1.5 x 1,000 / 200
    assert seen == [200] and "so the rate is 7.50 req/s" in caplog.text


def test_a_real_warm_up_measures_and_the_run_takes_that_rate(tmp_path):
    """tiny-random through the main job: the measured rate is the one the run reports."""
    overrides = [*TINY, "workload.arrival=poisson", "workload.load=2", "deployment=colocated"]
    (record,) = run(_cfg(overrides), tmp_path, progress=False)
    assert record["summary"]["completed"] == 6 and record["rate"] > 0
    assert capacity.prefill_tokens_s(from_cfg(_cfg(TINY[:1])), 21) > 0


def test_the_expected_prompt_length_of_each_kind():
    assert LengthDist(kind="fixed", value=64).expected == 64
    assert LengthDist(kind="uniform", low=256, high=768).expected == 512
    assert LengthDist(kind="lognormal", mean=300.0).expected == 300.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["workload.load=0"], "workload.load"),
        (["workload.load=1", "workload.arrival=concurrency"], "workload.load=1 is not allowed"),
        (["workload.load=1", "workload.arrival=poisson", "goodput_search.rates=[1,2]"], "both set the rate"),
    ],
)
def test_a_load_that_cannot_be_is_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        run(_cfg([*TINY, *overrides]), tmp_path, progress=False)
