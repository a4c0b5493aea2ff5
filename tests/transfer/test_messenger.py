"""The two messenger halves in one process over the local backend, driving two real engines."""

import random
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sequence import Status
from transfer.backends import make_backend
from transfer.decode import DecodeMessenger
from transfer.plan import ShardSpec
from transfer.prefill import PrefillMessenger
from transfer.protocol import local_channel

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PAGES = 128


class PrefillSide:  # engine.LLM in the prefill role, as the messenger sees it
    def __init__(self, llm):
        self.llm = llm

    def start(self, request_id, prompt_ids):
        self.llm.add_request(prompt_ids, SamplingParams(max_tokens=1), request_id=request_id)

    def pages(self, request_id):
        return self.llm.allocator.pages(request_id)

    def stop(self, request_id):
        self.llm.stop(request_id)

    def release(self, request_id):
        self.llm.release(request_id)


class DecodeSide:
    def __init__(self, llm):
        self.llm = llm

    def reserve(self, request_id, prompt_ids):
        self.llm.reserve(prompt_ids, GREEDY, request_id=request_id)
        return self.llm.allocator.pages(request_id)

    def admit(self, request_id):
        self.llm.admit_prefilled(request_id)

    def fail(self, request_id, error):
        self.llm.stop(request_id, error)

    def free(self, request_id):
        self.llm.release(request_id)


def _spec(llm):
    m, c = llm.config.model, llm.config.cache
    return ShardSpec(
        tp=llm.config.tp,
        num_kv_heads=m.num_kv_heads,
        num_layers=m.num_layers,
        num_pages=c.num_pages,
        page_size=c.page_size,
        head_dim=m.head_dim,
        itemsize=llm.kv_cache.element_size(),
        dtype=llm.config.dtype,
    )


def _prefill_messenger(side, backend, channel):
    """A PrefillMessenger over side.llm's KV regions and layer counter, installed as its listener."""
    llm = side.llm
    pm = PrefillMessenger(
        side, backend, _spec(llm), channel, llm.kv_caches, llm.counter, llm.config.model.hidden_size
    )
    llm.listener = pm
    return pm


def _decode_messenger(side, backend, channel, prefill_spec, **kwargs):
    llm = side.llm
    return DecodeMessenger(
        side,
        backend,
        _spec(llm),
        channel,
        prefill_spec,
        llm.kv_caches,
        llm.config.model.hidden_size,
        **kwargs,
    )


def _local_pair(prefill, decode, tag, source=PrefillSide, sink=DecodeSide, deadline_s=60.0):
    """Both messenger halves in this process: local backend, in-process control queues."""
    decode_end, prefill_end = local_channel()
    pm = _prefill_messenger(source(prefill), make_backend("local", f"p-{tag}"), prefill_end)
    dm = _decode_messenger(
        sink(decode), make_backend("local", f"d-{tag}"), decode_end, _spec(prefill), deadline_s=deadline_s
    )
    return pm, dm


def _close(pm, dm):
    pm.close()
    pm.backend.close()
    dm.backend.close()


@pytest.fixture
def pair(request):
    prefill = LLM("tiny-random", role="prefill", page_size=4, num_pages=PAGES, max_num_batched_tokens=24)
    decode = LLM("tiny-random", role="decode", page_size=4, num_pages=PAGES)
    pm, dm = _local_pair(prefill, decode, request.node.name)
    yield prefill, decode, pm, dm
    _close(pm, dm)


def _run(prefill, decode, pm, dm, ids, prefill_polls=True, max_iters=5000):
    for _ in range(max_iters):
        if prefill_polls:
            pm.poll()
            if prefill.has_unfinished():
                prefill.step()
        dm.poll()
        if decode.has_unfinished():
            decode.step()
        if all(decode.seqs[i].finished for i in ids) and not dm.pending and not pm.transfers:
            return
    raise AssertionError("requests did not finish")


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(rng.choice([1, 2, 9, 17, 33]))] for _ in range(n)]


def test_disaggregated_tokens_equal_colocated(pair):
    prefill, decode, pm, dm = pair
    prompts = _prompts(8)
    expected = [
        o.token_ids for o in LLM("tiny-random", page_size=4, num_pages=PAGES).generate(prompts, GREEDY)
    ]
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        dm.submit(rid, prompt)
    _run(prefill, decode, pm, dm, ids)
    assert [decode.output(rid).token_ids for rid in ids] == expected
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES
    multi = [rid for rid, p in zip(ids, prompts, strict=True) if len(p) > 1]
    assert set(dm.contexts) == set(multi) and all(dm.contexts[r].abs().sum() > 0 for r in multi)


def test_abort_from_decode_mid_transfer_frees_both_sides(pair):
    prefill, decode, pm, dm = pair
    dm.submit("long", list(range(100, 160)))  # 59 tokens: three 24-token chunks
    dm.submit("short", list(range(200, 210)))
    pm.poll()
    prefill.step()  # the first chunk is computed (and partly sent)
    dm.abort("long")
    _run(prefill, decode, pm, dm, ["long", "short"])
    long, short = decode.output("long"), decode.output("short")
    assert long.finish_reason == "error" and "aborted" in long.error and not long.token_ids
    assert short.finish_reason == "length" and len(short.token_ids) == 8
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES


def test_deadline_fails_the_request_but_holds_pages_until_the_prefill_side_answers(pair):
    prefill, decode, pm, dm = pair
    dm.deadline_s = 0.05
    dm.submit("stuck", list(range(100, 140)))
    give_up = time.monotonic() + 10
    while decode.seqs["stuck"].status is not Status.FINISHED:  # the prefill worker is silent
        dm.poll()
        assert time.monotonic() < give_up
    assert decode.output("stuck").finish_reason == "error" and "deadline" in decode.output("stuck").error
    assert decode.allocator.num_free < PAGES  # pinned until the prefill side confirms nothing is in flight
    _run(prefill, decode, pm, dm, ["stuck"])  # the prefill worker wakes up, sees the abort, answers
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES
    dm.deadline_s = 60.0
    dm.submit("later", list(range(300, 320)))  # the pair still works
    _run(prefill, decode, pm, dm, ["later"])
    assert decode.output("later").finish_reason == "length"


def test_layers_stream_while_the_forward_pass_runs():
    """SmolLM2 (30 layers): layer 0's pages are posted before the pass that computed them has finished."""
    prefill = LLM("smollm2-135m", role="prefill", num_pages=64, max_num_batched_tokens=512)
    decode = LLM("smollm2-135m", role="decode", num_pages=64)
    pm, dm = _local_pair(prefill, decode, "stream", deadline_s=120)
    passes = []
    run = prefill.runner.run

    def timed_run(batch, counter=None):
        start = time.perf_counter()
        out = run(batch, counter)
        passes.append((start, time.perf_counter()))
        return out

    prefill.runner.run = timed_run
    try:
        dm.submit("r", list(range(1000, 1300)))  # 299 tokens prefilled in one pass
        _run(prefill, decode, pm, dm, ["r"])
        assert decode.output("r").finish_reason == "length"
        ((start, end),) = passes
        first_layer = min(t for rid, layer, t in pm.post_log if layer == 0)
        last_layer = max(t for rid, layer, t in pm.post_log if layer == 29)
        print(
            f"pass {1e3 * (end - start):.0f} ms; layer 0 posted at +{1e3 * (first_layer - start):.0f} ms, "
            f"layer 29 at +{1e3 * (last_layer - start):.0f} ms"
        )
        assert start < first_layer < end, "layer 0 was posted only after the forward pass ended"
        assert first_layer < last_layer
    finally:
        _close(pm, dm)


def _full_heads(caches, spec, pages):
    """[layers, pages, 2, all kv heads, P, D] assembled from each head's first holder rank."""
    parts = []
    for head in range(spec.num_kv_heads):
        rank = spec.holders(head)[0]
        parts.append(caches[rank][:, pages, :, head - spec.first_head(rank)])
    return torch.stack(parts, dim=3)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2), (4, 1)])  # tp 4 > 2 kv heads: replicated
def test_mismatched_tp_through_the_messenger(prefill_tp, decode_tp):
    """Each side's TP ranks keep their own KV shard (mapped into the lead); the plan cuts and joins pages,
    and every decode rank receives exactly the bytes the prefill ranks computed."""
    prompts = _prompts(4, seed=2)
    expected = [
        o.token_ids for o in LLM("tiny-random", page_size=4, num_pages=PAGES).generate(prompts, GREEDY)
    ]
    prefill = LLM(
        "tiny-random", tp=prefill_tp, role="prefill", page_size=4, num_pages=PAGES, max_num_batched_tokens=24
    )
    decode = LLM("tiny-random", tp=decode_tp, role="decode", page_size=4, num_pages=PAGES)
    sent, landed = {}, {}

    class Source(PrefillSide):
        def release(self, request_id):  # what the prefill ranks computed, before the pages go back
            sent[request_id] = _full_heads(prefill.kv_caches, _spec(prefill), self.pages(request_id))
            super().release(request_id)

    class Sink(DecodeSide):
        def admit(self, request_id):  # what landed, before decoding appends to the pages
            landed[request_id] = _full_heads(
                decode.kv_caches, _spec(decode), decode.allocator.pages(request_id)
            )
            super().admit(request_id)

    pm, dm = _local_pair(prefill, decode, f"tp{prefill_tp}{decode_tp}", source=Source, sink=Sink)
    try:
        ids = [f"r{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            dm.submit(rid, prompt)
        _run(prefill, decode, pm, dm, ids)
        multi = [rid for rid, p in zip(ids, prompts, strict=True) if len(p) > 1]
        assert sorted(sent) == sorted(multi)  # one-token prompts never reach the prefill worker
        for rid in multi:
            if prefill_tp <= 2:  # one holder per head: the bytes must be the ones it computed
                assert torch.equal(landed[rid], sent[rid]), rid
            else:  # replicas on ranks with different thread counts round differently; pages rotate over them
                torch.testing.assert_close(landed[rid], sent[rid], atol=1e-5, rtol=1e-5)
        if prefill_tp <= 2:  # a 4-way all-reduce sums in another order and flips a greedy near-tie here
            assert [decode.output(rid).token_ids for rid in ids] == expected
        assert all(decode.output(rid).finish_reason == "length" for rid in ids)
        assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES
    finally:
        _close(pm, dm)
        prefill.close()
        decode.close()
