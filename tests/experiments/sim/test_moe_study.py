import re

import pytest

from experiments.repro import moe_study
from experiments.sim.cost import CostModel
from experiments.sim.hardware import hardware
from experiments.sim.models import sim_model
from experiments.sim.simulate import Instance


def test_dp_attention_holds_more_kv_and_tp_decodes_one_sequence_faster():
    r1, h200 = sim_model("deepseek-r1"), hardware("h200")
    tp8, dp8 = CostModel(r1, h200, 8), CostModel(r1, h200, 1, dp=8)
    # MLA's one latent head is replicated on every TP rank; DP ranks each hold their own sequences
    assert Instance(dp8).kv_capacity_tokens > 5 * Instance(tp8).kv_capacity_tokens
    # one sequence: TP8 splits every weight 8 ways, DP8 reads the whole attention side on one GPU
    assert tp8.decode_time([2000]) < dp8.decode_time([2000])
    # 1024 sequences: TP8 reads all of their KV on every GPU, DP8 an eighth of it
    assert dp8.decode_time([2000] * 1024) < tp8.decode_time([2000] * 1024)


def test_moe_study_prints_both_tiers_for_every_placement(capsys):
    args = ["--requests", "80", "--prompt", "256", "--output", "16", "--decode-nodes", "1"]
    assert moe_study.main(args) == 0
    out = capsys.readouterr().out
    for tier in moe_study.TIERS:
        assert tier in out
    for name in ("1 mixed TP8", "1P TP8 + 1D TP8", "1 mixed DP8", "1P TP8 + 1D DP8"):
        for row in (name, name + " + MTP1"):  # a row's name, then its node count
            assert len(re.findall(rf"^{re.escape(row)} +\d", out, re.M)) == 2, row


def test_mtp_speeds_up_each_user_on_the_decode_nodes():
    """DeepSeek-style MTP on the decode node: 1 + 0.85 tokens a verify step lifts per-user tokens/s."""
    r1, h200 = sim_model("deepseek-r1"), hardware("h200")
    eff = moe_study.Efficiency(step_overhead_s=0.01)
    args = (r1, h200, eff, 60, 256, 32, 2.0, 0.050)
    plain, mtp = (moe_study.measure(moe_study.Setup("x", 0, 1, False, k), *args, 0.85) for k in (0, 1))
    assert plain["rate"] > 0 and mtp["rate"] > 0
    assert mtp["user_tok_s"] > 1.4 * plain["user_tok_s"]


def test_moe_study_refuses_bad_input():
    with pytest.raises(SystemExit):
        moe_study.main(["--decode-nodes", "0"])
    with pytest.raises(SystemExit):
        moe_study.main(["--mtp-acceptance", "1.5"])
    with pytest.raises(SystemExit):  # 671 GB of FP8 weights do not fit 8 x 80 GB
        moe_study.main(["--hardware", "a100-80gb"])
