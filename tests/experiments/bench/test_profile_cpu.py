"""make profile-cpu's script (experiments/bench/profile_cpu.py), tried small: every phase's time split by
kind, none counted twice, our extension's calls seen by the profiler, and a peer's (vLLM's) phases sorted
into the same kinds."""

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
        ("pdk::bf16_linear", "gemm"),
        ("aten::bmm", "attention"), ("pdk::causal_attention_amx", "attention"),
        ("pdk::decode_attention", "attention"), ("aten::argmax", "sampling"),
        ("aten::copy_", "copies"), ("pdk::kv_append", "copies"), ("aten::silu", "elementwise"),
        ("pdk::add_rms_norm", "elementwise"), ("aten::mul", "elementwise"),
        ("aten::empty", "other"), ("_C::onednn_mm", "gemm"), ("_C::weight_packed_linear", "gemm"),
        ("_C::cpu_attention_with_kv_cache", "attention"), ("_C::cpu_attn_reshape_and_cache", "copies"),
        ("## Call CompiledFxGraph None ##", "elementwise"), ("_C::greedy_argmax", "sampling"),
    ],
)  # fmt: skip
def test_ops_fall_in_their_kinds(op, kind):
    assert profile_cpu.kind_of(op) == kind


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        profile_cpu.main(["--batches", "0"])
    with pytest.raises(SystemExit):
        profile_cpu.main(["--kv-dtype", "fp8_e5m2"])
    assert "invalid choice: 'fp8_e5m2'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        profile_cpu.main(["--kv-dtype", "fp8_e4m3", "--peer-python", "/nowhere/python"])
    assert "profiles our engine only" in capsys.readouterr().err


def test_an_e4m3_cache_is_profiled_and_said_so(tmp_path, capsys):
    assert profile_cpu.main(["--model", "tiny-random", "--prompt", "40", "--batches", "2", "--steps", "2",
                             "--kv-dtype", "fp8_e4m3", "--out", str(tmp_path)]) == 0  # fmt: skip
    result = json.loads((tmp_path / "profile.json").read_text())
    assert result["kv_dtype"] == "fp8_e4m3" and set(result["phases"]) == {"prefill 40", "decode batch 2"}
    assert ", KV fp8_e4m3," in capsys.readouterr().out


FAKE_PEER = """#!{python}
# stands in for vLLM's python running profile_vllm.py: the phases asked for, with vLLM's op names
import argparse, json
ap = argparse.ArgumentParser()
ap.add_argument("script")
for name in ("--model", "--prompt", "--batches", "--threads", "--dtype", "--out"):
    ap.add_argument(name)
ap.add_argument("--steps", type=int)
a = ap.parse_args()
if a.model != "{model}":
    raise SystemExit("wrong model")
if a.dtype not in ("bfloat16", "float32"):  # ours, passed on
    raise SystemExit("no dtype")
ops = [["_C::onednn_mm", 3000.0, 2], ["_C::weight_packed_linear", 1000.0, 2],
       ["_C::cpu_attention_with_kv_cache", 2000.0, 2], ["## Call CompiledFxGraph None ##", 500.0, 1],
       ["_C::cpu_attn_reshape_and_cache", 250.0, 2], ["_C::greedy_argmax", 100.0, 1],
       ["aten::slice", 50.0, 9]]
names = ["prefill " + a.prompt] + ["decode batch " + b for b in a.batches.split(",")]
phases = {{n: {{"wall_s": 0.01, "unprofiled_s": 0.009, "repeats": 1 if n.startswith("prefill") else a.steps,
               "ops": ops}} for n in names}}
json.dump({{"engine": "vLLM (fake)", "threads": 1, "phases": phases}}, open(a.out, "w"))
"""


def _fake_peer(tmp_path, model="/weights"):
    import sys

    path = tmp_path / "python"
    path.write_text(FAKE_PEER.format(python=sys.executable, model=model))
    path.chmod(0o755)
    return str(path)


def test_the_peers_ops_fall_in_our_kinds_beside_ours(tmp_path, capsys):
    peer = _fake_peer(tmp_path)
    args = ["--model", "tiny-random", "--prompt", "24", "--batches", "2", "--steps", "2"]
    args += ["--peer-python", peer, "--peer-model", "/weights", "--out", str(tmp_path)]
    assert profile_cpu.main(args) == 0
    result = json.loads((tmp_path / "profile.json").read_text())
    assert result["peer"]["engine"] == "vLLM (fake)"
    prefill, decode = result["peer"]["phases"]["prefill 24"], result["peer"]["phases"]["decode batch 2"]
    assert prefill["ms"]["gemm"] == pytest.approx(4.0) and decode["ms"]["gemm"] == pytest.approx(
        2.0
    )  # per step
    assert prefill["ms"]["attention"] == pytest.approx(2.0) and prefill["ms"]["elementwise"] == pytest.approx(
        0.5
    )
    assert prefill["ms"]["copies"] == pytest.approx(0.25) and prefill["ms"]["sampling"] == pytest.approx(0.1)
    assert prefill["ms"]["other"] == pytest.approx(0.05) and prefill["unprofiled_ms"] == pytest.approx(9.0)
    assert prefill["non_gemm_ms"] == pytest.approx(10.0 - 4.0)
    assert all(p["unprofiled_ms"] > 0 for p in result["phases"].values())
    out = capsys.readouterr().out
    assert "| ours | prefill 24 |" in out and "| vLLM (fake) | prefill 24 |" in out


def test_a_peer_that_fails_is_an_error_that_says_so(tmp_path):
    peer = _fake_peer(tmp_path, model="/elsewhere")  # exits 1: "wrong model"
    with pytest.raises(SystemExit, match="wrong model"):
        profile_cpu.main(["--model", "tiny-random", "--prompt", "8", "--batches", "1", "--steps", "1",
                          "--peer-python", peer, "--peer-model", "/weights"])  # fmt: skip
    with pytest.raises(SystemExit, match="--peer-model"):  # only SmolLM2's weights are written for it
        profile_cpu.main(["--model", "tiny-random", "--prompt", "8", "--batches", "1", "--steps", "1",
                          "--peer-python", peer])  # fmt: skip


def test_the_bound_counts_each_weight_once_as_the_engine_stores_it_and_the_kv_each_step_reads():
    """A decode step's bound: every weight as `linear` streams it at that batch (tiny-random's fp32 ones
    whole), the LM head once (the embedding's rows are a gather: not counted), and each cached token's
    KV; a prefill's: 2 FLOPs a parameter a row, the LM head on the last row, causal attention's products."""
    from engine import LLM
    from experiments.sim.hardware import Hardware

    llm = LLM("tiny-random", dtype="float32", page_size=4, num_pages=32)
    hw = Hardware("m", flops=1e9, hbm_bw=1e9, hbm_bytes=1e9, nvlink_bw=1e9, nic_bw=1e9, read_bw=2e9)
    line = profile_cpu.roofline(llm, hw)
    m, a = llm.model, llm.config.arch
    every = [w for layer in m.layers for w in layer.values()] + [m.norm, m.lm_head]
    assert line["weights"](1) == line["weights"](64) == sum(w.numel() * 4 for w in every)
    kv_token = a.num_layers * 2 * a.num_kv_heads * a.head_dim * 4
    assert line["kv_token_bytes"] == kv_token
    params = sum(w.numel() for layer in m.layers for w in layer.values() if w.dim() == 2)
    head = m.lm_head.numel()
    bound = profile_cpu.decode_bound(line, 2, 10)
    assert bound["bytes"] == line["weights"](2) + 10 * kv_token
    assert bound["flops"] == 2 * 2 * (params + head) + 4 * a.num_layers * a.num_heads * a.head_dim * 10
    # the larger of the two: 1 GFLOP/s against 2 GB/s here
    slower = max(bound["bytes"] / 2e9, bound["flops"] / 1e9)
    assert bound["bound_ms"] == pytest.approx(1e3 * slower)
    assert bound["bound_by"] == ("memory" if bound["bytes"] / 2e9 >= bound["flops"] / 1e9 else "compute")
    attention = 4 * a.num_layers * a.num_heads * a.head_dim * 8 * 9 / 2
    prefill = profile_cpu.prefill_bound(line, 8)
    assert prefill["flops"] == 2 * 8 * params + 2 * head + attention and prefill["bound_by"] == "compute"


def test_an_int8_block_weight_streams_its_int8_copy_up_to_its_rows_and_the_fp32_one_past_them():
    from pdkernels import cpu
    from tests.pdkernels.test_cpu import _ext, _int8_blocks

    _ext()
    p = cpu.pack(_int8_blocks(96, 320, "q8_0"))
    assert isinstance(p, cpu.Q8Weight)
    # a byte a weight, and a scale and an offset (fp32) a block of 32: 1.25 bytes a weight
    assert profile_cpu.streamed_bytes(p, 1) == profile_cpu.streamed_bytes(p, cpu.Q8_MAX_M) == 96 * 320 * 1.25
    assert profile_cpu.streamed_bytes(p, cpu.Q8_MAX_M + 1) == 96 * 320 * 4
