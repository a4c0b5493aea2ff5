import pytest
import torch

from pdkernels.decode_attention import decode_attention, decode_attention_ref
from pdkernels.testing import all_pairs, make_paged_cache

# (dtype, atol, rtol): the kernel rounds probabilities to the cache dtype before P @ V
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
SEQ_LENS = [1, 17, 50]
KV_HEADS, HEAD_DIM = 2, 32


def _case(page_size, kv_layout, dtype, group, seq_lens=SEQ_LENS, seed=0):
    case = make_paged_cache(seq_lens, KV_HEADS, HEAD_DIM, page_size, kv_layout, dtype=dtype, seed=seed)
    q = torch.randn(
        len(seq_lens), KV_HEADS * group, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1)
    )
    return case, q.to(dtype)


def _tables(case):
    return case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len, case.kv_layout


@pytest.mark.parametrize(  # every pair of factor values (7 cases, not the 24 of the whole product)
    "page_size,kv_layout,group,dtype", all_pairs([4, 16], ["HND", "NHD"], [1, 4], list(TOL))
)
def test_decode_attention_matches_ref(page_size, kv_layout, group, dtype):
    case, q = _case(page_size, kv_layout, dtype, group)
    out, lse = decode_attention(q, *_tables(case), return_lse=True, num_splits=3)
    ref_out, ref_lse = decode_attention_ref(q, *_tables(case), return_lse=True)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 2, 7, None])
def test_decode_attention_split_counts(num_splits):
    """More splits than blocks leaves empty splits; the merge must ignore them."""
    case, q = _case(4, "HND", torch.float32, 4)
    out = decode_attention(q, *_tables(case), num_splits=num_splits)
    torch.testing.assert_close(out, decode_attention_ref(q, *_tables(case)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("max_seq_len", [None, 700])
def test_a_long_sequence_among_short_ones_gets_its_own_splits(max_seq_len):
    """The default plan splits by tokens: the 700-token sequence takes several splits, the short ones one,
    and the splits past each sequence's end are never read by the merge (they write nothing)."""
    from pdkernels.splits import MIN_SPLIT_TOKENS, split_plan

    lens = [1, 700, 5, 0]
    grid, split_len = split_plan(sum(lens), max_seq_len, KV_HEADS, 64, torch.device("cpu"))
    assert split_len == MIN_SPLIT_TOKENS and grid == 3  # 700 tokens: three splits of 256
    case, q = _case(16, "HND", torch.float32, 4, seq_lens=lens)
    out, lse = decode_attention(q, *_tables(case), return_lse=True, max_seq_len=max_seq_len)
    ref, ref_lse = decode_attention_ref(q, *_tables(case), return_lse=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:3], ref_lse[:3], atol=1e-4, rtol=1e-4)


def test_decode_attention_out_scale_and_empty_sequence():
    case, q = _case(16, "HND", torch.float16, 3, seq_lens=[0, 33, 5])
    out = torch.full_like(q, float("nan"))
    got, lse = decode_attention(q, *_tables(case), sm_scale=0.3, out=out, return_lse=True)
    ref, ref_lse = decode_attention_ref(q, *_tables(case), sm_scale=0.3, return_lse=True)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool(torch.isneginf(lse[0]).all())
    torch.testing.assert_close(lse[1:], ref_lse[1:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, a: (q[:, :3], a), "must be a multiple of the cache's kv heads"),
        (lambda q, a: (q[..., :16], a), "head_dim"),
        (lambda q, a: (q.half(), a), "must equal the cache dtype"),
        (lambda q, a: (q[:2], a), "sequences"),
        (lambda q, a: (q, {**a, "kv_layout": "hnd"}), "kv_layout must be one of"),
        (lambda q, a: (q, {**a, "kv_indices": a["kv_indices"] + 100}), "kv_indices hold page ids"),
        (lambda q, a: (q, {**a, "kv_indptr": a["kv_indptr"].flip(0)}), "kv_indptr"),
        (lambda q, a: (q.transpose(0, 2).contiguous().transpose(0, 2), a), "contiguous in its last dim"),
    ],
)
def test_decode_attention_rejects_bad_input(change, message):
    case, q = _case(4, "HND", torch.float32, 2)
    args = dict(
        paged_kv_cache=case.cache,
        kv_indptr=case.kv_indptr,
        kv_indices=case.kv_indices,
        kv_last_page_len=case.kv_last_page_len,
        kv_layout="HND",
    )
    q, args = change(q, args)
    with pytest.raises(ValueError, match=message):
        decode_attention(q, **args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("seq_lens", [[50], [64], [1, 17, 50], [16, 0, 33]], ids=str)
@pytest.mark.parametrize("hint", [False, True])
@pytest.mark.parametrize("ext", ["c++", "torch"])
def test_the_cpu_path_is_the_reference_in_fewer_passes(
    seq_lens, page_size, group, dtype, hint, ext, monkeypatch
):
    """pdkernels.ops' CPU decode attention against the reference, in C++ over the pages in place and in
    torch (one gather of whole pages, fp32): one sequence whose last page is full or not, several, an
    empty one (zeros), with and without the host's max_seq_len hint."""
    from pdkernels import cpu
    from pdkernels.decode_attention_cpu import decode_attention_cpu

    monkeypatch.setenv("PDKERNELS_CPU_EXT", "1" if ext == "c++" else "0")
    if ext == "c++" and cpu.module() is None:
        pytest.skip("pdkernels' CPU extension could not be built here (no C++ compiler)")

    case, q = _case(page_size, "HND", dtype, group, seq_lens=seq_lens)
    table = case.kv_indptr, case.kv_indices, case.kv_last_page_len
    out = decode_attention_cpu(q, case.cache, *table, max_seq_len=max(seq_lens) if hint else None)
    ref = decode_attention_ref(q, case.cache, *table)
    assert out.dtype == dtype and out.shape == ref.shape
    strided = torch.cat([q, q], dim=-1)[..., : q.shape[-1]]  # q as the engine has it: a view of qkv
    assert torch.equal(
        decode_attention_cpu(strided, case.cache, *table), decode_attention_cpu(q, case.cache, *table)
    )
    torch.testing.assert_close(
        out.float(), ref.float(), atol=1e-5 if dtype == torch.float32 else 8e-3, rtol=0
    )


def test_a_live_split_length_gives_the_eager_plan_whatever_the_grid():
    """A CUDA graph sized for a long context launches the grid its longest sequence could need and reads
    the step's split length from a device buffer (live_split_len): the outputs are the eager launch's,
    bit for bit, and a short sequence gets more splits than the buffers' size would have planned."""
    from pdkernels.splits import cap_splits, live_split_len, split_plan

    lens = [1, 40, 300, 700]
    case, q = _case(16, "HND", torch.float32, 2, seq_lens=lens, seed=5)
    eager = decode_attention(q, *_tables(case), max_seq_len=max(lens))
    total = case.kv_indices.numel() * 16
    live = torch.tensor([live_split_len(total, max(lens), KV_HEADS, q.device)], dtype=torch.int32)
    got = decode_attention(q, *_tables(case), split_len=live, num_splits=cap_splits(131072))
    assert torch.equal(got, eager)
    torch.testing.assert_close(got, decode_attention_ref(q, *_tables(case)), atol=1e-5, rtol=1e-5)
    # what the graph used to plan from its buffers (bucket 8 x a 128k context): one split for 700 tokens
    _, sized = split_plan(8 * 131072, 131072, KV_HEADS, 64, q.device)
    assert -(-700 // int(live)) > -(-700 // sized) == 1
    with pytest.raises(ValueError, match="split_len .* needs num_splits"):
        decode_attention(q, *_tables(case), split_len=live)


@pytest.mark.parametrize("dtype", list(TOL))
def test_one_split_writes_the_output_itself_and_no_merge_runs(dtype, monkeypatch):
    """A grid of one split (short contexts, or num_splits=1): each program stores the output in q's dtype
    and the natural-log LSE itself, the merge kernel never launches, and the result is the reference's."""
    import pdkernels.decode_attention as da

    monkeypatch.setattr(da, "merge_splits", lambda *a, **k: pytest.fail("the merge ran for one split"))
    case, q = _case(4, "NHD", dtype, 4, seq_lens=[9, 0, 40])
    out, lse = decode_attention(q, *_tables(case), return_lse=True, num_splits=1)
    ref, ref_lse = decode_attention_ref(q, *_tables(case), return_lse=True)
    atol, rtol = TOL[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse[[0, 2]], ref_lse[[0, 2]], atol=1e-4, rtol=1e-4)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool(torch.isneginf(lse[1]).all())
    assert torch.equal(decode_attention(q, *_tables(case)), out)  # the default plan: one split here too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [40, 64, 96, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5])
def test_the_cpu_vector_paths_at_the_models_head_widths(head_dim, dtype, group):
    """The C++ vector paths (16 tokens' scores a step: AVX-512 BF16 for bf16 caches, AVX2 + FMA for fp32
    and bf16, a whole step's K rows read once for up to three query heads; unrolled for head widths 64 and
    128; a width not a multiple of 32 takes the portable loop): pages of 32 tokens (two steps each),
    lengths that end mid-step and within the first 8 of a step, groups of 1-5 query heads a kv head (in
    threes, then a pair or one), against the reference."""
    from pdkernels import cpu
    from pdkernels.decode_attention_cpu import decode_attention_cpu

    if cpu.module() is None:
        pytest.skip("pdkernels' CPU extension could not be built here (no C++ compiler)")
    lens = [1, 8, 9, 15, 16, 47, 200]
    case = make_paged_cache(lens, 2, head_dim, 32, "HND", dtype=dtype, seed=3)
    q = (torch.randn(len(lens), 2 * group, head_dim, generator=torch.Generator().manual_seed(4)) * 3).to(
        dtype
    )
    table = case.kv_indptr, case.kv_indices, case.kv_last_page_len
    got = decode_attention_cpu(q, case.cache, *table)
    torch.testing.assert_close(
        got.float(),
        decode_attention_ref(q, case.cache, *table).float(),
        atol=2e-5 if dtype == torch.float32 else 8e-3,
        rtol=0,
    )
