import csv
import sys

import pytest

from experiments.bench import gpu


def test_gpu_suite_smoke_run_writes_its_tables(tmp_path):
    """On the CPU the suite runs its tiny shapes under the interpreter and writes the CSV and markdown."""
    assert gpu.main(["--tiny", "--quick", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "kernels.csv")))
    kernels = {r["kernel"] for r in rows}
    assert kernels == {
        "kv_append",
        "kv_append_mla",
        "splitk_gemm",
        "out_proj",
        "decode_attention",
        "extend_attention",
        "mla_decode_attention",
    }
    assert all(float(r["ms"]) > 0 and float(r["gbps"]) > 0 for r in rows)
    table = (tmp_path / "kernels.md").read_text()
    assert "device-to-device copy" in table and table.count("\n| ") == len(rows) + 2  # header and separator
    # no FlashInfer here: extend attention's baseline is torch's SDPA, and the row says how ours compares
    sdpa = [
        line for line in table.splitlines() if "| extend_attention | " in line and "(prefix 0 + 16)" in line
    ]
    assert [line.split(" | ")[2] for line in sdpa] == ["triton", "torch.sdpa"], sdpa
    assert sdpa[0].rstrip(" |").endswith("x") and "L2 cold" in table


def test_gpu_suite_refuses_full_shapes_without_cuda(tmp_path, capsys):
    assert gpu.main(["--out", str(tmp_path)]) == 2
    assert "--tiny" in capsys.readouterr().err


def test_only_builds_the_cases_asked_for_and_copies_match_each_rows_bytes(tmp_path, monkeypatch):
    built, copies = [], []
    for key, (group, kernels) in list(gpu.GROUPS.items()):

        def counted(*args, _group=group, _key=key):
            built.append(_key)
            yield from _group(*args)

        monkeypatch.setitem(gpu.GROUPS, key, (counted, kernels))
    real_copy = gpu.copy_bandwidth
    monkeypatch.setattr(gpu, "copy_bandwidth", lambda b, d, n: copies.append(n) or real_copy(b, d, n))
    assert gpu.main(["--tiny", "--quick", "--only", "out_proj", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "kernels.csv")))
    assert built == ["gemms"] and {r["kernel"] for r in rows} == {"out_proj"}
    moved = {round(float(r["gbps"]) * float(r["ms"]) * 1e6) for r in rows}  # each row's bytes
    assert set(copies) == moved  # one copy of each size a row moves
    assert all(float(r["copy_gbps"]) > 0 for r in rows)


def test_cuda_timing_is_the_median_and_a_missing_flashinfer_stops_the_run(monkeypatch):
    import sys

    import pytest
    import triton.testing

    seen = {}
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: seen.update(kw) or 1.0)
    assert gpu.timer("cuda", quick=True)(lambda: None) == 1.0 and seen["return_mode"] == "median"
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed
    with pytest.raises(ImportError, match="compares against FlashInfer"):
        gpu._flashinfer()
    monkeypatch.setattr(gpu, "WITHOUT_FLASHINFER", True)  # --without-flashinfer: asked for, and said
    assert gpu._flashinfer() is None


def test_without_flashinfer_is_said_in_the_table(tmp_path):
    assert (
        gpu.main(["--tiny", "--quick", "--only", "kv_append", "--without-flashinfer", "--out", str(tmp_path)])
        == 0
    )
    assert "FlashInfer rows left out" in (tmp_path / "kernels.md").read_text()


def test_gpu_check_summarizes_every_shape_and_names_the_worst():
    """The headline rows of make gpu-check: ranges over every shape, the lowest named, eager and graph
    apart, decode and prefill M apart (it used to report one KV-append row, SmolLM2's, and no out_proj)."""
    from experiments.bench.gpu_check import summarize

    def row(kernel, shape, provider, ms, pct=0.0):
        return {"kernel": kernel, "shape": shape, "provider": provider, "ms": str(ms), "pct_copy": str(pct)}

    rows = [
        row("kv_append", "smollm2 T=8x256", "triton", 1, 62),
        row("kv_append", "llama-3-8b T=8x256", "triton", 1, 90),
        row("kv_append", "llama-3-8b T=8x256", "flashinfer", 1, 95),
        row("splitk_gemm", "M=1 N=4096 K=4096", "torch.matmul", 0.10),
        row("out_proj", "M=1 N=4096 K=4096", "ours+counter", 0.125),
        row("out_proj", "M=4096 N=4096 K=4096", "torch.matmul", 1.0),
        row("out_proj", "M=4096 N=4096 K=4096", "ours+counter", 1.25),
        row("out_proj", "M=16 N=4096 K=4096", "torch.matmul [graph]", 0.2),
        row("out_proj", "M=16 N=4096 K=4096", "ours+counter [graph]", 0.1),
        row("mla_decode_attention", "deepseek-mla H=16 B=64 L=4096", "triton", 0.2),
        row("mla_decode_attention", "deepseek-mla H=16 B=64 L=4096", "flashinfer", 0.1),
        row("mla_decode_attention", "deepseek-mla H=128 B=32 L=4096", "triton", 0.3),
        row("mla_decode_attention", "deepseek-mla H=128 B=32 L=4096", "flashinfer", 0.6),
    ]
    got = {what: figures for what, _, figures in summarize(rows)}
    assert got == {
        "KV append, % of copy, eager": "62-90% (lowest: smollm2 T=8x256)",
        "out_proj + counter vs cuBLAS, decode M, eager": "0.80-0.80x (lowest: M=1 N=4096 K=4096)",
        "out_proj + counter vs cuBLAS, prefill M, eager": "0.80-0.80x (lowest: M=4096 N=4096 K=4096)",
        "out_proj + counter vs cuBLAS, decode M, graph": "2.00-2.00x (lowest: M=16 N=4096 K=4096)",
        "MLA decode vs FlashInfer (their ms / ours)": "0.50-2.00x (lowest: deepseek-mla H=16 B=64 L=4096)",
    }


def test_the_deepseek_decode_step_script_times_each_backend(tmp_path):
    """gpu-check's DeepSeek step, tried on the CPU (tiny model, torch paths): one median per backend."""
    import json

    from experiments.bench import mla_step

    out = tmp_path / "step.json"
    # a prompt a step (512 tokens) and more prompts than the timed steps' tokens: the first decode while the
    # last still prefill, and must not reach max_tokens before the timing (failed on the H200 at 32 x 1,024)
    assert mla_step.main(["--batch", "8", "--kv", "512", "--steps", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == "tiny-random-deepseek" and set(result["ms"]) == {"torch"}
    assert result["ms"]["torch"] > 0
    with pytest.raises(SystemExit):
        mla_step.main(["--batch", "0"])


def test_the_flashinfer_warm_up_calls_each_of_its_kernels_once_for_every_geometry_of_the_full_run(
    monkeypatch, capsys
):
    """A stand-in FlashInfer records what the warm-up plans and runs: every head geometry, GQA kind and the
    MLA latent the full benchmark uses, at small lengths, nothing timed; without FlashInfer it says so."""
    from unittest import mock

    assert gpu.main(["--warm-flashinfer"]) == 0  # none here
    assert "no FlashInfer here: nothing to warm up" in capsys.readouterr().out
    fake = mock.MagicMock()
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(gpu, "_flashinfer", lambda: fake)
    warmed = gpu.warm_flashinfer("cpu")
    kernels = {k for k, _, _ in warmed}
    assert kernels >= {"kv_append", "decode_attention", "extend_attention", "mla_decode_attention"}
    decode_plans = fake.BatchDecodeWithPagedKVCacheWrapper.return_value.plan.call_args_list
    assert {c.args[3:6] for c in decode_plans} == {(q, kv, d) for _, kv, q, d in gpu.MODELS}
    tensor_cores = {
        c.kwargs["use_tensor_cores"] for c in fake.BatchDecodeWithPagedKVCacheWrapper.call_args_list
    }
    assert tensor_cores == {True, False}  # both of its decode kernels' kinds
    mla = fake.mla.BatchMLAPagedAttentionWrapper.return_value.plan.call_args_list
    assert {c.args[4:7] for c in mla} == {(h, 512, 64) for h, _, _ in gpu.MLA_DECODE}
    small = ("T=2x8", "B=2 L=64", " + 16)")  # every case small: the lengths do not matter to it
    assert all(any(x in shape for x in small) for _, shape, _ in warmed), warmed
    assert gpu.WARM is False


def test_gpu_check_skips_the_warm_up_without_flashinfer_and_names_every_version(tmp_path):
    from experiments.bench import gpu_check

    step = gpu_check.warmup_step(tmp_path, open(tmp_path / "log", "w"), 10)
    assert step.status == "skip" and "not installed" in step.figures
    env = gpu_check.environment()
    for part in ("driver ", "nvcc ", "torch ", "Triton ", "no FlashInfer"):
        assert part in env, env
