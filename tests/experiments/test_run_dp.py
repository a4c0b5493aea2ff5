"""model.dp through the main job: a colocated worker of two DP groups (engine/dp.py) gives the tokens of
one engine, reports both groups' pages, and frees them all."""

import pytest

from experiments.config import from_cfg
from experiments.deploy.config import check_fits_model
from experiments.run import run
from tests.experiments.runs import TINY, _cfg, _outputs

DEEPSEEK = ["model=tiny-random-deepseek", "deployment=colocated", "deployment.num_workers=1"]


def test_a_dp_worker_gives_the_tokens_of_one_engine(tmp_path):
    (one,) = run(_cfg([*TINY, *DEEPSEEK]), tmp_path / "dp1", progress=False)
    (two,) = run(_cfg([*TINY, *DEEPSEEK, "model.dp=2"]), tmp_path / "dp2", progress=False)
    assert one["summary"]["completed"] == two["summary"]["completed"] == 6
    assert _outputs(one) == _outputs(two)
    (timeline,) = two["timelines"]
    assert timeline["num_pages"] == 2 * 256  # both groups' pages (conf/model/tiny-random-deepseek.yaml)
    assert timeline["free_pages"] == timeline["num_pages"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["deployment=1p1d", "model.dp=2"], "model.dp=2 is not allowed: 1 for deployment 1p1d"),
        (["model.dp=0"], "model.dp"),
        (["model=tiny-random-moe", "deployment=colocated", "model.dp=3"], "tp x dp = 3 ranks divide; got 8"),
    ],
)
def test_a_dp_that_cannot_run_is_refused_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_fits_model(from_cfg(_cfg(["model=tiny-random-deepseek", *overrides])))
