import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.plan import ShardSpec, expected_writes, plan_writes


def _tps(heads: int) -> list[int]:
    """TP degrees that shard or replicate `heads` evenly."""
    return [tp for tp in range(1, 9) if heads % tp == 0 or tp % heads == 0]


@st.composite
def cases(draw):
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    geometry = dict(
        num_kv_heads=heads,
        num_layers=draw(st.integers(1, 3)),
        page_size=draw(st.integers(1, 4)),
        head_dim=draw(st.integers(1, 3)),
        itemsize=draw(st.sampled_from([1, 2])),
    )
    src = ShardSpec(tp=draw(st.sampled_from(_tps(heads))), num_pages=draw(st.integers(1, 6)), **geometry)
    dst = ShardSpec(tp=draw(st.sampled_from(_tps(heads))), num_pages=draw(st.integers(1, 6)), **geometry)
    n = draw(st.integers(0, min(src.num_pages, dst.num_pages)))
    src_pages = draw(st.permutations(range(src.num_pages)))[:n]
    dst_pages = draw(st.permutations(range(dst.num_pages)))[:n]
    return src, dst, src_pages, dst_pages, draw(st.integers(0, 2**16))


def _regions(spec: ShardSpec, truth: np.ndarray, pages: list[int], rng) -> list[np.ndarray]:
    """Each rank's region: its heads of `truth` [layers, n, 2, H, bytes] at `pages`, noise elsewhere."""
    regions = []
    for rank in range(spec.tp):
        region = rng.integers(0, 256, spec.region_bytes, dtype=np.uint8)
        view = region.reshape(spec.num_layers, spec.num_pages, 2, spec.heads_per_rank, -1)
        h0 = spec.first_head(rank)
        view[:, pages] = truth[:, :, :, h0 : h0 + spec.heads_per_rank]
        regions.append(region)
    return regions


@settings(max_examples=300, deadline=None)
@given(cases())
def test_every_destination_byte_is_written_once_with_its_source_byte(case):
    src, dst, src_pages, dst_pages, seed = case
    rng = np.random.default_rng(seed)
    truth = rng.integers(
        0, 256, (src.num_layers, len(src_pages), 2, src.num_kv_heads, src.run_bytes), dtype=np.uint8
    )
    src_regions = _regions(src, truth, src_pages, rng)
    dst_regions = [np.zeros(dst.region_bytes, np.uint8) for _ in range(dst.tp)]
    written = [np.zeros(dst.region_bytes, np.int32) for _ in range(dst.tp)]
    writes = plan_writes(src, dst, src_pages, dst_pages, seed=seed)
    for w in writes:
        dst_regions[w.dst_rank][w.dst_offset : w.dst_offset + w.nbytes] = src_regions[w.src_rank][
            w.src_offset : w.src_offset + w.nbytes
        ]
        written[w.dst_rank][w.dst_offset : w.dst_offset + w.nbytes] += 1
    expected_cover = [np.zeros(dst.region_bytes, np.int32) for _ in range(dst.tp)]
    for rank in range(dst.tp):
        view = dst_regions[rank].reshape(dst.num_layers, dst.num_pages, 2, dst.heads_per_rank, -1)
        h0 = dst.first_head(rank)
        np.testing.assert_array_equal(view[:, dst_pages], truth[:, :, :, h0 : h0 + dst.heads_per_rank])
        expected_cover[rank].reshape(view.shape)[:, dst_pages] = 1
        np.testing.assert_array_equal(written[rank], expected_cover[rank])  # exactly once, nothing else
    assert sum(expected_writes(writes, dst.tp)) == len(writes)


@settings(max_examples=100, deadline=None)
@given(cases(), st.integers(0, 6))
def test_planning_chunk_by_chunk_equals_planning_the_request(case, cut):
    src, dst, src_pages, dst_pages, seed = case
    cut = min(cut, len(src_pages))
    whole = plan_writes(src, dst, src_pages, dst_pages, seed=seed)
    parts = plan_writes(src, dst, src_pages[:cut], dst_pages[:cut], seed=seed) + plan_writes(
        src, dst, src_pages[cut:], dst_pages[cut:], first_page_index=cut, seed=seed
    )
    assert sorted(parts) == sorted(whole)
    assert expected_writes(parts, dst.tp) == expected_writes(whole, dst.tp)


SPEC = dict(num_kv_heads=8, num_layers=2, num_pages=16, page_size=16, head_dim=64, itemsize=2)


def test_same_tp_is_one_write_per_page_and_layer():
    src, dst = ShardSpec(tp=2, **SPEC), ShardSpec(tp=2, **SPEC)
    writes = plan_writes(src, dst, [3, 4, 5], [0, 9, 1])
    assert len(writes) == 2 * 3 * 2  # layers x pages x ranks: K and V merged
    assert all(w.src_rank == w.dst_rank and w.nbytes == 2 * 4 * 16 * 64 * 2 for w in writes)
    assert expected_writes(writes, 2) == [6, 6]


def test_mismatched_tp_cuts_and_rebuilds_pages():
    many, few = ShardSpec(tp=4, **SPEC), ShardSpec(tp=1, **SPEC)
    to_few = plan_writes(many, few, [1], [2], layers=range(1))
    assert sorted({w.src_rank for w in to_few}) == [0, 1, 2, 3] and len(to_few) == 8  # 4 slices x K, V
    to_many = plan_writes(few, many, [1], [2], layers=range(1))
    assert sorted({w.dst_rank for w in to_many}) == [0, 1, 2, 3] and expected_writes(to_many, 4) == [
        2,
        2,
        2,
        2,
    ]


LATENT = dict(SPEC, num_kv_heads=1, head_dim=576, planes=1)  # DeepSeek's latent row: one plane, one head


def test_replicated_sources_all_send():
    """A latent cache on 4 prefill ranks into 2 decode ranks: every source rank sends, and each decode
    rank's page is written once per layer, one plane of one row per token."""
    writes = plan_writes(
        ShardSpec(tp=4, **LATENT), ShardSpec(tp=2, **LATENT), list(range(8)), list(range(8)), seed=3
    )
    assert {w.src_rank for w in writes} == {0, 1, 2, 3}
    assert expected_writes(writes, 2) == [16, 16]
    assert all(w.nbytes == 16 * 576 * 2 for w in writes)
    assert len({(w.dst_rank, w.dst_offset) for w in writes}) == len(writes)


@pytest.mark.parametrize("src_tp, dst_tp", [(2, 1), (4, 2), (1, 2)])
def test_over_100_one_page_requests_every_replica_sends_a_share(src_tp, dst_tp):
    """The replica that sends a request's first page is drawn from the request's seed: over many requests
    the load spreads over every prefill rank (and its NIC), and the same seeds give the same choice."""
    src, dst = ShardSpec(tp=src_tp, **LATENT), ShardSpec(tp=dst_tp, **LATENT)
    senders = [[w.src_rank for w in plan_writes(src, dst, [0], [0], seed=s)] for s in range(100)]
    assert senders == [[w.src_rank for w in plan_writes(src, dst, [0], [0], seed=s)] for s in range(100)]
    counts = np.bincount(np.concatenate(senders), minlength=src_tp)
    assert counts.min() >= 0.6 * counts.sum() / src_tp, counts


@pytest.mark.parametrize(
    "src, dst, message",
    [
        (dict(kv_layout="NHD"), dict(kv_layout="NHD"), "needs kv_layout 'HND'"),
        (dict(kv_layout="NHD"), {}, "disagree on kv_layout: 'NHD' \\(prefill\\) vs 'HND' \\(decode\\)"),
        ({}, dict(weights="ab" * 8), "disagree on weights: '' \\(prefill\\) vs 'abababababababab'"),
        ({}, dict(page_size=8), "disagree on page_size"),
        ({}, dict(itemsize=4, dtype="float32"), "disagree on itemsize"),
        ({}, dict(head_dim=128), "disagree on head_dim"),
        (dict(tp=3), {}, "tp=3 must divide num_kv_heads=8"),
    ],
)
def test_rejects_what_it_cannot_do(src, dst, message):
    with pytest.raises(ValueError, match=message):
        plan_writes(ShardSpec(**{"tp": 2, **SPEC, **src}), ShardSpec(**{"tp": 2, **SPEC, **dst}), [0], [0])


def test_rejects_bad_page_lists():
    spec = ShardSpec(tp=1, **SPEC)
    with pytest.raises(ValueError, match="2 source pages for 1 destination"):
        plan_writes(spec, spec, [0, 1], [0])
    with pytest.raises(ValueError, match="outside"):
        plan_writes(spec, spec, [16], [0])
