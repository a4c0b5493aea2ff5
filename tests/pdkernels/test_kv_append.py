import pytest
import torch

from pdkernels._paging import batch_indices_positions
from pdkernels.kv_append import (
    kv_append,
    kv_append_mla,
    kv_append_mla_ref,
    kv_append_ref,
    kv_append_slots,
    kv_append_slots_ref,
)
from pdkernels.testing import append_positions, make_paged_cache

SEQ_LENS = [1, 17, 50]
# appended tokens per request: a whole prefill, a chunk after a prefix, one decode token
APPEND_LENS = {"prefill": [1, 17, 50], "chunk": [1, 9, 20], "decode": [1, 1, 1]}


def _rows(n, heads, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, dim, generator=g).to(dtype), torch.randn(n, heads, dim, generator=g).to(
        dtype
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
@pytest.mark.parametrize("mode", sorted(APPEND_LENS))
def test_kv_append_matches_ref(mode, kv_layout, page_size, dtype):
    case = make_paged_cache(
        SEQ_LENS, num_heads=4, head_dim=16, page_size=page_size, kv_layout=kv_layout, dtype=dtype
    )
    batch_indices, positions = append_positions(case, APPEND_LENS[mode])
    k, v = _rows(positions.numel(), 4, 16, dtype, seed=1)
    expected, got = case.cache.clone(), case.cache.clone()
    tables = (case.kv_indices, case.kv_indptr, case.kv_last_page_len)
    kv_append_ref(k, v, batch_indices, positions, expected, *tables, kv_layout)
    kv_append(k, v, batch_indices, positions, got, *tables, kv_layout)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert not torch.equal(expected, case.cache)  # the append did write


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", sorted(APPEND_LENS))
def test_the_cpu_path_equals_the_reference(mode, dtype):
    """The torch backend's kv_append (C++ row copies where built) against the reference, rows sliced out
    of a fused qkv tensor as the engine passes them."""
    from pdkernels import cpu
    from pdkernels.kv_append_cpu import kv_append_cpu

    if cpu.module() is None:
        pytest.skip("pdkernels' CPU extension could not be built here (no C++ compiler)")
    case = make_paged_cache(SEQ_LENS, num_heads=2, head_dim=16, page_size=4, kv_layout="HND", dtype=dtype)
    batch_indices, positions = append_positions(case, APPEND_LENS[mode])
    qkv = torch.randn(positions.numel(), 8, 16).to(dtype)
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    expected, got = case.cache.clone(), case.cache.clone()
    tables = (case.kv_indices, case.kv_indptr, case.kv_last_page_len)
    kv_append_ref(k, v, batch_indices, positions, expected, *tables, "HND")
    kv_append_cpu(k, v, batch_indices, positions, got, *tables, "HND")
    assert torch.equal(got, expected) and not torch.equal(expected, case.cache)


def test_kv_append_pair_and_strided_rows():
    """A (k_cache, v_cache) pair, and K/V rows sliced out of a fused qkv tensor (strided tokens)."""
    case = make_paged_cache(SEQ_LENS, num_heads=2, head_dim=64, page_size=16, kv_layout="HND")
    batch_indices, positions = append_positions(case, APPEND_LENS["chunk"])
    qkv = torch.randn(positions.numel(), 8, 64)  # [T, q(4) + k(2) + v(2) heads, D]
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    k_cache, v_cache = case.cache[:, 0].clone(), case.cache[:, 1].clone()
    expected = case.cache.clone()
    tables = (case.kv_indices, case.kv_indptr, case.kv_last_page_len)
    kv_append_ref(k, v, batch_indices, positions, expected, *tables, "HND")
    kv_append(k, v, batch_indices, positions, (k_cache, v_cache), *tables, "HND")
    torch.testing.assert_close(torch.stack([k_cache, v_cache], 1), expected, atol=0, rtol=0)


@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
def test_kv_append_rows_split_across_programs(kv_layout):
    """SmolLM2's 3 x 64 heads: a program copies 64 (token, head) rows, so a token's heads straddle two
    programs and the last program is partial; strided rows out of a fused qkv tensor."""
    case = make_paged_cache(SEQ_LENS, num_heads=3, head_dim=64, page_size=16, kv_layout=kv_layout)
    batch_indices, positions = append_positions(case, APPEND_LENS["prefill"])
    qkv = torch.randn(positions.numel(), 15, 64, generator=torch.Generator().manual_seed(4))
    k, v = qkv[:, 9:12], qkv[:, 12:15]
    expected, got = case.cache.clone(), case.cache.clone()
    tables = (case.kv_indices, case.kv_indptr, case.kv_last_page_len)
    kv_append_ref(k, v, batch_indices, positions, expected, *tables, kv_layout)
    kv_append(k, v, batch_indices, positions, got, *tables, kv_layout)
    assert torch.equal(got, expected) and not torch.equal(expected, case.cache)


@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_kv_append_slots_matches_ref(kv_layout, page_size):
    case = make_paged_cache(
        [50], num_heads=4, head_dim=32, page_size=page_size, kv_layout=kv_layout, fill=False
    )
    num_slots = case.cache.shape[0] * page_size
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(3))[:17]
    slots[[2, 9]] = -1  # padded tokens are skipped
    k, v = _rows(17, 4, 32, torch.float16, seed=2)
    expected, got = case.cache.clone().half(), case.cache.clone().half()
    kv_append_slots_ref(k, v, expected, slots, kv_layout)
    kv_append_slots(k, v, got, slots, kv_layout)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert int((got != 0).any(-1).sum()) == 2 * 15 * 4  # 15 tokens x K/V x heads written, nothing else


@pytest.mark.parametrize("page_size", [4, 16])
def test_kv_append_mla_matches_ref(page_size):
    """Latent cache [pages, P, 576]: the compressed KV (512) and rope part (64) as views of one tensor."""
    case = make_paged_cache(SEQ_LENS, num_heads=1, head_dim=1, page_size=page_size)
    batch_indices, positions = append_positions(case, APPEND_LENS["chunk"])
    latent = torch.randn(case.cache.shape[0], page_size, 576).to(torch.bfloat16)
    expected, got = latent.clone(), latent.clone()
    ckv, kpe = torch.randn(positions.numel(), 512).bfloat16(), torch.randn(positions.numel(), 64).bfloat16()
    tables = (case.kv_indices, case.kv_indptr, case.kv_last_page_len)
    kv_append_mla_ref(ckv, kpe, batch_indices, positions, expected[..., :512], expected[..., 512:], *tables)
    kv_append_mla(ckv, kpe, batch_indices, positions, got[..., :512], got[..., 512:], *tables)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert not torch.equal(expected, latent)


def test_batch_indices_positions_by_hand():
    batch_indices, positions = batch_indices_positions(torch.tensor([0, 1, 3, 3]), torch.tensor([5, 2, 7]))
    assert batch_indices.tolist() == [0, 1, 1]
    assert positions.tolist() == [4, 0, 1]


def _bad_case():
    case = make_paged_cache(SEQ_LENS, num_heads=2, head_dim=16, page_size=4)
    batch_indices, positions = append_positions(case, [1, 2, 3])
    k, v = _rows(6, 2, 16, torch.float32, seed=0)
    return case, dict(
        append_key=k,
        append_value=v,
        batch_indices=batch_indices,
        positions=positions,
        paged_kv_cache=case.cache,
        kv_indices=case.kv_indices,
        kv_indptr=case.kv_indptr,
        kv_last_page_len=case.kv_last_page_len,
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c, a: a.update(kv_layout="HDN"), "kv_layout must be one of"),
        (lambda c, a: a.update(append_value=a["append_value"][:, :1]), "must match"),
        (
            lambda c, a: a.update(
                append_key=a["append_key"][..., :8], append_value=a["append_value"][..., :8]
            ),
            "cache holds",
        ),
        (
            lambda c, a: a.update(append_key=a["append_key"].transpose(0, 2).contiguous().transpose(0, 2)),
            "contiguous in its last dim",
        ),
        (
            lambda c, a: a.update(append_key=a["append_key"].half(), append_value=a["append_value"].half()),
            "must equal the cache dtype",
        ),
        (lambda c, a: a["kv_indices"].__setitem__(0, 999), "kv_indices hold page ids"),
        (lambda c, a: a["positions"].__setitem__(-1, 50), "outside its page table"),
        (lambda c, a: a["batch_indices"].__setitem__(0, 3), "batch_indices must lie in"),
        (lambda c, a: a.update(positions=a["positions"].float()), "positions dtype"),
        (lambda c, a: a["kv_last_page_len"].__setitem__(1, 5), "kv_last_page_len must lie in"),
        (lambda c, a: a.update(positions=a["positions"][:-1]), "one entry per appended token"),
    ],
)
def test_kv_append_rejects_bad_input(change, message):
    case, args = _bad_case()
    change(case, args)
    with pytest.raises(ValueError, match=message):
        kv_append(**args)


def test_kv_append_slots_rejects_out_of_range():
    case = make_paged_cache([8], num_heads=2, head_dim=16, page_size=4)
    k, v = _rows(2, 2, 16, torch.float32, seed=0)
    capacity = case.cache.shape[0] * 4
    with pytest.raises(ValueError, match="slots hold"):
        kv_append_slots(k, v, case.cache, torch.tensor([0, capacity]))
    with pytest.raises(ValueError, match="slots hold"):
        kv_append_slots(k, v, case.cache, torch.tensor([-2, 0]))
    with pytest.raises(ValueError, match="paged_kv_cache must be"):
        kv_append_slots(k, v, case.cache[:, :1], torch.tensor([0, 1]))
