"""A prefill worker and a decode worker of different page sizes (transfer/plan.py's units) or layouts (HND,
NHD): the KV lands where the decode side's pages put it, in its layout once landed, a conversation's later
turns skip what the decode side's prefix cache holds (a page of its own in part, where its pages are the
smaller), and the tokens are the ones equal settings give."""

import pytest
import torch

from engine import LLM
from engine.disagg import shard_spec
from pdkernels import kv_quant
from tests.transfer.messengers import GREEDY, _close, _local_pair, _run
from transfer.plan import plan_array

PAGES = 64


@pytest.mark.parametrize(
    "model, prefill_tp, prefill_page, decode_page, layouts",
    [
        ("tiny-random", 1, 16, 64, "HND"),
        ("tiny-random", 1, 64, 16, "HND"),
        ("tiny-random", 2, 16, 64, "HND"),  # and TP 2 -> 1 beside
        ("tiny-random-deepseek", 1, 16, 64, "HND"),  # the MLA latent cache: one plane, one head
        ("tiny-random", 1, 16, 16, "HND NHD"),
        ("tiny-random", 1, 16, 16, "NHD HND"),
        ("tiny-random", 2, 64, 16, "HND NHD"),  # all three: TP 2 -> 1, 64 -> 16, HND -> NHD
    ],
)
def test_a_conversation_across_page_sizes_and_layouts_gives_the_equal_settings_tokens(
    request, model, prefill_tp, prefill_page, decode_page, layouts
):
    prefill_layout, decode_layout = (layouts.split() * 2)[:2]
    chunks = 40  # prefill chunks that end inside pages of either size
    prefill = LLM(model, tp=prefill_tp, role="prefill", page_size=prefill_page, num_pages=PAGES,
                  max_num_batched_tokens=chunks, kv_layout=prefill_layout)  # fmt: skip
    decode = LLM(model, role="decode", page_size=decode_page, num_pages=PAGES, kv_layout=decode_layout)
    reference = LLM(model, page_size=decode_page, num_pages=PAGES, enable_prefix_caching=False)
    pm, dm = _local_pair(prefill, decode, request.node.name)
    requests = []
    send = dm.peers["prefill-0"].channel.send
    dm.peers["prefill-0"].channel.send = lambda msg, **kw: (requests.append(msg), send(msg, **kw))[1]
    try:
        prompt = list(range(100, 237))  # 136 tokens to send: two pages and a part of 64, 8.5 of 16
        for turn in range(3):
            rid = f"turn{turn}"
            assert dm.submit(rid, prompt, GREEDY)
            _run(prefill, decode, pm, dm, [rid])
            out, req = decode.output(rid), requests[-1]
            assert out.token_ids == reference.generate([prompt], GREEDY)[0].token_ids, turn
            assert req.skip_pages * decode_page == out.num_cached_tokens
            src, dst = shard_spec(prefill), shard_spec(decode)
            theirs, ours = list(range(-(-(len(prompt) - 1) // prefill_page))), req.dst_pages
            plan = plan_array(src, dst, theirs, ours, start=out.num_cached_tokens)
            assert dm.timings[rid].writes == len(plan) + 1  # every write landed and was counted
            prompt = prompt + out.token_ids + list(range(300 + 40 * turn, 340 + 40 * turn))
        cached = [decode.output(f"turn{t}").num_cached_tokens for t in range(3)]
        assert cached[0] == 0 and all(c > 0 and c % decode_page == 0 for c in cached[1:]), cached
        assert not dm.dropped and not pm.transfers
        assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES
    finally:
        _close(pm, dm)
        prefill.close()  # its TP ranks: the next TP engine in this process makes a group of its own


def test_page_sizes_where_neither_divides_the_other_are_refused_at_connect(request):
    prefill = LLM("tiny-random", role="prefill", page_size=16, num_pages=PAGES)
    decode = LLM("tiny-random", role="decode", page_size=24, num_pages=PAGES)
    with pytest.raises(ValueError, match="prefill page_size 16 and decode page_size 24: one must divide"):
        _local_pair(prefill, decode, request.node.name)


def test_an_nhd_prefill_side_whose_ranks_hold_other_heads_is_refused_at_connect(request):
    prefill = LLM("tiny-random", tp=2, role="prefill", page_size=16, num_pages=PAGES, kv_layout="NHD")
    decode = LLM("tiny-random", role="decode", page_size=16, num_pages=PAGES)
    try:
        with pytest.raises(ValueError, match="an NHD prefill side sends whole pages of its ranks' heads"):
            _local_pair(prefill, decode, request.node.name)
    finally:
        prefill.close()


@pytest.mark.parametrize(
    "model, prefill_tp, layouts",
    [
        ("tiny-random", 1, "HND"),
        pytest.param("tiny-random", 1, "HND NHD", marks=pytest.mark.slow),  # relayout: bytes, as any cache's
        ("tiny-random", 2, "HND"),
        pytest.param("tiny-random-deepseek", 1, "HND", marks=pytest.mark.slow),
        ("tiny-random-deepseek", 2, "HND"),  # the MLA latent cache, replicated on both prefill ranks
    ],
)
def test_an_e4m3_cache_crosses_with_its_scales_and_gives_the_colocated_e4m3_tokens(
    request, model, prefill_tp, layouts
):
    """e4m3 pages and their scales (one region a rank: engine.kv.cache.scaled_views) move together: a
    conversation's turns, prefilled in chunks that end inside pages, give the tokens of a colocated e4m3
    engine that serves the same turns, in the other layout and from TP 2 too, and an MLA latent cache
    (pages landed without their scales read as values up to 448 times their own: other tokens); and a
    page's bytes on the wire are a quarter of the model's fp32 ones, its scales beside them."""
    prefill_layout, decode_layout = (layouts.split() * 2)[:2]
    fp8 = dict(kv_dtype="fp8_e4m3", page_size=16, num_pages=PAGES, max_num_batched_tokens=40)
    prefill = LLM(model, role="prefill", tp=prefill_tp, kv_layout=prefill_layout, **fp8)
    decode = LLM(model, role="decode", kv_layout=decode_layout, **fp8)
    reference = LLM(model, kv_layout=decode_layout, **fp8)
    pm, dm = _local_pair(prefill, decode, request.node.name)
    try:
        # 144 tokens to send, 9 whole pages (each turn adds 8 + 40 more): the decode side's first step
        # starts a page, as the colocated engine's last prompt token does. e4m3 rounds a page again as
        # rows join it, so a page that the decode step would complete is rounded differently than in
        # the colocated engine's prefill pass (other bits, at random weights other tokens)
        prompt = list(range(100, 245))
        for turn in range(3):
            rid = f"turn{turn}"
            assert dm.submit(rid, prompt, GREEDY)
            _run(prefill, decode, pm, dm, [rid])
            out = decode.output(rid)
            assert out.token_ids == reference.generate([prompt], GREEDY)[0].token_ids, turn
            prompt = prompt + out.token_ids + list(range(300 + 40 * turn, 340 + 40 * turn))
        assert not dm.dropped and not pm.transfers
        assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES
    finally:
        _close(pm, dm)
        prefill.close()
    src, dst = shard_spec(prefill), shard_spec(decode)
    plain = shard_spec(LLM(model, page_size=16, num_pages=PAGES))
    scaled, whole = plan_array(src, dst, [0, 1], [0, 1]), plan_array(plain, plain, [0, 1], [0, 1])
    scale_bytes = (
        dst.num_layers * 2 * dst.planes * dst.num_kv_heads * 4
    )  # a float32 a layer, page, plane, head
    assert scaled[:, 5].sum() == whole[:, 5].sum() // 4 + scale_bytes


@pytest.mark.parametrize(
    "model, prefill_tp, layout",
    [
        ("tiny-random", 1, "HND"),
        ("tiny-random", 2, "HND"),  # each rank's heads staged on its own, landing in one decode rank
        ("tiny-random", 1, "NHD"),
        ("tiny-random-deepseek", 1, "HND"),  # the MLA latent cache: one plane, one head
    ],
)
def test_a_wider_prefill_cache_feeds_an_e4m3_decode_cache_each_page_quantized_as_written(
    request, model, prefill_tp, layout
):
    """A prefill worker with a cache in the model's dtype and a decode worker with an e4m3 one: each page
    crosses quantized from the prefill cache (a scale per page, plane and head over the rows it holds:
    the last page's leftovers from an earlier request count for nothing), lands as staged, and the decode
    side generates from it; half-filled pages included, nothing is left held on either side."""
    fp8 = dict(kv_dtype="fp8_e4m3", kv_layout=layout, page_size=16, num_pages=PAGES)
    prefill = LLM(model, role="prefill", tp=prefill_tp, kv_layout=layout, page_size=16, num_pages=PAGES,
                  max_num_batched_tokens=40)  # fmt: skip
    decode = LLM(model, role="decode", **fp8)
    pm, dm = _local_pair(prefill, decode, request.node.name, kv_dtype="fp8_e4m3")
    requests = []
    send = dm.peers["prefill-0"].channel.send
    dm.peers["prefill-0"].channel.send = lambda msg, **kw: (requests.append(msg), send(msg, **kw))[1]
    try:
        for cache in prefill.kv_caches:  # leftovers: a page's rows past its tokens must not set its scale
            cache.fill_(1e3)
        prompt = list(range(100, 240))  # 139 tokens to send: 8 pages and 11 rows of a ninth
        assert dm.submit("r", prompt, GREEDY)
        _run(prefill, decode, pm, dm, ["r"])
        assert len(decode.output("r").token_ids) == GREEDY.max_tokens
        assert not dm.dropped and not pm.transfers
        assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES
    finally:
        _close(pm, dm)
        prefill.close()
    hnd = layout == "HND" or prefill.config.arch.mla
    heads = 3 if hnd else 4  # the head dim of [layers, pages, planes, H, P, D] (HND) or [..., P, H, D]
    theirs, ours = list(range(9)), requests[0].dst_pages[:9]
    x = torch.cat([c[:, theirs] for c in prefill.kv_caches], dim=heads).float()  # [layers, 9, ...]
    (x[:, 8, :, :, 11:] if hnd else x[:, 8, :, 11:]).zero_()
    q, s = kv_quant.quantize(x, (heads + 1, 5) if hnd else (heads - 1, 5))
    s = s[..., 0, 0] if hnd else s[:, :, :, 0, :, 0]
    staged_kv, staged_scales = pm.stage.views[0] if prefill_tp == 1 else (None, None)
    if staged_kv is not None:  # the staging copy holds what was quantized, bit for bit
        assert torch.equal(staged_kv[:, theirs].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(staged_scales[:, theirs], s)
    # and the decode side's first 8 pages hold it as landed (the ninth took the decode steps' rows since)
    assert torch.equal(decode.kv_cache[:, ours[:8]].view(torch.uint8), q[:, :8].view(torch.uint8))
    assert torch.equal(decode.model.kv_scales[:, ours[:8]], s[:, :8])
    assert s[:, 8].max() < 1e3 / kv_quant.FP8_MAX  # the leftovers were not counted


def test_an_e4m3_prefill_cache_is_refused_by_a_wider_decode_cache_at_connect(request):
    prefill = LLM("tiny-random", role="prefill", kv_dtype="fp8_e4m3", page_size=16, num_pages=PAGES)
    decode = LLM("tiny-random", role="decode", page_size=16, num_pages=PAGES)
    with pytest.raises(ValueError, match="an e4m3 prefill side's KV cannot go to a float32 decode side"):
        _local_pair(prefill, decode, request.node.name)
