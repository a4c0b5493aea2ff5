"""The engine on CUDA with the compiled Triton kernels (PDKERNELS_TEST_COMPILED=1: make test-gpu)."""

import random
import time

import pytest
import torch

from engine import LLM, SamplingParams
from pdkernels import ops
from pdkernels.out_proj import host_view

pytestmark = pytest.mark.gpu


def _prompts(n, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.choice([1, 5, 17, 50, 70]))] for _ in range(n)]


def _greedy(model: str, device: str, dtype: str, prompts, tokens: int):
    llm = LLM(model, device=device, dtype=dtype, page_size=16, num_pages=256)
    assert ops.resolve("decode_attention", llm.kv_cache.device) == ("triton" if device == "cuda" else "torch")
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    return [o.token_ids for o in outs], time.perf_counter() - start


def test_tiny_model_on_triton_kernels_gives_the_cpu_tokens():
    prompts = _prompts(8, 1000)
    cpu, _ = _greedy("tiny-random", "cpu", "float32", prompts, 16)
    gpu, _ = _greedy("tiny-random", "cuda", "float32", prompts, 16)
    assert gpu == cpu


def test_smollm2_greedy_on_gpu_equals_cpu():
    """SmolLM2-135M in fp32: the compiled kernels against the CPU references (skipped without its GGUF)."""
    from engine.weights import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    llm = LLM("smollm2-135m", device="cpu", page_size=16, num_pages=64)
    prompts = [llm.tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):", "1, 2, 3,")]
    cpu, _ = _greedy("smollm2-135m", "cpu", "float32", prompts, 24)
    gpu, _ = _greedy("smollm2-135m", "cuda", "float32", prompts, 24)
    assert gpu == cpu


def test_prefill_role_counts_layers_in_host_memory():
    llm = LLM("tiny-random", device="cuda", role="prefill", page_size=16, num_pages=64)
    host = host_view(llm.core.counter)
    assert host.device.type == "cpu" and host.data_ptr() == llm.core.counter.data_ptr()
    llm.add_request(list(range(3, 40)), SamplingParams(max_tokens=1), request_id="r")
    llm.step()
    torch.cuda.synchronize()
    assert host[0].tolist() == [1] * llm.config.arch.num_layers and host[1].tolist() == [0] * 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_graph_replay_gives_the_eager_tokens(dtype):
    """Decode steps replayed from CUDA graphs (the default on CUDA) against eager steps; batch sizes
    between buckets (padding rows) included, as requests finish at different lengths."""
    import time

    prompts = _prompts(11, 1000, seed=3)
    params = [SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    times, tokens = {}, {}
    for graphs in (False, True):
        llm = LLM("tiny-random", device="cuda", dtype=dtype, page_size=16, num_pages=256, cuda_graphs=graphs)
        llm.generate(prompts[:2], params[:2])  # warm-up: kernels compiled
        start = time.perf_counter()
        tokens[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        times[graphs] = time.perf_counter() - start
        if graphs:
            assert llm.runner.graphs.replays > 0 and llm.runner.graphs.graphs
            capture_s = llm.runner.graphs.capture_s
    assert tokens[True] == tokens[False]
    from tests.pdkernels.test_gpu import _report

    _report(
        f"decode_graphs_{dtype}",
        {
            "eager_s": round(times[False], 3),
            "graphs_s": round(times[True], 3),
            "capture_s": round(capture_s, 2),
        },
    )


def _vmm_rank(conn):
    """A 'TP rank': allocates KV memory with CUDA VMM, fills it, exports it, then checks the lead's write."""
    from multiprocessing.reduction import send_handle

    from engine.vmm import SharedAllocation

    alloc = SharedAllocation(64 << 20)
    kv = alloc.tensor((1024, 16384), torch.bfloat16)
    kv.copy_(torch.arange(16384, device="cuda", dtype=torch.float32).to(torch.bfloat16).expand(1024, -1))
    torch.cuda.synchronize()
    send_handle(conn, alloc.export_fd(), conn.recv())  # the lead's pid
    conn.send(alloc.nbytes)
    conn.recv()  # the lead has written row 0
    conn.send(bool((kv[0] == -1).all()))
    conn.recv()
    alloc.close()


def test_a_rank_kv_cache_maps_into_the_lead_through_cuda_vmm():
    """What TP on GPUs needs for one NIXL agent in the lead: a rank's cache, mapped into the lead process
    through a POSIX file descriptor (one GPU here: both processes on it)."""
    import multiprocessing as mp
    import os
    from multiprocessing.reduction import recv_handle

    pytest.importorskip("cuda.bindings")
    from engine.vmm import SharedAllocation

    lead, rank = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_vmm_rank, args=(rank,))
    proc.start()
    try:
        lead.send(os.getpid())
        fd = recv_handle(lead)
        mapped = SharedAllocation(lead.recv(), fd=fd)
        kv = mapped.tensor((1024, 16384), torch.bfloat16)
        assert torch.equal(kv[7], torch.arange(16384, device="cuda", dtype=torch.float32).to(torch.bfloat16))
        kv[0].fill_(-1)
        torch.cuda.synchronize()
        lead.send("written")
        assert lead.recv() is True  # the rank sees the lead's write
        lead.send("done")
        proc.join(timeout=30)
        assert proc.exitcode == 0
        mapped.close()
    finally:
        if proc.is_alive():
            proc.kill()


def test_tp2_on_one_gpu_gives_the_tp1_tokens_with_rank_kv_mapped_through_vmm(monkeypatch):
    """TP 2 on CUDA: rank 1's KV cache is a VMM allocation the lead maps (what one NIXL agent registers).
    One GPU holds both ranks here, so the collectives run over gloo (NCCL refuses two ranks on one GPU)."""
    pytest.importorskip("cuda.bindings")
    monkeypatch.setenv("PDKERNELS_TP_COLLECTIVES", "gloo")
    prompts = _prompts(4, 1000, seed=5)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    one = LLM("tiny-random", device="cuda", dtype="float32", page_size=16, num_pages=64)
    ref = [o.token_ids for o in one.generate(prompts, greedy)]
    with LLM("tiny-random", tp=2, device="cuda", dtype="float32", page_size=16, num_pages=64) as llm:
        got = [o.token_ids for o in llm.generate(prompts, greedy)]
        lead, rank = llm.kv_caches
        assert rank.is_cuda and rank.shape == lead.shape and rank.data_ptr() != lead.data_ptr()
        assert bool(rank.abs().sum() > 0)  # the rank's appends, read through the lead's mapping
        _nixl_reads_both_ranks(llm.kv_caches)
    assert got == ref


def _nixl_reads_both_ranks(caches):
    """One NIXL agent registers the lead's cache and the mapped rank's (VRAM) and writes both into
    another agent's memory (UCX cuda_ipc/cuda_copy on one host)."""
    import time

    pytest.importorskip("nixl_cu13" if torch.version.cuda.startswith("13") else "nixl_cu12")
    from transfer.backends import WriteOp, make_backend

    src, dst = make_backend("nixl", "tp-lead"), make_backend("nixl", "reader")
    regions = [c.view(-1).view(torch.uint8) for c in caches]
    n = min(r.numel() for r in regions)
    target = torch.zeros(2 * n, dtype=torch.uint8, device="cuda")
    src.register(regions)
    dst.register([target])
    assert src.mem_type == "VRAM"
    peer = src.connect(dst.metadata())
    ops = [WriteOp(0, 0, 0, 0, n), WriteOp(1, 0, 0, n, n)]
    handle = src.post(peer, ops, b"both")
    deadline = time.monotonic() + 30
    while src.state(handle) != "DONE" and time.monotonic() < deadline:
        dst.notifications()
    torch.cuda.synchronize()
    assert torch.equal(target[:n], regions[0][:n]) and torch.equal(target[n:], regions[1][:n])
    src.close()
    dst.close()


def test_ngram_speculation_on_the_gpu_is_lossless():
    """ngram drafts verified by the compiled kernels: greedy tokens equal those without speculation, some
    drafts accepted, every page back."""
    from tests.engine.test_speculative import REPEATING

    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = REPEATING + _prompts(6, 1000)
    kwargs = dict(device="cuda", dtype="float32", page_size=16, num_pages=256)
    plain = [o.token_ids for o in LLM("tiny-random", **kwargs).generate(prompts, greedy)]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM("tiny-random", speculative_config=spec, **kwargs)
    outs = llm.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.num_accepted_tokens for o in outs) > 0
    assert llm.allocator.num_free == llm.allocator.num_pages


def test_kv_tiers_on_the_gpu_bring_pages_back_through_a_pinned_host_pool_and_files(tmp_path):
    """A small cache on the GPU: evicted pages come back from the host pool (pinned) and from files (NIXL
    POSIX), copied on the tiers' side streams (a save after the compute stream's writes, a load before a
    request reads the page); greedy tokens equal those with no prefix cache at all, every page back."""
    from tests.engine.kv.test_tiers import _prompts

    prompts = _prompts()  # four 120-token prompts, then each again with 3 more tokens
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    small = dict(device="cuda", dtype="float32", page_size=16, num_pages=12, max_num_seqs=2)
    plain = LLM("tiny-random", enable_prefix_caching=False, **small)
    reference = [plain.generate([p], greedy)[0].token_ids for p in prompts]
    tiers = {"host_bytes": 16 * 20480, "disk_bytes": 64 * 20480, "disk_dir": str(tmp_path)}
    llm = LLM("tiny-random", kv_tiers=tiers, **small)
    assert llm.tiers.fmt.slot_bytes == 20480 and llm.tiers.host.memory.is_pinned()
    outs = [llm.generate([p], greedy)[0] for p in prompts]
    assert [o.token_ids for o in outs] == reference
    assert [o.num_cached_tokens for o in outs[4:]] == [112] * 4  # the 7 full pages of each first prompt
    stats = llm.kv_tier_stats
    assert stats["host"]["hit_tokens"] > 0 and stats["disk"]["hit_tokens"] > 0
    assert set(llm.tiers.fmt._streams) == {"save", "load"}
    assert llm.tiers.drain() and llm.allocator.num_free == llm.allocator.num_pages
    llm.close()
