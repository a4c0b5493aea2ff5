from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.decode import relayout
from transfer.plan import ShardSpec, check_compatible, expected_writes, plan_writes


def _tps(heads: int) -> list[int]:
    """TP degrees that shard or replicate `heads` evenly."""
    return [tp for tp in range(1, 9) if heads % tp == 0 or tp % heads == 0]


LAYOUTS = [("HND", "HND"), ("HND", "NHD"), ("NHD", "HND"), ("NHD", "NHD")]


@st.composite
def cases(draw):
    """Two specs (page sizes equal, or one a multiple of the other; either layout, an NHD source only
    where each decode rank holds one source rank's heads), a request of n tokens and its page lists on
    each side."""
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    geometry = dict(
        num_kv_heads=heads,
        num_layers=draw(st.integers(1, 3)),
        head_dim=draw(st.integers(1, 3)),
        itemsize=draw(st.sampled_from([1, 2])),
    )
    unit = draw(st.integers(1, 4))
    sizes = draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (1, 4), (4, 1), (3, 3)]))
    if sizes[0] == sizes[1]:  # scaled pages (e4m3's) move only between equal page sizes
        geometry["scale_bytes"] = draw(st.sampled_from([0, 4]))
    layouts = draw(st.sampled_from(LAYOUTS))
    src, dst = (
        ShardSpec(
            tp=draw(st.sampled_from(_tps(heads))),
            num_pages=draw(st.integers(1, 6)),
            page_size=unit * size,
            kv_layout=layout,
            **geometry,
        )
        for size, layout in zip(sizes, layouts, strict=True)
    )
    try:
        check_compatible(src, dst)
    except ValueError:  # an NHD source whose ranks' heads are not a decode rank's (kv heads replicated or
        src = replace(src, tp=dst.tp)  # one, the degrees may differ): at the decode side's degree
    n = draw(st.integers(0, min(src.num_pages * src.page_size, dst.num_pages * dst.page_size)))
    src_pages = draw(st.permutations(range(src.num_pages)))[: -(-n // src.page_size)]
    dst_pages = draw(st.permutations(range(dst.num_pages)))[: -(-n // dst.page_size)]
    return src, dst, src_pages, dst_pages, draw(st.integers(0, 2**16))


def _view(spec: ShardSpec, region, layout: str):
    """A rank's pages as [layers, pages, 2, H_rank, P, row] (HND) or [layers, pages, 2, P, H_rank, row]."""
    a, b = (spec.heads_per_rank, spec.page_size) if layout == "HND" else (spec.page_size, spec.heads_per_rank)
    return region[: spec.kv_bytes].reshape(spec.num_layers, spec.num_pages, 2, a, b, -1)


def _scales(spec: ShardSpec, region):
    """A rank's scales (what follows its pages) as [layers, pages, 2, H_rank, scale_bytes]."""
    return region[spec.kv_bytes :].reshape(spec.num_layers, spec.num_pages, 2, spec.heads_per_rank, -1)


def _paged(spec: ShardSpec, tokens: np.ndarray, pages: list[int], rank: int, layout: str) -> np.ndarray:
    """Rank's heads of tokens [layers, n, 2, H, row] in len(pages) pages of spec's size, laid out as
    _view has them (the last page's tail zero)."""
    layers, n, planes, heads, row = tokens.shape
    padded = np.zeros((layers, len(pages) * spec.page_size, planes, heads, row), np.uint8)
    padded[:, :n] = tokens
    h0 = spec.first_head(rank)
    mine = padded[:, :, :, h0 : h0 + spec.heads_per_rank]
    mine = mine.reshape(layers, len(pages), spec.page_size, planes, spec.heads_per_rank, row)
    return mine.transpose(0, 1, 3, 4, 2, 5) if layout == "HND" else mine.transpose(0, 1, 3, 2, 4, 5)


def _regions(
    spec: ShardSpec, truth: np.ndarray, scales: np.ndarray, pages: list[int], rng
) -> list[np.ndarray]:
    """Each rank's region: its heads of `truth` (tokens, see _paged) at `pages` and of `scales` ([layers,
    pages, 2, H, scale_bytes], where the spec has them) at theirs, noise elsewhere."""
    regions = []
    for rank in range(spec.tp):
        region = rng.integers(0, 256, spec.region_bytes, dtype=np.uint8)
        _view(spec, region, spec.kv_layout)[:, pages] = _paged(spec, truth, pages, rank, spec.kv_layout)
        h0 = spec.first_head(rank)
        _scales(spec, region)[:, pages] = scales[:, :, :, h0 : h0 + spec.heads_per_rank]
        regions.append(region)
    return regions


def _apply(src, dst, writes, src_regions):
    dst_regions = [np.zeros(dst.region_bytes, np.uint8) for _ in range(dst.tp)]
    written = [np.zeros(dst.region_bytes, np.int32) for _ in range(dst.tp)]
    for w in writes:
        dst_regions[w.dst_rank][w.dst_offset : w.dst_offset + w.nbytes] = src_regions[w.src_rank][
            w.src_offset : w.src_offset + w.nbytes
        ]
        written[w.dst_rank][w.dst_offset : w.dst_offset + w.nbytes] += 1
    return dst_regions, written


@settings(max_examples=400, deadline=None)
@given(cases())
def test_every_destination_byte_is_written_once_with_its_source_byte(case):
    """Every token's K and V, head by head, lands where the destination's page size and ranks put it, in
    the source's layout: each byte of the tokens both sides' pages hold written exactly once, and nothing
    else; the decode side's relayout then puts it where its own layout reads it."""
    src, dst, src_pages, dst_pages, seed = case
    rng = np.random.default_rng(seed)
    n = min(len(src_pages) * src.page_size, len(dst_pages) * dst.page_size)
    row = src.head_dim * src.itemsize
    truth = rng.integers(0, 256, (src.num_layers, n, 2, src.num_kv_heads, row), dtype=np.uint8)
    scale_shape = (src.num_layers, len(src_pages), 2, src.num_kv_heads, src.scale_bytes)
    scales = rng.integers(0, 256, scale_shape, dtype=np.uint8)  # one page size: src page i is dst page i
    writes = plan_writes(src, dst, src_pages, dst_pages, seed=seed)
    dst_regions, written = _apply(src, dst, writes, _regions(src, truth, scales, src_pages, rng))
    wire, ones = src.kv_layout, np.ones_like(truth)
    for rank in range(dst.tp):
        got = _view(dst, dst_regions[rank], wire)
        np.testing.assert_array_equal(got[:, dst_pages], _paged(dst, truth, dst_pages, rank, wire))
        if dst.scale_bytes:  # then the page sizes match: as many pages on each side
            h0 = dst.first_head(rank)
            mine = scales[:, :, :, h0 : h0 + dst.heads_per_rank]
            np.testing.assert_array_equal(_scales(dst, dst_regions[rank])[:, dst_pages], mine)
        cover = np.zeros_like(got, dtype=np.int32)
        cover[:, dst_pages] = _paged(dst, ones, dst_pages, rank, wire)
        scale_cover = np.zeros_like(_scales(dst, dst_regions[rank]), dtype=np.int32)
        scale_cover[:, dst_pages] = 1
        expected = np.concatenate([cover.reshape(-1), scale_cover.reshape(-1)])
        np.testing.assert_array_equal(written[rank], expected)  # exactly once, nothing else
        if wire != dst.kv_layout:
            relayout([torch.from_numpy(_view(dst, dst_regions[rank], dst.kv_layout))], dst_pages)
        own = _view(dst, dst_regions[rank], dst.kv_layout)
        np.testing.assert_array_equal(own[:, dst_pages], _paged(dst, truth, dst_pages, rank, dst.kv_layout))
    assert sum(expected_writes(writes, dst.tp)) == len(writes)


@settings(max_examples=100, deadline=None)
@given(cases(), st.integers(0, 24))
def test_planning_in_spans_equals_planning_the_request(case, cut):
    src, dst, src_pages, dst_pages, seed = case
    unit = min(src.page_size, dst.page_size)
    cut = min(cut * unit, len(src_pages) * src.page_size, len(dst_pages) * dst.page_size)
    whole = plan_writes(src, dst, src_pages, dst_pages, seed=seed)
    parts = plan_writes(src, dst, src_pages, dst_pages, end=cut, seed=seed) + plan_writes(
        src, dst, src_pages, dst_pages, start=cut, seed=seed
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
        (dict(kv_layout="NHD", tp=4), {}, "an NHD prefill side sends whole pages of its ranks' heads"),
        (dict(kv_layout="NHD"), dict(tp=1), "prefill tp=2, decode tp=1, 8 kv heads"),
        ({}, dict(weights="ab" * 8), "disagree on weights: '' \\(prefill\\) vs 'abababababababab'"),
        ({}, dict(page_size=24), "prefill page_size 16 and decode page_size 24: one must divide the other"),
        ({}, dict(itemsize=4, dtype="float32"), "disagree on dtype: 'bfloat16' \\(prefill\\) vs 'float32'"),
        ({}, dict(itemsize=4), "disagree on itemsize"),
        (dict(scale_bytes=4), {}, "disagree on scale_bytes"),
        (
            dict(scale_bytes=4),
            dict(scale_bytes=4, page_size=64),
            "with scaled .* both sides must use one page",
        ),
        ({}, dict(head_dim=128), "disagree on head_dim"),
        (dict(tp=3), {}, "tp=3 must divide num_kv_heads=8"),
    ],
)
def test_rejects_what_it_cannot_do(src, dst, message):
    with pytest.raises(ValueError, match=message):
        plan_writes(ShardSpec(**{"tp": 2, **SPEC, **src}), ShardSpec(**{"tp": 2, **SPEC, **dst}), [0], [0])


def test_rejects_bad_page_lists():
    spec = ShardSpec(tp=1, **SPEC)
    with pytest.raises(ValueError, match="start must be a multiple of 16 tokens"):
        plan_writes(spec, spec, [0, 1], [0, 1], start=8)
    with pytest.raises(ValueError, match="outside"):
        plan_writes(spec, spec, [16], [0])
    assert plan_writes(spec, spec, [0, 1], [0]) == plan_writes(spec, spec, [0], [0])  # what both hold


def test_small_pages_into_large_ones_move_a_write_per_head_and_plane_each():
    """16-token prefill pages into 64-token decode pages, 8 heads on 2 ranks each side: each source page
    is a quarter of one head's run on the decode side, a write of its own per head and plane."""
    small, large = ShardSpec(tp=2, **SPEC), ShardSpec(tp=2, **dict(SPEC, page_size=64, num_pages=4))
    writes = plan_writes(small, large, [3, 4, 5, 6, 7], [2, 0], layers=range(1))
    assert len(writes) == 5 * 2 * 4 * 2  # pages x ranks x heads x planes
    assert all(w.nbytes == 16 * 64 * 2 for w in writes)
    # the fifth source page is the first quarter of the second decode page: rank 0's head 0's K there
    fifth = [w for w in writes if w.src_offset // small.run_bytes // 8 == 7]
    assert {w.dst_offset // large.run_bytes // 8 for w in fifth} == {0}
    assert min(w.dst_offset for w in fifth if w.dst_rank == 0) == 0
    back = plan_writes(large, small, [2, 0], [3, 4, 5, 6, 7], layers=range(1))
    assert sorted((w.nbytes, w.dst_rank) for w in back) == sorted((w.nbytes, w.dst_rank) for w in writes)
