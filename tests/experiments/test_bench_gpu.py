import csv

from experiments.bench import gpu


def test_gpu_suite_smoke_run_writes_its_tables(tmp_path):
    """On the CPU the suite runs its tiny shapes under the interpreter and writes the CSV and markdown."""
    assert gpu.main(["--tiny", "--quick", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "kernels.csv")))
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"kv_append", "splitk_gemm", "out_proj", "decode_attention"}
    assert all(float(r["ms"]) > 0 and float(r["gbps"]) > 0 for r in rows)
    table = (tmp_path / "kernels.md").read_text()
    assert "device-to-device copy" in table and table.count("\n| ") == len(rows) + 2  # header and separator


def test_gpu_suite_refuses_full_shapes_without_cuda(tmp_path, capsys):
    assert gpu.main(["--out", str(tmp_path)]) == 2
    assert "--tiny" in capsys.readouterr().err
