"""The GPU suite's rows: how each kernel is timed (do_bench on CUDA, eager or one CUDA-graph replay; a
perf_counter loop on the CPU), against a copy of the same bytes, and the tables they are written to."""

from __future__ import annotations

import csv
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# what each row is compared with, same kernel and shape (torch.sdpa: extend attention without FlashInfer)
BASELINES = ("torch.matmul", "flashinfer", "torch.sdpa")


@dataclass
class Row:
    kernel: str
    shape: str
    provider: str
    ms: float
    gbps: float
    copy_gbps: float  # a device-to-device copy moving the same bytes (read + written), this run
    pct_copy: float
    tflops: float


def timer(device: str, quick: bool) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of fn()."""
    if device == "cuda":
        import triton.testing

        warmup, rep = (5, 20) if quick else (25, 100)
        return lambda fn: triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

    def cpu_timer(fn):
        fn()
        samples = []
        for _ in range(2 if quick else 5):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    return cpu_timer


class Graphed:
    """A case timed as a CUDA graph replay: no launch overhead, as decode steps run. The provider's name
    says [graph]."""

    def __init__(self, fn):
        self.fn = fn


L2_FLUSH_MIN = 256 << 20  # bytes written before each timed replay: at least twice any L2 (H200: 60 MB)


def graph_timer(quick: bool) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of one CUDA-graph replay of fn with a cold L2, as the eager rows are timed
    (do_bench zeroes a buffer between runs): each replay follows the zeroing of a buffer of at least twice
    the L2, and only the replay lies between its events. Replayed back to back instead, a weight under the
    L2's size (N = K = 4096 in bf16: 32 MB) would be read from the cache a real layer never finds it in."""
    reps = 20 if quick else 100

    def bench(fn) -> float:
        l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
        flush = torch.empty(max(L2_FLUSH_MIN, 2 * l2), dtype=torch.uint8, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (Triton's compile, FlashInfer's plan) off the capture
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
        ]
        for start, end in [events[0]] * 3 + events:  # three untimed replays first
            flush.zero_()
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)

    return bench


def copy_bandwidth(bench, device: str, nbytes: int) -> float:
    """GB/s of a device-to-device copy that reads and writes nbytes in all (half each way): the yardstick
    for a memory-bound kernel that moves as many bytes (a small copy cannot reach a large one's speed)."""
    src = torch.empty(max(1, nbytes // 2), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / bench(lambda: dst.copy_(src)) / 1e6


def write_results(rows: list[Row], out: Path, device_name: str, note: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "kernels.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    lines = [
        f"Device: {device_name}; time: median, L2 cold (eager rows: do_bench zeroes a buffer between "
        "runs; [graph] rows: one CUDA-graph replay after zeroing twice the L2); % of copy: against a "
        "device-to-device copy moving the same bytes, timed the same way (eager or graph), in this run; vs "
        "baseline: the baseline's time over this row's, eager against eager, graph against graph (> 1 faster)"
        + (f"; {note}" if note else ""),
        "",
        "| kernel | shape | provider | time (us) | GB/s | copy GB/s | % of copy | TFLOP/s | vs baseline |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    base = {(r.kernel, r.shape): r.ms for r in rows if r.provider in BASELINES}
    graphed = {(r.kernel, r.shape): r.ms for r in rows if r.provider == "torch.matmul [graph]"}
    base.update({("out_proj", r.shape): r.ms for r in rows if r.provider == "torch.matmul"})
    for r in rows:
        tflops = f"{r.tflops:.1f}" if r.tflops else "-"
        b = (graphed if r.provider.endswith("[graph]") else base).get((r.kernel, r.shape))
        vs = f"{b / r.ms:.2f}x" if b and not r.provider.startswith(BASELINES) else "-"
        lines.append(
            f"| {r.kernel} | {r.shape} | {r.provider} | {r.ms * 1e3:.1f} | {r.gbps:.0f} | "
            f"{r.copy_gbps:.0f} | {r.pct_copy:.0f}% | {tflops} | {vs} |"
        )
    (out / "kernels.md").write_text("\n".join(lines) + "\n")
