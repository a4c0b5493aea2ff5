"""deployment.dp and decode_dp through the main job: a colocated worker of two DP groups (engine/dp.py),
and a decode worker of two fed by a prefill worker over NIXL, give the tokens of one engine, report both
groups' pages, and free them all."""

import re

import pytest

from experiments.config import from_cfg
from experiments.run import run
from serving.config import check_fits_model
from tests.experiments.runs import TINY, _cfg, _outputs

DEEPSEEK = ["model=tiny-random-deepseek", "deployment=colocated", "deployment.num_workers=1"]


def test_a_dp_worker_gives_the_tokens_of_one_engine(tmp_path):
    (one,) = run(_cfg([*TINY, *DEEPSEEK]), tmp_path / "dp1", progress=False)
    (two,) = run(_cfg([*TINY, *DEEPSEEK, "deployment.dp=2"]), tmp_path / "dp2", progress=False)
    assert one["summary"]["completed"] == two["summary"]["completed"] == 6
    assert _outputs(one) == _outputs(two)
    (timeline,) = two["timelines"]
    assert timeline["num_pages"] == 2 * 256  # both groups' pages (conf/model/tiny-random-deepseek.yaml)
    assert timeline["free_pages"] == timeline["num_pages"]


def test_a_decode_worker_of_dp_groups_gives_the_tokens_of_one_engine(tmp_path):
    """1 prefill worker of TP 2 -> 1 decode worker of 2 DP groups (deployment 1p1d-dp2): every request's
    KV comes over NIXL, from an agent per prefill rank, into the group the router gave it, and the tokens
    equal a colocated engine's."""
    (one,) = run(_cfg([*TINY, *DEEPSEEK]), tmp_path / "one", progress=False)
    disaggregated = [*TINY, "model=tiny-random-deepseek", "deployment=1p1d-dp2", "deployment.prefill_tp=2"]
    (two,) = run(_cfg(disaggregated), tmp_path / "1p1d-dp2", progress=False)
    assert one["summary"]["completed"] == two["summary"]["completed"] == 6
    assert _outputs(one) == _outputs(two)
    multi = [r for r in two["requests"] if r["prompt_tokens"] > 1]
    assert multi and all(r["prefill"] == "remote" and r["transfer_bytes"] > 0 for r in multi)
    decode = next(t for t in two["timelines"] if t["role"] == "decode")
    assert decode["num_pages"] == 2 * 256 and decode["free_pages"] == decode["num_pages"]
    log = (tmp_path / "1p1d-dp2" / "logs" / "1p1d-dp2" / "decode-0.log").read_text()
    agents = re.search(r"prefill worker prefill-0 connected \(agents (.*)\)", log).group(1).split(", ")
    assert len(agents) == 2 and agents[1] == f"{agents[0]}-tp1"  # one per prefill TP rank


def test_prefill_and_decode_workers_of_dp_groups_give_the_tokens_of_one_engine(tmp_path):
    """deployment.prefill_dp=2 with 1p1d-dp2: the prefill worker's two groups each serve the decode worker
    as a messenger peer of their own (its log names both), and the tokens equal a colocated engine's."""
    (one,) = run(_cfg([*TINY, *DEEPSEEK]), tmp_path / "one", progress=False)
    both = [*TINY, "model=tiny-random-deepseek", "deployment=1p1d-dp2", "deployment.prefill_dp=2"]
    (two,) = run(_cfg(both), tmp_path / "dp-both", progress=False)
    assert one["summary"]["completed"] == two["summary"]["completed"] == 6
    assert _outputs(one) == _outputs(two)
    multi = [r for r in two["requests"] if r["prompt_tokens"] > 1]
    assert multi and all(r["prefill"] == "remote" and r["transfer_bytes"] > 0 for r in multi)
    assert {r["prefill_worker"] for r in multi} <= {"prefill-0", "prefill-0-dp1"}  # the least loaded group
    log = (tmp_path / "dp-both" / "logs" / "1p1d-dp2" / "decode-0.log").read_text()
    assert "prefill worker prefill-0 connected" in log and "prefill worker prefill-0-dp1 connected" in log
    assert {t["role"]: t["free_pages"] == t["num_pages"] for t in two["timelines"]} == {
        "prefill": True,
        "decode": True,
    }


def test_the_router_sends_each_turn_to_the_group_that_holds_its_history(tmp_path):
    """Multiturn over one worker of two DP groups: the router picks the group by each group's cache
    (the worker reports each one's events), so every later turn finds its whole history there, not
    only the system prompt both groups hold (the worker's own choice, the group with fewer requests,
    would put a conversation's turns on either)."""
    multiturn = ["workload=multiturn", "workload.conversations=4", "workload.turns=3"]
    multiturn += ["workload.concurrency=4", "workload.system_prompt_len=40", "workload.turn_len=12"]
    multiturn += ["workload.think_time_s=0.05", "workload.output_len.value=8", "plots=false"]
    weight = "deployment.routing_overlap_weight=100"  # the history outweighs any load
    (record,) = run(_cfg([*DEEPSEEK, *multiturn, "deployment.dp=2", weight]), tmp_path, progress=False)
    assert record["summary"]["completed"] == 12
    later = [r for r in record["requests"] if r["turn"] > 0]
    assert later and all(r["cached_tokens"] > 40 for r in later), [r["cached_tokens"] for r in later]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["deployment=colocated", "deployment.dp=0"], "deployment.dp"),
        (["deployment=1p1d", "deployment.decode_dp=-1"], "deployment.decode_dp"),
        (
            ["model=tiny-random-moe", "deployment=colocated", "deployment.dp=3"],
            "tp x dp = 3 ranks divide; got 8",
        ),
        (["deployment=1p1d-dp2", "transfer.nics_per_rank=[lo]"], "transfer.nics_per_rank=\\['lo'\\] is not"),
        (["deployment=1p1d-dp2", "transfer.nics_per_rank=lo"], "transfer.nics_per_rank must be a list"),
        (  # a NIC per rank: TP ranks too
            ["deployment=1p1d", "deployment.prefill_tp=2", "transfer.nics_per_rank=[lo]"],
            r"one device name per rank \(tp x dp: 2\)",
        ),
    ],
)
def test_a_dp_that_cannot_run_is_refused_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_fits_model(from_cfg(_cfg(["model=tiny-random-deepseek", *overrides])))
