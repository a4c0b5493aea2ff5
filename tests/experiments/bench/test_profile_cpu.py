"""make profile-cpu's script (experiments/bench/profile_cpu.py), tried small: every phase's time split by
kind, none counted twice, and our extension's calls seen by the profiler."""

import json

import pytest

from experiments.bench import profile_cpu


def test_each_phase_splits_its_wall_time_by_kind(tmp_path, capsys):
    assert profile_cpu.main(["--model", "tiny-random", "--prompt", "40", "--batches", "1,3", "--steps", "2",
                             "--out", str(tmp_path)]) == 0  # fmt: skip
    result = json.loads((tmp_path / "profile.json").read_text())
    assert set(result["phases"]) == {"prefill 40", "decode batch 1", "decode batch 3"}
    assert result["machine"]["cpu"] and isinstance(result["machine"]["isa"], list)
    for phase in result["phases"].values():
        kinds = phase["ms"]
        assert set(kinds) == set(profile_cpu.ORDER) and all(v >= 0 for v in kinds.values())
        # the ops' self times and what no op accounts for make up the wall time, nothing counted twice
        assert sum(kinds.values()) == pytest.approx(phase["wall_ms"], rel=0.02) or kinds["outside ops"] == 0
        assert kinds["gemm"] > 0 and phase["non_gemm_ms"] == pytest.approx(phase["wall_ms"] - kinds["gemm"])
    assert "| prefill 40 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "op, kind",
    [
        ("aten::addmm", "gemm"), ("mkldnn::_linear_pointwise", "gemm"), ("pdk::q8_linear", "gemm"),
        ("aten::bmm", "attention"), ("pdk::decode_attention", "attention"), ("aten::argmax", "sampling"),
        ("aten::copy_", "copies"), ("pdk::kv_append", "copies"), ("aten::silu", "elementwise"),
        ("pdk::add_rms_norm", "elementwise"), ("aten::mul", "elementwise"),
        ("aten::empty", "other"),
    ],
)  # fmt: skip
def test_ops_fall_in_their_kinds(op, kind):
    assert profile_cpu.kind_of(op) == kind


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        profile_cpu.main(["--batches", "0"])
