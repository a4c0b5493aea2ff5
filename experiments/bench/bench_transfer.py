"""KV page writes between two processes over NIXL (UCX on loopback), beside an in-process memcpy.

Each round moves LAYERS x PAGES pages of one size: one NIXL post per layer (as the messenger streams
layers), all posts in flight at once, done when every post reports DONE and the target has seen every
layer's notification. The memcpy column copies the same pages between two tensors in this process.

The messenger column runs the real PrefillMessenger here and the real DecodeMessenger in another process
(pyzmq control, NIXL data) on one request of PAGES pages: every layer counter is bumped at once, and the
round lasts from that bump to the decode side's release (all writes and the context write counted).
The release latency runs the same request with the layers bumped one by one, LAYER_GAP_S apart, as a
forward pass would, and measures from the last layer's bump to the decode side's release.
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
HIDDEN = 576
LAYER_GAP_S = 0.002


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
    """Per layer, an int64 array [PAGES, 5] of writes (built outside the timed region)."""
    from transfer.backends.base import WriteOp, as_ops

    # layer l's pages in reversed order on the target, so no two neighbouring writes merge into one
    stride = PAGES * page_bytes
    return [
        as_ops(
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
        )
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


def _spec(page_bytes: int):
    from transfer.plan import ShardSpec

    # 4 kv heads x 16 tokens x fp16 per K and V; head_dim sets the page size
    return ShardSpec(1, 4, LAYERS, PAGES, 16, page_bytes // (2 * 4 * 16 * 2), 2, dtype="float16")


class _Pages:
    """The decode engine as the messenger sees it, with pages PAGES-1..0 (no neighbouring writes merge)."""

    def __init__(self):
        self.admitted, self.failed = set(), {}

    def reserve(self, request_id, prompt_ids, params, load_within_s=0.0):
        return list(range(PAGES))[::-1], 0  # nothing cached or below

    def admit(self, request_id, context):
        self.admitted.add(request_id)

    def fail(self, request_id, error):
        self.failed[request_id] = error

    def free(self, request_id):
        pass

    def set_aside(self, request_id, owner):
        pass

    def recompute(self, request_id):
        pass


def _messenger_decode(page_bytes, creds, commands, results):
    """The decode process: a DecodeMessenger over a KV region; each command is a request to run."""
    from transfer.backends import make_backend
    from transfer.channel import ZmqEndpoint
    from transfer.decode import DecodeMessenger
    from transfer.protocol import decode_codec, wait_hello

    spec, engine = _spec(page_bytes), _Pages()
    backend = make_backend("nixl", f"bench-md-{os.getpid()}")
    dm = DecodeMessenger(engine, backend, spec, [torch.zeros(spec.region_bytes, dtype=torch.uint8)], HIDDEN)
    channel = ZmqEndpoint("tcp://127.0.0.1:0", True, creds, "prefill", decode_codec())
    results.put(channel.address)
    dm.add_peer("prefill", channel, wait_hello(channel, timeout_s=120))
    results.put("ready")
    while (rid := commands.get(timeout=600)) is not None:
        dm.submit(rid, list(range(PAGES * spec.page_size + 1)))
        give_up = time.monotonic() + 60
        while rid not in engine.admitted and rid not in engine.failed and time.monotonic() < give_up:
            dm.poll()
        results.put((rid, dm.timings.get(rid), engine.failed.get(rid)))
    backend.close()


class _Source:
    def start(self, request_id, prompt_ids, cache_salt="", client=()):
        pass

    def pages(self, request_id):
        return list(range(PAGES))

    def stop(self, request_id):
        pass

    def release(self, request_id):
        pass


@pytest.fixture(params=PAGE_BYTES, ids=lambda b: f"{b >> 10}KiB")
def messenger_pair(request):
    """(page bytes, prefill messenger here, counter, commands, results) with the decode side in a process."""
    pytest.importorskip("nixl_cu12")
    from transfer.auth import keyring
    from transfer.backends import make_backend
    from transfer.channel import ZmqEndpoint
    from transfer.prefill import PrefillMessenger
    from transfer.protocol import prefill_codec

    page_bytes, spec = request.param, _spec(request.param)
    keys = keyring(["decode", "prefill"])
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    args = (page_bytes, keys["decode"], commands, results)
    proc = ctx.Process(target=_messenger_decode, args=args, daemon=True)
    proc.start()
    # the side that sends Hello connects
    channel = ZmqEndpoint(results.get(timeout=120), False, keys["prefill"], "decode", prefill_codec())
    counter = torch.zeros(2, LAYERS, dtype=torch.int32)
    region = torch.randint(0, 256, (spec.region_bytes,), dtype=torch.uint8)
    backend = make_backend("nixl", f"bench-mp-{os.getpid()}")
    pm = PrefillMessenger(_Source(), backend, spec, [region], counter, HIDDEN)
    pm.add_peer(channel)
    give_up = time.monotonic() + 120
    while results.empty():  # the decode side answers heartbeats only once it reads the channel
        pm.poll()
        assert time.monotonic() < give_up and proc.is_alive(), "the decode process did not start"
        time.sleep(0.01)
    assert results.get() == "ready"
    yield page_bytes, pm, counter, commands, results
    commands.put(None)
    proc.join(timeout=30)
    pm.close()
    backend.close()
    channel.close()


_rounds = iter(range(1 << 30))


def _messenger_round(pm, counter, commands, results, layer_gap_s: float) -> tuple[float, float]:
    """One request through both messengers; returns the time from the first bump, from the last bump and
    from the last write's completion (seen by the prefill side) to the decode side's release."""
    from types import SimpleNamespace

    rid = f"b{next(_rounds)}"
    commands.put(rid)
    give_up = time.monotonic() + 60
    while rid not in pm.transfers:  # the PrefillRequest arrives
        pm.poll()
        assert time.monotonic() < give_up
    t = pm.transfers[rid]
    seq = SimpleNamespace(request_id=rid, prompt_ids=t.req.prompt_ids)
    chunk = SimpleNamespace(seq=seq, end=len(seq.prompt_ids), pages=list(range(PAGES)))
    pm.on_batch(SimpleNamespace(chunks=[chunk]), counter)
    first = time.perf_counter()
    if layer_gap_s:
        for layer in range(LAYERS):
            time.sleep(layer_gap_s)
            counter[0, layer] = pm._passes
            last = time.perf_counter()
    else:
        counter[0, :] = pm._passes
        last = first
    pm.on_prefilled(seq, torch.ones(HIDDEN))
    while rid in pm.transfers:
        pm.poll()
        time.sleep(0.0005)
        assert time.monotonic() < give_up
    got, timing, error = results.get(timeout=60)
    assert got == rid and error is None, error
    done = {s.request_id: s.done for s in pm.done_log}[rid]
    return timing.landed - first, timing.landed - last, timing.landed - done


@pytest.mark.benchmark(group="transfer")
def test_messenger_page_writes(benchmark, messenger_pair):
    page_bytes, pm, counter, commands, results = messenger_pair
    _messenger_round(pm, counter, commands, results, 0)  # warm up
    runs = []
    benchmark.pedantic(
        lambda: runs.append(_messenger_round(pm, counter, commands, results, 0)[0]), rounds=3, iterations=1
    )
    RESULTS[("messenger", page_bytes)] = LAYERS * PAGES * page_bytes / min(runs) / 1e9
    streamed = [_messenger_round(pm, counter, commands, results, LAYER_GAP_S) for _ in range(5)]
    for key, col in (("bump_to_release_ms", 1), ("landed_to_release_ms", 2)):
        RESULTS[(key, page_bytes)] = 1e3 * sorted(r[col] for r in streamed)[len(streamed) // 2]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_summary(capsys):
    if not RESULTS:
        pytest.skip("no transfer benchmark ran")
    lines = [
        "",
        f"{LAYERS} layers x {PAGES} pages per round, best of 3 (GB/s). With layers done "
        f"{1e3 * LAYER_GAP_S:.0f} ms apart, median of 5 (ms): last bump or last write done -> release",
        "page size | messenger | NIXL (2 processes) | memcpy | bump->release | write->release",
    ]
    nan = float("nan")
    keys = ("messenger", "nixl", "memcpy", "bump_to_release_ms", "landed_to_release_ms")
    for size in PAGE_BYTES:
        g = [RESULTS.get((k, size), nan) for k in keys]
        lines.append(
            f"{size >> 10:6d} KiB | {g[0]:9.2f} | {g[1]:18.2f} | {g[2]:6.2f} | {g[3]:13.2f} | {g[4]:14.2f}"
        )
    with capsys.disabled():
        print("\n".join(lines))
