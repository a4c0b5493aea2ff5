import pytest
import torch
import torch.nn.functional as F

from pdkernels import ops
from pdkernels.extend_attention import extend_attention, extend_attention_ref
from pdkernels.extend_attention_cpu import extend_attention_cpu
from pdkernels.kv_append import kv_append
from pdkernels.testing import all_pairs, append_positions, make_paged_cache

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
SEQ_LENS = [1, 17, 50]
KV_HEADS, HEAD_DIM = 2, 32
# queries per request: a full prefill, a chunk after a cached prefix, and a mix with a decode-like row
Q_LENS = {"prefill": [1, 17, 50], "chunk": [1, 9, 20], "mixed": [1, 1, 33]}


def _qo_indptr(q_lens):
    return torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)


@pytest.mark.parametrize(  # every pair of factor values (9 cases, not the 72 of the whole product)
    "mode,page_size,kv_layout,group,dtype",
    all_pairs(sorted(Q_LENS), [4, 16], ["HND", "NHD"], [1, 4], list(TOL)),
)
def test_extend_attention_matches_ref(mode, page_size, kv_layout, group, dtype):
    case = make_paged_cache(SEQ_LENS, KV_HEADS, HEAD_DIM, page_size, kv_layout, dtype=dtype)
    qo_indptr = _qo_indptr(Q_LENS[mode])
    q = torch.randn(int(qo_indptr[-1]), KV_HEADS * group, HEAD_DIM).to(dtype)
    tables = (case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len, kv_layout)
    out, lse = extend_attention(q, qo_indptr, *tables, return_lse=True)
    ref, ref_lse = extend_attention_ref(q, qo_indptr, *tables, return_lse=True)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "mode,page_size,kv_layout,group,dtype",
    all_pairs(
        sorted(Q_LENS), [4, 16], ["HND", "NHD"], [1, 3], [torch.float32, torch.bfloat16, torch.float16]
    ),
)
def test_the_cpu_path_skips_the_masked_blocks_and_equals_the_reference(
    mode, page_size, kv_layout, group, dtype
):
    """The torch backend's causal path (flash with is_causal over a chunk's own keys, the context before it
    unmasked, merged by log-sum-exp): the reference's output, a whole prompt or a chunk after a prefix.
    In bf16 on CPUs that compute in it the path's scores come out of oneDNN's bf16 GEMM rounded to bf16
    (the reference keeps them in fp32): 0.021 from the fp32 truth at worst over 300 draws here, the
    reference 0.008, so its bound is wider than the reference's own."""
    torch.manual_seed(sum(map(ord, f"{mode}{page_size}{kv_layout}{group}{dtype}")))  # the same draw each run
    case = make_paged_cache(SEQ_LENS, KV_HEADS, HEAD_DIM, page_size, kv_layout, dtype=dtype)
    qo_indptr = _qo_indptr(Q_LENS[mode])
    q = torch.randn(int(qo_indptr[-1]), KV_HEADS * group, HEAD_DIM).to(dtype)
    tables = (case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len, kv_layout)
    ref = extend_attention_ref(q, qo_indptr, *tables, sm_scale=0.3)
    atol, rtol = (3e-2, 1.6e-2) if dtype == torch.bfloat16 else TOL[dtype]
    torch.testing.assert_close(
        extend_attention_cpu(q, qo_indptr, *tables, sm_scale=0.3), ref, atol=atol, rtol=rtol
    )
    ops.set_backend("torch")
    try:
        got = ops.extend_attention(q, qo_indptr, *tables, sm_scale=0.3)
    finally:
        ops.set_backend("auto")
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("kv_heads, group, causal", [(2, 1, False), (2, 3, True), (1, 32, True)])
def test_extend_attention_over_several_key_blocks_and_gqa_groups(kv_heads, group, causal):
    """Keys over several 64-token blocks (the unmasked loop, then the diagonal and a partial block), a
    chunk after a cached prefix beside a whole prompt, GQA groups of 1, 3 (padded to 4 rows a token) and
    32 (more rows than the interpreter's 16-row block holds: one token a program)."""
    case = make_paged_cache([150, 70], kv_heads, HEAD_DIM, 16, "HND")
    qo_indptr = _qo_indptr([80, 70])
    q = torch.randn(150, kv_heads * group, HEAD_DIM, generator=torch.Generator().manual_seed(7))
    tables = (case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    out, lse = extend_attention(q, qo_indptr, *tables, causal=causal, return_lse=True)
    ref, ref_lse = extend_attention_ref(q, qo_indptr, *tables, causal=causal, return_lse=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


def test_extend_attention_non_causal_and_out():
    case = make_paged_cache(SEQ_LENS, KV_HEADS, HEAD_DIM, 4, "HND")
    qo_indptr = _qo_indptr(Q_LENS["chunk"])
    q = torch.randn(int(qo_indptr[-1]), KV_HEADS * 2, HEAD_DIM)
    tables = (case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    out = torch.full_like(q, float("nan"))
    got = extend_attention(q, qo_indptr, *tables, causal=False, sm_scale=0.2, out=out)
    assert got.data_ptr() == out.data_ptr()
    ref = extend_attention_ref(q, qo_indptr, *tables, causal=False, sm_scale=0.2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    causal = extend_attention_ref(q, qo_indptr, *tables, causal=True, sm_scale=0.2)
    assert not torch.allclose(ref, causal)  # the flag matters


def test_chunked_prefill_equals_one_shot_prefill():
    """Append and attend a 50-token prompt in chunks of 17: same outputs as one pass over the whole prompt."""
    prompt_len, heads = 50, KV_HEADS * 3
    k, v = torch.randn(prompt_len, KV_HEADS, HEAD_DIM), torch.randn(prompt_len, KV_HEADS, HEAD_DIM)
    q = torch.randn(prompt_len, heads, HEAD_DIM)
    whole = make_paged_cache([prompt_len], KV_HEADS, HEAD_DIM, 4, fill=False)
    tables = (whole.kv_indices, whole.kv_indptr, whole.kv_last_page_len)
    batch_indices, positions = append_positions(whole, [prompt_len])
    kv_append(k, v, batch_indices, positions, whole.cache, *tables)
    one_shot = extend_attention(
        q, _qo_indptr([prompt_len]), whole.cache, whole.kv_indptr, whole.kv_indices, whole.kv_last_page_len
    )
    chunks = []
    for start in range(0, prompt_len, 17):
        end = min(start + 17, prompt_len)
        part = make_paged_cache([end], KV_HEADS, HEAD_DIM, 4, fill=False)
        part.cache, part.kv_indices = whole.cache, whole.kv_indices[: part.kv_indices.numel()]
        chunks.append(
            extend_attention(
                q[start:end],
                _qo_indptr([end - start]),
                part.cache,
                part.kv_indptr,
                part.kv_indices,
                part.kv_last_page_len,
            )
        )
    torch.testing.assert_close(torch.cat(chunks), one_shot, atol=1e-5, rtol=1e-5)


def test_extend_attention_rejects_bad_input():
    case = make_paged_cache(SEQ_LENS, KV_HEADS, HEAD_DIM, 4)
    tables = (case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    q = torch.randn(4, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="must fit its cached tokens"):
        extend_attention(q, _qo_indptr([2, 1, 1]), *tables)  # request 0 holds 1 token
    with pytest.raises(ValueError, match="qo_indptr must be"):
        extend_attention(q, _qo_indptr([1, 1, 1]), *tables)
    with pytest.raises(ValueError, match="qo_indptr dtype"):
        extend_attention(q, _qo_indptr([1, 1, 2]).float(), *tables)


@pytest.mark.parametrize("dtype", list(TOL))
def test_reference_paths_agree(dtype):
    """The reference's fused path (SDPA, no LSE) and its explicit fp32 path give the same output."""
    case = make_paged_cache([0, *SEQ_LENS], KV_HEADS, HEAD_DIM, 4, "HND", dtype=dtype)
    qo_indptr = _qo_indptr([0, *Q_LENS["chunk"]])
    q = torch.randn(int(qo_indptr[-1]), KV_HEADS * 3, HEAD_DIM).to(dtype)
    tables = (case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    fused = extend_attention_ref(q, qo_indptr, *tables)
    explicit, _ = extend_attention_ref(q, qo_indptr, *tables, return_lse=True)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(fused, explicit, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_lens, q_lens, group", [([150, 40], [150, 40], 3), ([200, 70], [130, 1], 1)])
@pytest.mark.parametrize("ext", ["c++", "torch"])
def test_the_blocked_bf16_path_is_the_reference_over_several_blocks(
    seq_lens, q_lens, group, dtype, ext, monkeypatch
):
    """blocked_causal_attention (what causal_attention runs in bf16 on CPUs that compute in it): blocks of
    query rows past BLOCK_ROWS, a prompt whole and a chunk after a prefix, GQA, equal to the reference;
    taken through the torch backend wherever native_bf16 says so (forced here, so any CPU checks it), its
    gather and softmax in C++ and, without the extension, in torch."""
    import pdkernels.extend_attention_cpu as ea

    monkeypatch.setenv("PDKERNELS_CPU_EXT", "1" if ext == "c++" else "0")
    monkeypatch.setattr(ea, "native_bf16", lambda: True)
    case = make_paged_cache(seq_lens, KV_HEADS, HEAD_DIM, 16, "HND", dtype=dtype)
    qo_indptr = _qo_indptr(q_lens)
    q = torch.randn(int(qo_indptr[-1]), KV_HEADS * group, HEAD_DIM).to(dtype)
    tables = (case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len, "HND")
    ref = extend_attention_ref(q, qo_indptr, *tables, sm_scale=0.2)
    called = []
    blocked = ea.blocked_causal_attention
    monkeypatch.setattr(ea, "blocked_causal_attention", lambda *a: called.append(1) or blocked(*a))
    atol, rtol = TOL[dtype]
    for amx in (False, True):  # with AMX our AMX kernel where built, else torch's flash kernel
        called.clear()
        monkeypatch.setattr(ea, "amx_bf16", lambda amx=amx: amx)
        got = extend_attention_cpu(q, qo_indptr, *tables, sm_scale=0.2)
        torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
        assert len(called) == (2 if dtype == torch.bfloat16 and not amx else 0)  # fp32 keeps the flash kernel
    assert max(q_lens) > ea.BLOCK_ROWS


AMX_CASES = [
    (1024, 1024, 3),
    (100, 100, 3),
    (37, 200, 1),
    (1, 65, 3),
    (64, 64, 3),
    (65, 130, 9),
    (130, 300, 2),
    (300, 700, 2),
]


@pytest.mark.parametrize("n, L, group", AMX_CASES)
def test_the_amx_attention_is_the_reference(n, L, group):
    """causal_attention_amx (bf16 on AMX CPUs): a whole prompt and chunks after a prefix, blocks of 64 query
    rows and 256 keys whole and cut, GQA groups of 1 to 9, one query row; q a view of a wider qkv row."""
    from pdkernels import cpu

    ext = cpu.module()
    if ext is None or not hasattr(ext, "causal_attention_amx"):
        pytest.skip("no AMX here (oneDNN's bf16 brgemm): torch's flash kernel serves")
    g = torch.Generator().manual_seed(n + L)
    qkv = torch.randn(n, 2 * group + 2, HEAD_DIM, generator=g).to(torch.bfloat16)  # group + 2 kv heads' rows
    q = qkv[:, : 2 * group]  # 2 kv heads, `group` query heads each
    k, v = (torch.randn(2, L, HEAD_DIM, generator=g).to(torch.bfloat16) for _ in range(2))
    keep = torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]
    qh, kh, vh = q.float().transpose(0, 1)[None], k.float()[None], v.float()[None]
    ref = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=keep, scale=0.125, enable_gqa=True)
    ref = ref[0].transpose(0, 1)
    got = ext.causal_attention_amx(q, k, v, 0.125)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError, match="k, v"):
        ext.causal_attention_amx(q, k.float(), v, 0.125)
    with pytest.raises(RuntimeError, match="disagree"):  # more queries than keys
        ext.causal_attention_amx(q, k[:, :0], v[:, :0], 0.1)


def test_the_amx_paged_loop_is_the_reference_and_refuses_wide_tables():
    """extend_attention_amx (each request's pages gathered, then causal_attention_amx: the loop the torch
    backend and the C++ layers share): several requests, one with no new token, against the reference."""
    from pdkernels import cpu

    ext = cpu.module()
    if ext is None or not hasattr(ext, "extend_attention_amx"):
        pytest.skip("no AMX here (oneDNN's bf16 brgemm): torch's flash kernel serves")
    case = make_paged_cache([40, 70, 9], KV_HEADS, HEAD_DIM, 16, "HND", dtype=torch.bfloat16)
    qo_indptr = _qo_indptr([40, 0, 5])
    q = torch.randn(int(qo_indptr[-1]), 3 * KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    tables = (case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    ref = extend_attention_ref(q, qo_indptr, case.cache, *tables, "HND", sm_scale=0.2)
    got = ext.extend_attention_amx(q, case.cache, qo_indptr.int(), *(t.int() for t in tables), 0.2)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError, match="page table: int32"):
        ext.extend_attention_amx(q, case.cache, qo_indptr.long(), *(t.int() for t in tables), 0.2)


def test_the_cpu_extensions_gather_and_softmax_are_the_torch_codes(monkeypatch):
    """What extend_attention_cpu and the blocked bf16 path call in C++: one sequence's K/V gathered from its
    pages (as gather_pages), a page id out of range refused; the causal softmax of a block of scores (as
    the masked torch softmax it replaced), for a block that is a whole prompt (rows = keys) and one row."""
    from pdkernels import cpu
    from pdkernels._paging import gather_pages

    ext = cpu.module()
    if ext is None:
        pytest.skip("the CPU extension is not built here")
    case = make_paged_cache([50], KV_HEADS, HEAD_DIM, 16, "HND", dtype=torch.bfloat16)
    pages = case.kv_indices
    k, v = ext.gather_kv(case.cache, pages, 50)
    assert torch.equal(k, gather_pages(case.cache[:, 0], "HND", pages[None].long())[0, :, :50])
    assert torch.equal(v, gather_pages(case.cache[:, 1], "HND", pages[None].long())[0, :, :50])
    with pytest.raises(RuntimeError, match="page id out of range"):
        ext.gather_kv(case.cache, torch.tensor([0, case.cache.shape[0]], dtype=torch.int32), 20)
    with pytest.raises(RuntimeError, match="seq_len"):
        ext.gather_kv(case.cache, pages, 16 * len(pages) + 1)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, keys in [(40, 40), (1, 70), (28, 100)]:
            scores = (torch.randn(6, rows, keys) * 8).to(dtype)
            want = scores.float() * 0.3
            later = torch.ones(rows, rows, dtype=torch.bool).triu(1)  # keys after each row's position
            want[..., keys - rows :].masked_fill_(later, float("-inf"))
            want = torch.softmax(want, dim=-1).to(dtype)
            atol, rtol = TOL[dtype]
            torch.testing.assert_close(ext.causal_softmax(scores, 0.3), want, atol=atol, rtol=rtol)


def _cpp_extend():
    from pdkernels import cpu

    ext = cpu.module()
    if ext is None or not hasattr(ext, "extend_attention"):
        pytest.skip("the CPU extension's extend attention needs AVX2 + FMA")
    return ext


@pytest.mark.parametrize(
    "kv_heads, group, dim, page_size, dtype",
    [
        (2, 1, 32, 4, torch.float32),
        (3, 3, 64, 16, torch.float32),  # SmolLM2's heads
        (1, 8, 128, 16, torch.float32),
        (2, 5, 64, 7, torch.float32),  # a page size that cuts the 16-key tiles, rows not a multiple of 6
        (3, 3, 64, 16, torch.bfloat16),
        (2, 4, 32, 8, torch.float16),
    ],
)
def test_the_cpp_extend_attention_is_the_reference(kv_heads, group, dim, page_size, dtype):
    """extend_cpu.cpp over its cases: whole prompts and chunks after a cached prefix over several 64-key
    blocks, a one-token request, a request with no new tokens; what extend_attention_cpu returns."""
    ext = _cpp_extend()
    seq_lens, q_lens = [1, 17, 150, 70, 300, 40], [1, 9, 150, 1, 100, 0]
    case = make_paged_cache(seq_lens, kv_heads, dim, page_size, "HND", dtype=dtype)
    qo_indptr = _qo_indptr(q_lens)
    q = torch.randn(int(qo_indptr[-1]), kv_heads * group, dim, generator=torch.Generator().manual_seed(3))
    tables = (case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    ref = extend_attention_ref(q, qo_indptr, case.cache.float(), *tables[1:], sm_scale=0.3)  # fp32 arithmetic
    got = ext.extend_attention(q, case.cache, qo_indptr, *tables[1:], 0.3)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(
        extend_attention_cpu(q, qo_indptr, *tables, sm_scale=0.3), ref, atol=2e-5, rtol=2e-5
    )


def test_the_cpp_extend_attention_gives_the_same_bits_on_any_number_of_threads():
    ext = _cpp_extend()
    case = make_paged_cache([300, 90], 3, 64, 16, "HND")
    qo_indptr = _qo_indptr([300, 20])
    q = torch.randn(320, 9, 64)
    tables = (case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.extend_attention(q, case.cache, qo_indptr, *tables[1:], 0.125)
        torch.set_num_threads(2)
        two = ext.extend_attention(q, case.cache, qo_indptr, *tables[1:], 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_the_cpp_extend_attention_refuses_a_page_table_that_would_read_out_of_bounds():
    """Every index is checked before a page is read: a page id past the cache or negative, a last-page
    length of 0 or past the page, indptrs that run backwards or past the table, more queries than keys."""
    ext = _cpp_extend()
    case = make_paged_cache([20, 30], 2, 32, 8, "HND")
    q = torch.randn(10, 2, 32)
    qo, indptr, indices, last = _qo_indptr([5, 5]), case.kv_indptr, case.kv_indices, case.kv_last_page_len

    def call(qo=qo, indptr=indptr, indices=indices, last=last, q=q):
        return ext.extend_attention(q, case.cache, qo, indptr, indices, last, 0.2)

    call()  # the well-formed table runs
    bad = indices.clone()
    bad[1] = case.cache.shape[0]
    with pytest.raises(RuntimeError, match="page id out of range"):
        call(indices=bad)
    bad[1] = -1
    with pytest.raises(RuntimeError, match="page id out of range"):
        call(indices=bad)
    for length in (0, 9):
        with pytest.raises(RuntimeError, match="kv_last_page_len"):
            call(last=torch.tensor([length, 6], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="kv_indptr"):
        call(indptr=torch.tensor([0, 3, len(indices) + 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="non-decreasing"):
        call(qo=torch.tensor([0, 6, 5], dtype=torch.int32), q=torch.randn(5, 2, 32))
    with pytest.raises(RuntimeError, match="qo_indptr"):
        call(qo=torch.tensor([0, 5, 9], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="more queries than keys"):
        call(qo=torch.tensor([0, 25, 30], dtype=torch.int32), q=torch.randn(30, 2, 32))
    with pytest.raises(RuntimeError, match="D % 32"):
        ext.extend_attention(
            torch.randn(10, 2, 16), case.cache[..., :16].contiguous(), qo, indptr, indices, last, 0.2
        )
