"""The GPU kernel suite: time every kernel at serving shapes against cuBLAS and FlashInfer.

    python -m experiments.bench.gpu --out bench_results/h200          # on a CUDA machine
    python -m experiments.bench.gpu --tiny --out /tmp/smoke           # CPU smoke run (interpreter)

Writes ``kernels.csv`` and ``kernels.md``: time, GB/s, % of a device-to-device copy of the same bytes
measured in the same run, and TFLOP/s. Times come from ``triton.testing.do_bench`` (median, ms) on CUDA,
and from a perf_counter loop on the CPU, where the numbers only show that the suite runs. On CUDA the
FlashInfer baselines are required: a missing FlashInfer stops the run instead of dropping its rows.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before any kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


# (name, kv heads, q heads, head dim): the head configurations the kernels serve
MODELS = [("smollm2-135m", 3, 9, 64), ("llama-3-8b", 8, 32, 128), ("qwen3-coder-480b", 8, 96, 128)]
GEMM_MS = [1, 4, 16, 64]
GEMM_NK = [(4096, 4096), (8192, 4096), (4096, 8192), (8192, 8192)]
# the engine's own decode GEMMs (N, K): Llama-3-8B's and Llama-3.2-1B's fused qkv, gate+up and down
ENGINE_GEMMS = [
    ("llama-3-8b qkv", 6144, 4096),
    ("llama-3-8b gate_up", 28672, 4096),
    ("llama-3-8b down", 4096, 14336),
    ("llama-3.2-1b qkv", 3072, 2048),
    ("llama-3.2-1b gate_up", 16384, 2048),
    ("llama-3.2-1b down", 2048, 8192),
]
ENGINE_MS = [1, 4, 16]
DECODE_BATCHES = [(8, 32768), (32, 8192), (64, 4096), (256, 1024)]  # (sequences, tokens each)
SKEWED = [32768] * 4 + [512] * 60  # a batch of 64: four long sequences among short ones
PREFILL_M = 4096  # out_proj at prefill M (one 4096-token chunk)
EXTEND_CASES = [(4, 0, 2048), (8, 4096, 512)]  # (requests, cached prefix, new tokens each)
APPEND_TOKENS = [(256, 1), (8, 1024), (1, 8192)]  # (requests, tokens appended each)
# DeepSeek-V3's latent (512 + rope 64): (query heads on a rank, sequences, tokens each); 16 heads is TP 8,
# 128 is one rank holding every head (DP attention)
MLA_DECODE = [(16, 64, 4096), (16, 8, 32768), (128, 32, 4096), (128, 128, 1024)]
PAGE_SIZE = 16


def bench_kv_append(device, dtype, tiny) -> Iterator[tuple]:
    from pdkernels.kv_append import kv_append
    from pdkernels.testing import append_positions, make_paged_cache

    shapes = [(2, 8)] if tiny else APPEND_TOKENS
    models = MODELS[:1] if tiny and not WARM else MODELS
    for (name, kv_heads, _, head_dim), (reqs, tokens) in ((m, s) for m in models for s in shapes):
        case = make_paged_cache([tokens] * reqs, kv_heads, head_dim, PAGE_SIZE, dtype=dtype, device=device)
        batch_indices, positions = append_positions(case, [tokens] * reqs)
        k = torch.randn(reqs * tokens, kv_heads, head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        tables = (case.kv_indices, case.kv_indptr, case.kv_last_page_len)
        nbytes = 2 * 2 * k.numel() * k.element_size()  # K and V, read once and written once
        shape = f"{name} T={reqs}x{tokens}"
        args = (k, v, batch_indices, positions, case.cache, *tables)
        yield "kv_append", shape, "triton", nbytes, 0, partial(kv_append, *args, validate=False)
        fi = _flashinfer()
        if fi is not None:
            fi_append = partial(fi.page.append_paged_kv_cache, *args, kv_layout="HND")
            yield "kv_append", shape, "flashinfer", nbytes, 0, fi_append


def bench_gemms(device, dtype, tiny) -> Iterator[tuple]:
    from pdkernels.out_proj import make_layer_counter, out_proj
    from pdkernels.splitk_gemm import splitk_gemm

    shapes = [
        (m, n, k) for m in ([1, 16] if tiny else GEMM_MS) for n, k in ([(256, 512)] if tiny else GEMM_NK)
    ]
    for m, n, k in shapes:
        x, w, y, nbytes, flops, shape = _gemm_case(m, n, k, device, dtype)
        counter = make_layer_counter(1, device)
        yield "splitk_gemm", shape, "triton", nbytes, flops, partial(splitk_gemm, x, w, out=y)
        yield "splitk_gemm", shape, "torch.matmul", nbytes, flops, partial(torch.matmul, x, w.t(), out=y)
        counted = partial(out_proj, x, w, out=y, counter=counter)
        yield "out_proj", shape, "ours+counter", nbytes, flops, counted
        yield "out_proj", shape, "ours", nbytes, flops, partial(out_proj, x, w, out=y)
    if device == "cuda" and not tiny:
        yield from gemm_sweep(device, dtype)
    for (name, n, k), m in [] if tiny else [(g, m) for g in ENGINE_GEMMS for m in ENGINE_MS]:
        x, w, y, nbytes, flops, shape = _gemm_case(m, n, k, device, dtype)
        shape = f"{shape} ({name})"
        yield "splitk_gemm", shape, "triton", nbytes, flops, partial(splitk_gemm, x, w, out=y)
        yield "splitk_gemm", shape, "torch.matmul", nbytes, flops, partial(torch.matmul, x, w.t(), out=y)
        graphed = Graphed(partial(splitk_gemm, x, w, out=y))
        yield "splitk_gemm", shape, "triton [graph]", nbytes, flops, graphed
        matmul = Graphed(partial(torch.matmul, x, w.t(), out=y))
        yield "splitk_gemm", shape, "torch.matmul [graph]", nbytes, flops, matmul
    for n, k in [] if tiny else [(4096, 4096), (8192, 8192)]:  # prefill M: one pass, no split
        x, w, y, nbytes, flops, shape = _gemm_case(PREFILL_M, n, k, device, dtype)
        counter = make_layer_counter(1, device)
        yield "out_proj", shape, "torch.matmul", nbytes, flops, partial(torch.matmul, x, w.t(), out=y)
        # the default at prefill M: cuBLAS, then a one-program bump; beside it our own Triton tiles
        counted = partial(out_proj, x, w, out=y, counter=counter)
        yield "out_proj", shape, "ours+counter", nbytes, flops, counted
        tiles = partial(out_proj, x, w, out=y, counter=counter, gemm="triton")
        yield "out_proj", shape, "triton tiles+counter", nbytes, flops, tiles


def _gemm_case(m: int, n: int, k: int, device, dtype) -> tuple:
    """x [M, K], w [N, K], out [M, N], the bytes and FLOPs of x @ w^T, and the shape's label."""
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)
    y = torch.empty(m, n, device=device, dtype=dtype)
    return x, w, y, (n * k + m * k + m * n) * x.element_size(), 2 * m * n * k, f"M={m} N={n} K={k}"


def gemm_sweep(device, dtype) -> Iterator[tuple]:
    """Tile and split choices beside the defaults (provider names them), and graph-timed rows at decode
    M, to pick the defaults from measurements on the GPU at hand."""
    from pdkernels.out_proj import make_layer_counter, out_proj
    from pdkernels.splitk_gemm import splitk_gemm

    for m, n, k in [(1, 4096, 4096), (16, 4096, 4096), (1, 8192, 8192), (16, 8192, 8192)]:
        x, w, y, nbytes, flops, shape = _gemm_case(m, n, k, device, dtype)
        for bn, bk, split in [
            (32, 128, None),
            (64, 256, None),
            (128, 128, None),
            (64, 128, 8),
            (64, 128, 16),
        ]:
            fn = partial(splitk_gemm, x, w, out=y, block_n=bn, block_k=bk, split_k=split, validate=False)
            yield "splitk_gemm", shape, f"triton n{bn} k{bk} s{split or 'auto'}", nbytes, flops, fn
        yield (
            "splitk_gemm",
            shape,
            "triton [graph]",
            nbytes,
            flops,
            Graphed(partial(splitk_gemm, x, w, out=y)),
        )
        matmul = Graphed(partial(torch.matmul, x, w.t(), out=y))
        yield "splitk_gemm", shape, "torch.matmul [graph]", nbytes, flops, matmul
        yield "out_proj", shape, "torch.matmul [graph]", nbytes, flops, matmul
        counter = make_layer_counter(1, device)
        projection = Graphed(partial(out_proj, x, w, out=y, counter=counter, validate=False))
        yield "out_proj", shape, "ours+counter [graph]", nbytes, flops, projection
        yield "out_proj", shape, "ours [graph]", nbytes, flops, Graphed(partial(out_proj, x, w, out=y))
    x, w, y, nbytes, flops, shape = _gemm_case(PREFILL_M, 4096, 4096, device, dtype)
    for bm, bn, bk, warps, stages in [
        (128, 128, 64, 8, 3),
        (128, 256, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (64, 128, 64, 4, 3),
    ]:
        fn = partial(
            out_proj,
            x,
            w,
            out=y,
            block_m=bm,
            block_n=bn,
            block_k=bk,
            num_warps=warps,
            num_stages=stages,
            gemm="triton",
        )
        yield (
            "out_proj",
            shape,
            f"triton {bm}x{bn}x{bk} w{warps} s{stages}",
            nbytes,
            flops,
            fn,
        )


def bench_decode(device, dtype, tiny) -> Iterator[tuple]:
    from pdkernels.decode_attention import decode_attention
    from pdkernels.splitk_gemm import sm_count
    from pdkernels.testing import make_paged_cache

    batches = [[64, 64]] if tiny else [[t] * b for b, t in DECODE_BATCHES] + [SKEWED]
    models = MODELS[:1] if tiny and not WARM else MODELS
    for (name, kv_heads, q_heads, head_dim), lens in ((m, b) for m in models for b in batches):
        batch, tokens = len(lens), sum(lens)
        case = make_paged_cache(lens, kv_heads, head_dim, PAGE_SIZE, dtype=dtype, device=device)
        q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype)
        out = torch.empty_like(q)
        tables = (case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
        nbytes = 2 * tokens * kv_heads * head_dim * q.element_size() + 2 * q.numel() * q.element_size()
        flops = 4 * q_heads * tokens * head_dim
        skewed = len(set(lens)) > 1
        shape = f"{name} B={batch} " + (f"skewed {max(lens)}/{min(lens)}" if skewed else f"L={lens[0]}")
        ours = partial(decode_attention, q, *tables, out=out, max_seq_len=max(lens), validate=False)
        yield "decode_attention", shape, "triton", nbytes, flops, ours
        if device == "cuda":  # the same kernel, splits cut evenly per sequence (the plan before per-token)
            even = max(1, min(32, -(-2 * sm_count(q.device) // (batch * kv_heads))))
            fixed = partial(decode_attention, q, *tables, out=out, num_splits=even, validate=False)
            yield "decode_attention", shape, f"triton even {even} splits", nbytes, flops, fixed
            graphed = Graphed(
                partial(decode_attention, q, *tables, out=out, max_seq_len=max(lens), validate=False)
            )
            yield "decode_attention", shape, "triton [graph]", nbytes, flops, graphed
        fi = _flashinfer()
        if fi is not None:
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                torch.zeros(128 << 20, dtype=torch.uint8, device=device),
                "HND",
                use_tensor_cores=q_heads // kv_heads >= 4,
            )
            wrapper.plan(
                case.kv_indptr,
                case.kv_indices,
                case.kv_last_page_len,
                q_heads,
                kv_heads,
                head_dim,
                PAGE_SIZE,
                q_data_type=dtype,
                kv_data_type=dtype,
            )
            theirs = partial(wrapper.run, q, case.cache, out=out)
            yield "decode_attention", shape, "flashinfer", nbytes, flops, theirs


def bench_extend(device, dtype, tiny) -> Iterator[tuple]:
    from pdkernels.extend_attention import extend_attention
    from pdkernels.testing import make_paged_cache

    cases = [(2, 0, 16), (2, 16, 16)] if tiny else EXTEND_CASES
    for (name, kv_heads, q_heads, head_dim), (reqs, prefix, new) in (
        (m, c) for m in (MODELS[:1] if tiny and not WARM else MODELS[1:2]) for c in cases
    ):
        case = make_paged_cache(
            [prefix + new] * reqs, kv_heads, head_dim, PAGE_SIZE, dtype=dtype, device=device
        )
        qo_indptr = torch.arange(0, reqs + 1, device=device, dtype=torch.int32) * new
        q = torch.randn(reqs * new, q_heads, head_dim, device=device, dtype=dtype)
        out = torch.empty_like(q)
        tables = (case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
        nbytes = (
            (2 * reqs * (prefix + new) * kv_heads + 2 * q.shape[0] * q_heads) * head_dim * q.element_size()
        )
        flops = 4 * reqs * q_heads * head_dim * new * (prefix + (new + 1) / 2)  # causal
        shape = f"{name} {reqs}x(prefix {prefix} + {new})"
        ours = partial(extend_attention, q, qo_indptr, *tables, out=out, max_q_len=new, validate=False)
        yield "extend_attention", shape, "triton", nbytes, flops, ours
        fi = _flashinfer()
        if fi is None and prefix == 0:  # no FlashInfer: torch's SDPA (its flash kernel on CUDA), causal
            yield "extend_attention", shape, "torch.sdpa", nbytes, flops, _sdpa_case(q, reqs, kv_heads, new)
        if fi is not None:
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
                torch.zeros(256 << 20, dtype=torch.uint8, device=device), "HND"
            )
            wrapper.plan(
                qo_indptr,
                case.kv_indptr,
                case.kv_indices,
                case.kv_last_page_len,
                q_heads,
                kv_heads,
                head_dim,
                PAGE_SIZE,
                causal=True,
                q_data_type=dtype,
                kv_data_type=dtype,
            )
            yield (
                "extend_attention",
                shape,
                "flashinfer",
                nbytes,
                flops,
                partial(wrapper.run, q, case.cache, out=out),
            )


def _sdpa_case(q: torch.Tensor, reqs: int, kv_heads: int, new: int) -> Callable[[], object]:
    """torch's scaled_dot_product_attention over contiguous [reqs, heads, new, dim] tensors (the same
    shapes without a page table), causal, GQA; its flash backend on CUDA."""
    import torch.nn.functional as F

    heads, dim = q.shape[1], q.shape[2]
    qs = q.view(reqs, new, heads, dim).transpose(1, 2).contiguous()
    k = torch.randn(reqs, kv_heads, new, dim, device=q.device, dtype=q.dtype)
    v = torch.randn_like(k)

    def run():
        if q.is_cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qs, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(qs, k, v, is_causal=True, enable_gqa=True)

    return run


def bench_mla_append(device, dtype, tiny) -> Iterator[tuple]:
    from pdkernels.kv_append import kv_append_mla
    from pdkernels.testing import append_positions, make_paged_cache

    for reqs, tokens in [(2, 8)] if tiny else APPEND_TOKENS:
        case = make_paged_cache([tokens] * reqs, 1, 1, PAGE_SIZE, device=device)  # the page table only
        batch_indices, positions = append_positions(case, [tokens] * reqs)
        pages = case.cache.shape[0]
        ckv_cache = torch.zeros(pages, PAGE_SIZE, 512, device=device, dtype=dtype)
        kpe_cache = torch.zeros(pages, PAGE_SIZE, 64, device=device, dtype=dtype)
        ckv = torch.randn(reqs * tokens, 512, device=device, dtype=dtype)
        kpe = torch.randn(reqs * tokens, 64, device=device, dtype=dtype)
        tables = (case.kv_indices, case.kv_indptr, case.kv_last_page_len)
        nbytes = 2 * (ckv.numel() + kpe.numel()) * ckv.element_size()
        args = (ckv, kpe, batch_indices, positions, ckv_cache, kpe_cache, *tables)
        shape = f"deepseek-mla T={reqs}x{tokens}"
        yield "kv_append_mla", shape, "triton", nbytes, 0, partial(kv_append_mla, *args, validate=False)
        fi = _flashinfer()
        if fi is not None:
            yield (
                "kv_append_mla",
                shape,
                "flashinfer",
                nbytes,
                0,
                partial(fi.page.append_paged_mla_kv_cache, *args),
            )


def bench_mla_decode(device, dtype, tiny) -> Iterator[tuple]:
    """The absorbed MLA decode over the latent cache as the engine lays it out (one [pages, P, 576] tensor,
    ckv and kpe its two views), against FlashInfer's BatchMLAPagedAttentionWrapper on separate caches."""
    from pdkernels.mla_decode import mla_decode_attention
    from pdkernels.testing import make_paged_cache

    rank, rope = (64, 16) if tiny and not WARM else (512, 64)
    mla = sorted({(heads, 2, 64) for heads, _, _ in MLA_DECODE}) if WARM else MLA_DECODE
    for heads, batch, tokens in [(16, 2, 64)] if tiny and not WARM else mla:
        case = make_paged_cache([tokens] * batch, 1, 1, PAGE_SIZE, device=device, fill=False)  # the table
        rows = torch.randn(case.cache.shape[0], PAGE_SIZE, rank + rope, device=device, dtype=dtype)
        q = torch.randn(batch, heads, rank + rope, device=device, dtype=dtype)
        q_nope, q_pe = q[..., :rank], q[..., rank:]
        tables = (case.kv_indptr, case.kv_indices, case.kv_last_page_len)
        nbytes = (batch * tokens * (rank + rope) + q.numel() + batch * heads * rank) * q.element_size()
        flops = 2 * batch * heads * tokens * (2 * rank + rope)
        shape = f"deepseek-mla H={heads} B={batch} L={tokens}"
        args = (q_nope, q_pe, rows[..., :rank], rows[..., rank:], *tables)
        ours = partial(mla_decode_attention, *args, sm_scale=0.1, max_seq_len=tokens, validate=False)
        yield "mla_decode_attention", shape, "triton", nbytes, flops, ours
        fi = _flashinfer()
        if fi is not None:
            from pdkernels.flashinfer_ops import mla_decode_wrapper

            ckv, kpe = rows[..., :rank].contiguous(), rows[..., rank:].contiguous()  # its own layout
            q_nope, q_pe = q_nope.contiguous(), q_pe.contiguous()
            wrapper = mla_decode_wrapper(q_nope, q_pe, *tables, PAGE_SIZE, 0.1, dtype)  # planned once
            theirs = partial(wrapper.run, q_nope, q_pe, ckv, kpe)
            yield "mla_decode_attention", shape, "flashinfer", nbytes, flops, theirs


WITHOUT_FLASHINFER = False  # --without-flashinfer: say so in the table instead of failing
# --warm-flashinfer: the builders make small cases of every geometry the full run uses (FlashInfer's JIT
# builds one kernel per head size, dtype and GQA group kind, not per length)
WARM = False


def _flashinfer():
    """FlashInfer on CUDA (its absence is an error there: the baselines must not vanish); None on the CPU."""
    if not torch.cuda.is_available() or WITHOUT_FLASHINFER:
        return None
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError(
            "the GPU suite compares against FlashInfer: pip install '.[gpu]' (make bench-gpu does), or "
            "pass --without-flashinfer to leave its rows out, said so in the table"
        ) from e
    return flashinfer


GROUPS = {  # each case builder, and the kernels it yields (only the asked-for builders run)
    "kv_append": (bench_kv_append, {"kv_append"}),
    "gemms": (bench_gemms, {"splitk_gemm", "out_proj"}),
    "decode": (bench_decode, {"decode_attention"}),
    "extend": (bench_extend, {"extend_attention"}),
    "mla": (bench_mla_append, {"kv_append_mla"}),
    "mla_decode": (bench_mla_decode, {"mla_decode_attention"}),
}


def run_suite(device: str, tiny: bool, quick: bool, only: list[str] | None = None) -> list[Row]:
    bench = timer(device, quick)
    graph_bench = graph_timer(quick) if device == "cuda" else bench
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    copies: dict[tuple, float] = {}  # (bytes moved, graph?) -> GB/s of a copy moving as many, timed alike
    rows = []
    for group, kernels in GROUPS.values():
        if only and not kernels & set(only):
            continue  # its tensors are never built
        for kernel, shape, provider, nbytes, flops, fn in group(device, dtype, tiny):
            if only and kernel not in only:
                continue
            graph = isinstance(fn, Graphed)
            ms = graph_bench(fn.fn) if graph else bench(fn)
            gbps = nbytes / ms / 1e6
            if (nbytes, graph) not in copies:  # a graph row's copy is a cold graph replay too
                copies[nbytes, graph] = copy_bandwidth(graph_bench if graph else bench, device, nbytes)
            copy = copies[nbytes, graph]
            rows.append(Row(kernel, shape, provider, ms, gbps, copy, 100 * gbps / copy, flops / ms / 1e9))
            print(f"{kernel:18s} {shape:36s} {provider:16s} {ms * 1e3:10.1f} us {gbps:8.1f} GB/s", flush=True)
    return rows


def warm_flashinfer(device: str) -> list[tuple[str, str, float]]:
    """Call every FlashInfer entry point the full benchmark times, once, on small cases of the same
    geometries, so that its JIT compiles (nvcc; MAX_JOBS in parallel) happen here, under a time limit of
    their own, and not inside a timed step. Returns (kernel, shape, seconds) per call."""
    global WARM
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    done, WARM = [], True
    try:
        for group, _ in GROUPS.values():
            for kernel, shape, provider, _, _, fn in group(device, dtype, True):
                if provider != "flashinfer":
                    continue
                start = time.perf_counter()
                (fn.fn if isinstance(fn, Graphed) else fn)()
                if device == "cuda":
                    torch.cuda.synchronize()
                done.append((kernel, shape, time.perf_counter() - start))
                print(f"warmed {kernel:18s} {shape:36s} {done[-1][2]:8.1f} s", flush=True)
    finally:
        WARM = False
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--quick", action="store_true", help="fewer timing repetitions")
    parser.add_argument("--only", nargs="*", choices=sorted(set().union(*(k for _, k in GROUPS.values()))))
    parser.add_argument(
        "--without-flashinfer", action="store_true", help="leave FlashInfer's rows out (the table says so)"
    )
    parser.add_argument(
        "--warm-flashinfer",
        action="store_true",
        help="only build FlashInfer's JIT kernels for the geometries a full run uses (nothing timed)",
    )
    args = parser.parse_args(argv)
    global WITHOUT_FLASHINFER
    WITHOUT_FLASHINFER = args.without_flashinfer
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.warm_flashinfer:
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            print("no FlashInfer here: nothing to warm up")
            return 0
        warmed = warm_flashinfer(device)
        print(f"FlashInfer: {len(warmed)} calls, {sum(s for *_, s in warmed):.0f} s")
        return 0
    if device == "cpu" and not args.tiny:
        print("full shapes need a CUDA device; pass --tiny on the CPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    rows = run_suite(device, args.tiny, args.quick, args.only)
    note = "FlashInfer rows left out (--without-flashinfer)" if args.without_flashinfer else ""
    write_results(rows, args.out, name, note)
    print(f"wrote {args.out / 'kernels.csv'} and {args.out / 'kernels.md'}")
    return 0 if all(math.isfinite(r.ms) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
