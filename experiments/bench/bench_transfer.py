"""KV page writes between two processes over NIXL (UCX on loopback), beside an in-process memcpy.

Each round moves LAYERS x PAGES pages of one size: one NIXL post per layer (as the messenger streams
layers), all posts in flight at once, done when every post reports DONE and the target has seen every
layer's notification. The memcpy column copies the same pages between two tensors in this process.
The messenger's own column joins this file when the messenger exists (issue 4).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")
LAYERS, PAGES = 30, 16
PAGE_BYTES = [16 << 10, 64 << 10, 256 << 10, 1 << 20]
REGION_BYTES = LAYERS * PAGES * max(PAGE_BYTES)
RESULTS: dict[tuple[str, int], float] = {}


def _target(to_bench, from_bench):
    """The decode side: register a region, then acknowledge each round once all its notifications arrived."""
    from transfer.backends import make_backend

    backend = make_backend("nixl", "bench-decode")
    region = torch.zeros(REGION_BYTES, dtype=torch.uint8)
    backend.register([region])
    to_bench.put(backend.metadata())
    while True:
        expected = from_bench.get(timeout=600)
        if expected is None:
            break
        seen, deadline = 0, time.monotonic() + 60
        while seen < expected and time.monotonic() < deadline:
            seen += len(backend.notifications())
        to_bench.put(seen)
    backend.close()


@pytest.fixture(scope="module")
def nixl_pair():
    pytest.importorskip("nixl_cu12")
    from transfer.backends import make_backend

    ctx = mp.get_context("spawn")
    to_bench, from_bench = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_target, args=(to_bench, from_bench), daemon=True)
    proc.start()
    backend = make_backend("nixl", "bench-prefill")
    backend.register([torch.randint(0, 256, (REGION_BYTES,), dtype=torch.uint8)])
    peer = backend.connect(to_bench.get(timeout=120))
    yield backend, peer, to_bench, from_bench
    from_bench.put(None)
    proc.join(timeout=30)
    backend.close()


def _layer_ops(page_bytes: int):
    from transfer.backends import WriteOp

    # layer l's pages in reversed order on the target, so no two neighbouring writes merge into one
    stride = PAGES * page_bytes
    return [
        [
            WriteOp(
                0,
                layer * stride + p * page_bytes,
                0,
                layer * stride + (PAGES - 1 - p) * page_bytes,
                page_bytes,
            )
            for p in range(PAGES)
        ]
        for layer in range(LAYERS)
    ]


@pytest.mark.benchmark(group="transfer")
@pytest.mark.parametrize("page_bytes", PAGE_BYTES)
def test_nixl_page_writes(benchmark, nixl_pair, page_bytes):
    backend, peer, to_bench, from_bench = nixl_pair
    ops = _layer_ops(page_bytes)

    def round_trip():
        from_bench.put(LAYERS)
        handles = [backend.post(peer, layer_ops, f"layer:{i}".encode()) for i, layer_ops in enumerate(ops)]
        while any(backend.state(h) == "PROC" for h in handles):
            pass
        for h in handles:
            backend.release(h)
        assert to_bench.get(timeout=60) == LAYERS

    round_trip()  # warm up
    runs = []
    benchmark.pedantic(lambda: runs.append(_timed(round_trip)), rounds=3, iterations=1)
    RESULTS[("nixl", page_bytes)] = LAYERS * PAGES * page_bytes / min(runs) / 1e9


@pytest.mark.benchmark(group="transfer")
@pytest.mark.parametrize("page_bytes", PAGE_BYTES)
def test_memcpy_page_copies(benchmark, page_bytes):
    src = torch.randint(0, 256, (LAYERS * PAGES, page_bytes), dtype=torch.uint8)
    dst = torch.zeros_like(src)

    def copy_pages():
        for i in range(LAYERS * PAGES):
            dst[i].copy_(src[i])

    copy_pages()
    runs = []
    benchmark.pedantic(lambda: runs.append(_timed(copy_pages)), rounds=3, iterations=1)
    RESULTS[("memcpy", page_bytes)] = LAYERS * PAGES * page_bytes / min(runs) / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_summary(capsys):
    if not RESULTS:
        pytest.skip("no transfer benchmark ran")
    lines = [
        "",
        f"{LAYERS} layers x {PAGES} pages per round, best of 3 (GB/s)",
        "page size | NIXL (2 processes) | memcpy",
    ]
    for size in PAGE_BYTES:
        nixl, memcpy = RESULTS.get(("nixl", size)), RESULTS.get(("memcpy", size))
        lines.append(f"{size >> 10:6d} KiB | {nixl or float('nan'):18.2f} | {memcpy or float('nan'):6.2f}")
    with capsys.disabled():
        print("\n".join(lines))
