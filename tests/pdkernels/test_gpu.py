"""On a CUDA device: our kernels against FlashInfer itself and against the references at serving shapes."""

import pytest
import torch

from pdkernels.decode_attention import decode_attention, decode_attention_ref
from pdkernels.extend_attention import extend_attention, extend_attention_ref
from pdkernels.kv_append import kv_append, kv_append_mla
from pdkernels.splitk_gemm import splitk_gemm, splitk_gemm_ref
from pdkernels.testing import append_positions, make_paged_cache

pytestmark = pytest.mark.gpu
SEQ_LENS = [1, 17, 50, 700, 2049]


def _cuda(case):
    for name in ("cache", "kv_indptr", "kv_indices", "kv_last_page_len"):
        setattr(case, name, getattr(case, name).cuda())
    return case


@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_kv_append_equals_flashinfer(kv_layout, page_size):
    flashinfer = pytest.importorskip("flashinfer")
    case = _cuda(make_paged_cache(SEQ_LENS, 8, 128, page_size, kv_layout, dtype=torch.bfloat16))
    batch_indices, positions = (t.cuda() for t in append_positions(case, [1, 9, 50, 300, 1]))
    k = torch.randn(positions.numel(), 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = (case.kv_indices, case.kv_indptr, case.kv_last_page_len)
    ours, theirs = case.cache.clone(), case.cache.clone()
    kv_append(k, v, batch_indices, positions, ours, *tables, kv_layout)
    flashinfer.page.append_paged_kv_cache(
        k, v, batch_indices, positions, theirs, *tables, kv_layout=kv_layout
    )
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


def test_kv_append_mla_equals_flashinfer():
    flashinfer = pytest.importorskip("flashinfer")
    case = _cuda(make_paged_cache(SEQ_LENS, 1, 1, 16))
    batch_indices, positions = (t.cuda() for t in append_positions(case, [1, 9, 50, 300, 1]))
    latent = torch.randn(case.cache.shape[0], 16, 576, device="cuda", dtype=torch.bfloat16)
    ours = latent.clone()
    ckv = torch.randn(positions.numel(), 512, device="cuda", dtype=torch.bfloat16)
    kpe = torch.randn(positions.numel(), 64, device="cuda", dtype=torch.bfloat16)
    tables = (case.kv_indices, case.kv_indptr, case.kv_last_page_len)
    kv_append_mla(ckv, kpe, batch_indices, positions, ours[..., :512], ours[..., 512:], *tables)
    # FlashInfer takes two contiguous caches; ours may be views of one [pages, P, 576] tensor
    ckv_c, kpe_c = latent[..., :512].contiguous(), latent[..., 512:].contiguous()
    flashinfer.page.append_paged_mla_kv_cache(ckv, kpe, batch_indices, positions, ckv_c, kpe_c, *tables)
    torch.testing.assert_close(ours, torch.cat([ckv_c, kpe_c], -1), atol=0, rtol=0)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_attention_close_to_flashinfer(group):
    pytest.importorskip("flashinfer")
    from pdkernels import flashinfer_ops

    case = _cuda(make_paged_cache(SEQ_LENS, 8, 128, 16, "HND", dtype=torch.bfloat16))
    q = torch.randn(len(SEQ_LENS), 8 * group, 128, device="cuda", dtype=torch.bfloat16)
    tables = (case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len, "HND")
    ours, lse = decode_attention(q, *tables, return_lse=True)
    theirs, their_lse = flashinfer_ops.decode_attention(q, *tables, return_lse=True)
    torch.testing.assert_close(ours, theirs, atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(lse, their_lse, atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(ours, decode_attention_ref(q, *tables), atol=1.6e-2, rtol=1.6e-2)


def test_extend_attention_close_to_ref_on_gpu():
    case = _cuda(make_paged_cache(SEQ_LENS, 8, 128, 16, "HND", dtype=torch.float16))
    q_lens = [1, 9, 50, 300, 1]
    qo_indptr = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), 32, 128, device="cuda", dtype=torch.float16)
    tables = (case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len, "HND")
    torch.testing.assert_close(
        extend_attention(q, qo_indptr, *tables),
        extend_attention_ref(q, qo_indptr, *tables),
        atol=2e-3,
        rtol=2e-3,
    )


@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_splitk_gemm_close_to_ref_on_gpu(m):
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16) / 64
    torch.testing.assert_close(splitk_gemm(x, w), splitk_gemm_ref(x, w), atol=3e-2, rtol=1.6e-2)


def test_splitk_gemm_one_launch_reduction_is_deterministic_under_concurrency():
    """200 launches with 16 K-slices racing for each tile's last ticket: the same bits every time (the
    last slice sums in slice order) and the ticket scratch back to zero."""
    from pdkernels.splitk_gemm import tile_tickets

    x = torch.randn(4, 8192, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16) / 90
    first = splitk_gemm(x, w, split_k=16)
    outs = [splitk_gemm(x, w, split_k=16) for _ in range(200)]
    torch.cuda.synchronize()
    assert all(torch.equal(y, first) for y in outs)
    assert int(tile_tickets(x.device, 1).abs().sum()) == 0
    torch.testing.assert_close(first, splitk_gemm_ref(x, w), atol=3e-2, rtol=1.6e-2)


# ---- what only a real GPU can show: concurrency, visibility, graphs, 64-bit addressing -------------------


def _report(name: str, figures: dict) -> None:
    """Key figures for `make gpu-check`'s table (PDKERNELS_GPU_REPORT: a folder; unset: nothing)."""
    import json
    import os

    folder = os.environ.get("PDKERNELS_GPU_REPORT")
    if folder:
        with open(os.path.join(folder, f"{name}.json"), "w") as f:
            json.dump(figures, f)


@pytest.mark.parametrize("m", [1, 64, 4097])
def test_layer_counter_exact_under_real_concurrency(m):
    """400 passes over 4 layers: every pass bumps every layer exactly once, tickets end at 0."""
    from pdkernels.out_proj import make_layer_counter, out_proj

    x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) / 45
    y = torch.empty(m, 2048, device="cuda", dtype=torch.bfloat16)
    counter = make_layer_counter(4, "cuda")
    for _ in range(400):
        for layer in range(4):
            out_proj(x, w, out=y, counter=counter, layer=layer, validate=False)
    torch.cuda.synchronize()
    assert counter.tolist() == [[400] * 4, [0] * 4]
    torch.testing.assert_close(y, splitk_gemm_ref(x, w), atol=3e-2, rtol=1.6e-2)


@pytest.mark.parametrize("m", [1, 16, 64, 4097])
def test_out_proj_split_k_and_single_pass_match_the_reference(m):
    from pdkernels.out_proj import make_layer_counter, out_proj

    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    counter = make_layer_counter(2, "cuda")
    # the default (split-K at decode M, cuBLAS + bump at prefill M), one pass of Triton tiles, and split-K
    # forced at every M (one launch: each tile's last slice reduces it)
    for split_k, gemm in ((None, "auto"), (1, "triton"), (4, "triton")):
        y = out_proj(x, w, counter=counter, layer=1, split_k=split_k, gemm=gemm)
        torch.testing.assert_close(y, splitk_gemm_ref(x, w), atol=3e-2, rtol=1.6e-2)
    torch.cuda.synchronize()
    assert counter.tolist() == [[0, 3], [0, 0]]


def test_layer_counter_visible_to_the_host_while_the_pass_runs():
    """The host sees layer l's bump through plain loads of pinned memory, long before the pass ends."""
    import threading
    import time

    from pdkernels.out_proj import host_view, make_layer_counter, out_proj

    layers = 8
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    counter = make_layer_counter(layers, "cuda")
    host = host_view(counter)
    assert host.device.type == "cpu" and host.is_pinned()
    torch.cuda.synchronize()
    seen: list[float] = []

    def poll():
        for layer in range(layers):
            while int(host[0, layer]) < 1:
                pass
            seen.append(time.perf_counter())

    poller = threading.Thread(target=poll)
    start = time.perf_counter()
    for layer in range(layers):  # a "layer": ~5 ms of GEMMs, then the projection that bumps it
        for _ in range(3):
            a @ a
        out_proj(x, w, counter=counter, layer=layer, validate=False)
    poller.start()
    torch.cuda.synchronize()
    end = time.perf_counter()
    poller.join(timeout=10)
    assert len(seen) == layers
    rel = [round((t - end) * 1e3, 2) for t in seen]  # ms before (negative) or after the pass ended
    _report(
        "counter_visibility", {"layers": layers, "pass_ms": round((end - start) * 1e3, 2), "seen_ms": rel}
    )
    assert seen == sorted(seen)
    assert seen[0] < end - 0.5 * (end - start), f"layer 0 seen only {rel[0]} ms from the end"
    assert seen[layers - 2] < end, f"layer {layers - 2} was not visible before the pass ended: {rel}"


def test_layer_counter_bumps_inside_a_cuda_graph():
    """Decode steps replay graphs: the bump is part of the graph, once per replay and layer."""
    from pdkernels.out_proj import make_layer_counter, out_proj

    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) / 45
    y = torch.empty(8, 2048, device="cuda", dtype=torch.bfloat16)
    counter = make_layer_counter(4, "cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up (compile) outside the capture
        for layer in range(4):
            out_proj(x, w, out=y, counter=counter, layer=layer, validate=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(4):
            out_proj(x, w, out=y, counter=counter, layer=layer, validate=False)
    eager = splitk_gemm_ref(x, w)
    for _ in range(100):
        graph.replay()
    torch.cuda.synchronize()
    assert counter.tolist() == [[101] * 4, [0] * 4]  # the warm-up pass, then one per replay
    torch.testing.assert_close(y, eager, atol=3e-2, rtol=1.6e-2)


def test_kernels_address_caches_past_2_pow_31_elements():
    """140,000 pages x 2 x 8 heads x 16 x 128 (4.6e9 elements, bf16): append and attend on the last pages."""
    from pdkernels.out_proj import out_proj  # noqa: F401  (compiled already: keeps this test about memory)

    pages, heads, page_size, dim = 140_000, 8, 16, 128
    cache = torch.empty((pages, 2, heads, page_size, dim), device="cuda", dtype=torch.bfloat16)
    assert cache.numel() > 2**32
    used = torch.tensor([pages - 1, pages - 5, pages - 3, pages - 7, pages - 2, pages - 9], dtype=torch.int32)
    cache[used.long()] = torch.randn((len(used), 2, heads, page_size, dim), device="cuda").to(cache.dtype)
    kv_indices = used.cuda()
    kv_indptr = torch.tensor([0, 3, 6], dtype=torch.int32, device="cuda")
    last = torch.tensor([8, 1], dtype=torch.int32, device="cuda")
    tables = (kv_indices, kv_indptr, last)
    # append the last token of each sequence (position 39 and 32)
    k = torch.randn(2, heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    batch_indices = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    positions = torch.tensor([39, 32], dtype=torch.int32, device="cuda")
    kv_append(k, v, batch_indices, positions, cache, *tables)
    torch.testing.assert_close(cache[pages - 3, 0, :, 7], k[0], atol=0, rtol=0)
    torch.testing.assert_close(cache[pages - 9, 1, :, 0], v[1], atol=0, rtol=0)
    q = torch.randn(2, 32, dim, device="cuda", dtype=torch.bfloat16)
    page_tables = (cache, kv_indptr, kv_indices, last)
    ours = decode_attention(q, *page_tables)
    small = cache[used.long()]  # the same pages, renumbered 0..5: addresses under 2^31
    renumbered = (small, kv_indptr, torch.arange(6, dtype=torch.int32, device="cuda"), last)
    torch.testing.assert_close(ours, decode_attention_ref(q, *renumbered), atol=1.6e-2, rtol=1.6e-2)
    qo_indptr = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    torch.testing.assert_close(
        extend_attention(q, qo_indptr, *page_tables),
        extend_attention_ref(q, qo_indptr, *renumbered),
        atol=1.6e-2,
        rtol=1.6e-2,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_on_skewed_lengths(dtype):
    """One compiled kernel for every length mix; fp32 inputs are exact (IEEE dots, not TF32)."""
    lens = [1, 5, 3000, 17, 70000, 256, 257]
    case = _cuda(make_paged_cache(lens, 8, 128, 16, "HND", dtype=dtype))
    q = torch.randn(len(lens), 32, 128, device="cuda", dtype=dtype)
    tables = (case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len, "HND")
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(
        decode_attention(q, *tables), decode_attention_ref(q, *tables), atol=tol, rtol=tol
    )


def test_extend_attention_fp32_is_ieee_exact():
    case = _cuda(make_paged_cache([300, 64, 1000], 4, 256, 16, "HND"))  # head_dim 256: fewer stages
    q_lens = [100, 64, 1]
    qo_indptr = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), 8, 256, device="cuda")
    tables = (case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len, "HND")
    torch.testing.assert_close(
        extend_attention(q, qo_indptr, *tables, max_q_len=100),
        extend_attention_ref(q, qo_indptr, *tables),
        atol=2e-5,
        rtol=2e-5,
    )
