import csv

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
        row("out_proj", "M=1 N=4096 K=4096", "triton+counter", 0.125),
        row("out_proj", "M=4096 N=4096 K=4096", "torch.matmul", 1.0),
        row("out_proj", "M=4096 N=4096 K=4096", "triton+counter", 1.25),
        row("out_proj", "M=16 N=4096 K=4096", "torch.matmul [graph]", 0.2),
        row("out_proj", "M=16 N=4096 K=4096", "triton+counter [graph]", 0.1),
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
    assert mla_step.main(["--batch", "3", "--kv", "9", "--steps", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == "tiny-random-deepseek" and set(result["ms"]) == {"torch"}
    assert result["ms"]["torch"] > 0
    with pytest.raises(SystemExit):
        mla_step.main(["--batch", "0"])
