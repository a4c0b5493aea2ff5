"""python -m engine.info: one row per model, the KV a token costs, replicated or sharded under TP, held
once under DP attention."""

import pytest

from engine import info


def test_info_reports_the_kv_of_gqa_and_of_the_latent_cache(capsys):
    info.main(["tiny-random", "tiny-random-deepseek", "--tp", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| model |") and len(lines) == 4
    assert lines[0].endswith("| per rank at TP 2 | all ranks at TP 2 | per DP rank (all ranks) at DP 2 |")
    # GQA: 4 layers x K and V x 2 kv heads x 16 x 2 bytes, cut over 2 ranks
    assert "| tiny-random | 4 | GQA (8 q / 2 kv heads x 16) | dense | 128 | 512 | 256 | 512 | 512 |" in lines
    # MLA: 4 layers x one latent row of 32 + 16 x 2 bytes, the same on every TP rank (twice the KV), once
    # under DP
    row = "| tiny-random-deepseek | 4 | MLA (latent 32 + rope 16) | 8 x 64, top 2, 1 shared | 96 | 384 |"
    assert row + " 384 | 768 | 384 |" in lines


def test_info_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="model must be one of"):
        info.main(["gpt-17"])
    with pytest.raises(SystemExit):
        info.main(["tiny-random", "--tp", "0"])
