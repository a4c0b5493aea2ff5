"""The messenger with prefix caches, restarts, memory pressure, mismatched TP (MHA and the MLA latent)
and speculation on the decode side."""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.disagg import DecodeSide, PrefillSide, prefill_messenger, shard_spec
from tests.heads import echo_head, record_head_inputs
from tests.kept import keep_outputs
from tests.transfer.messengers import (
    GREEDY,
    PAGES,
    _close,
    _full_heads,
    _local_pair,
    _prompts,
    _refetching_worker,
    _run,
)
from transfer.backends import make_backend
from transfer.config import TransferConfig
from transfer.plan import plan_array
from transfer.protocol import local_channel


def test_a_restarted_prefill_worker_handshakes_again_on_its_channel(pair):
    """A second Hello on a peer's channel is that worker restarted (the Ray launcher's max_restarts): the
    old process's request fails with its pages freed, and the new process prefills the next request."""
    prefill, decode, pm, dm = pair
    dm.submit("old", list(range(100, 160)), GREEDY)
    pm.poll()
    prefill.step()  # part of its prompt is computed and sent when the process dies
    (channel,) = pm.channels
    pm.close()
    pm.backend.close()
    prefill = LLM("tiny-random", role="prefill", page_size=4, num_pages=PAGES, max_num_batched_tokens=24)
    keep_outputs(prefill)
    config = TransferConfig(backend="local")
    pm = prefill_messenger(prefill, make_backend("local", "p-restarted"), config)
    pm.add_peer(channel)  # the same channel, from the new process: its Hello
    dm.poll()
    assert decode.output("old").finish_reason == "error" and decode.allocator.num_free == PAGES
    assert not dm.peers["prefill-0"].lost and dm.peers["prefill-0"].hello.agents == ["p-restarted"]
    dm.submit("new", list(range(100, 160)), GREEDY)
    _run(prefill, decode, pm, dm, ["new"])
    out = decode.output("new")
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES
    pm.close()


def _conversation(prefill, decode, pm, dm, turns, first, reply_len=GREEDY.max_tokens, local_max_tokens=0):
    """Turns of one conversation through the pair: each prompt is the last one, its reply and 5 new
    tokens. Returns each turn's (request id, prompt, whether a prefill worker was asked)."""
    prompt, done = list(first), []
    for t in range(turns):
        rid = f"turn{t}"
        asked = dm.submit(rid, prompt, GREEDY, local_max_tokens=local_max_tokens)
        _run(prefill, decode, pm, dm, [rid])
        done.append((rid, prompt, asked))
        prompt = prompt + decode.output(rid).token_ids + [40 + t, 41, 42, 43, 44]
    return done


def test_the_decode_side_asks_only_for_what_its_cache_lacks(pair):
    """Turn 2 on: the decode worker holds the history's full pages (prompt KV that landed, reply KV it
    computed); its PrefillRequest skips them and only the pages from there on are written."""
    prefill, decode, pm, dm = pair
    requests = []
    send = dm.peers["prefill-0"].channel.send
    dm.peers["prefill-0"].channel.send = lambda msg, **kw: (requests.append(msg), send(msg, **kw))[1]
    turns = _conversation(prefill, decode, pm, dm, 4, range(100, 137))
    reference = LLM("tiny-random", page_size=4, num_pages=PAGES, enable_prefix_caching=False)
    for (rid, prompt, asked), req in zip(turns, requests, strict=True):
        out = decode.output(rid)
        assert asked and out.token_ids == reference.generate([prompt], GREEDY)[0].token_ids
        pages = -(-(len(prompt) - 1) // 4)
        assert req.skip_pages * 4 == out.num_cached_tokens
        sent = list(range(pages - req.skip_pages))
        plan = plan_array(shard_spec(prefill), shard_spec(decode), sent, sent)
        assert dm.timings[rid].writes == len(plan) + 1  # the pages past the cached ones, and the context
    cached = [decode.output(rid).num_cached_tokens for rid, _, _ in turns]
    # all of the history's full pages but the one holding the last reply token (never computed)
    assert cached == [0] + [(len(prompt) + GREEDY.max_tokens - 1) // 4 * 4 for _, prompt, _ in turns[:-1]]
    assert not dm.dropped
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES


def test_a_short_missing_rest_is_prefilled_on_the_decode_worker(pair):
    """local_max_tokens: where the decode worker's cache lacks at most that many tokens, it computes them
    itself and no PrefillRequest goes out; a longer rest still goes to the prefill worker."""
    prefill, decode, pm, dm = pair
    turns = _conversation(prefill, decode, pm, dm, 3, range(100, 137), local_max_tokens=12)
    assert [asked for _, _, asked in turns] == [True, False, False]
    reference = LLM("tiny-random", page_size=4, num_pages=PAGES, enable_prefix_caching=False)
    for rid, prompt, _ in turns:
        assert decode.output(rid).token_ids == reference.generate([prompt], GREEDY)[0].token_ids
    assert "turn1" not in dm.timings and "turn0" in dm.timings
    assert not pm.transfers and prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES


def test_refetches_under_memory_pressure_find_their_own_pages_and_all_finish():
    """80 decode pages, 8 requests of 60 + 30 tokens, no admission horizon: requests are preempted and
    refetched; a refetched one whose own pages are still cached needs no transfer (or a short one), and
    every request still finishes with the tokens it has alone, nothing held at the end."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prefill = LLM("tiny-random", role="prefill", page_size=4, num_pages=512)
    decode = LLM(
        "tiny-random", role="decode", page_size=4, num_pages=80, reserved_tokens=0, preemption="refetch"
    )
    pm, dm = _local_pair(prefill, decode, "pressure")
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(3, 49000) for _ in range(60)] for i in range(8)}
    backlog = [(rid, p, 0) for rid, p in prompts.items()]
    try:
        _run(prefill, decode, pm, dm, list(prompts), tick=_refetching_worker(decode, dm, backlog, params))
        reference = LLM("tiny-random", page_size=4, num_pages=512, enable_prefix_caching=False)
        for rid, prompt in prompts.items():
            assert decode.output(rid).token_ids == reference.generate([prompt], params)[0].token_ids, rid
        assert decode.preemption_stats["preemptions"] > 0 and decode.prefix_cache_stats["hits"] > 0
        assert decode.allocator.num_free == 80 and prefill.allocator.num_free == 512
    finally:
        _close(pm, dm)


def test_a_new_request_skips_a_prefill_worker_whose_process_is_gone(pair):
    """Two prefill peers, one whose process has just died (its pid gone, not yet found silent) and which
    the load would pick: the request goes to the live one (before, it failed with 'no live prefill
    worker' while another was up: the chaos soak found it)."""
    import subprocess

    import msgspec

    prefill, decode, pm, dm = pair
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid names no process
    hello = msgspec.structs.replace(dm.peers["prefill-0"].hello, pid=dead.pid)
    idle_end, _ = local_channel()
    dm.add_peer("prefill-9", idle_end, hello)
    dm.submit("busy", list(range(100, 160)), GREEDY, peer="prefill-0")  # prefill-0 has work: 9 is idler
    dm.submit("next", list(range(200, 230)), GREEDY)
    assert dm.pending["next"].peer.name == "prefill-0" and dm.peers["prefill-9"].lost
    dm.submit("named", list(range(300, 330)), GREEDY, prefer="prefill-9")  # the router's choice, now gone
    assert dm.pending["named"].peer.name == "prefill-0"
    _run(prefill, decode, pm, dm, ["busy", "next", "named"])
    assert decode.output("next").finish_reason == decode.output("named").finish_reason == "length"
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES


@pytest.mark.parametrize(
    "prefill_tp, decode_tp, per_rank",
    [
        (2, 1, (True, True)),
        (1, 2, (True, True)),
        (4, 1, (True, True)),  # tp 4 > 2 kv heads: replicated
        (2, 1, (False, True)),  # one prefill agent for both ranks
        (1, 2, (True, False)),  # one decode agent for both ranks (both sides of TP > 1 need two processes:
        # tests/transfer/test_two_processes.py)
    ],
)
def test_mismatched_tp_through_the_messenger(prefill_tp, decode_tp, per_rank):
    """Each side's TP ranks keep their own KV shard (mapped into the lead), each rank's sent or received by
    an agent of its own (or one for all ranks); the plan cuts and joins pages, and every decode rank
    receives exactly the bytes the prefill ranks computed, each prefill rank's from its own agent."""
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
            sent[request_id] = _full_heads(prefill.kv_caches, shard_spec(prefill), self.pages(request_id))
            super().release(request_id)

    class Sink(DecodeSide):
        def admit(self, request_id, context):  # what landed, before decoding appends to the pages
            landed[request_id] = _full_heads(
                decode.kv_caches, shard_spec(decode), decode.allocator.pages(request_id)
            )
            super().admit(request_id, context)

    tag = f"tp{prefill_tp}{decode_tp}{per_rank}"
    pm, dm = _local_pair(prefill, decode, tag, source=Source, sink=Sink, per_rank=per_rank)
    try:
        ids = [f"r{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            dm.submit(rid, prompt, GREEDY)
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
        # every prefill rank's agent sent writes (its heads, or its turn of the replicated ones), and only
        # the prefill worker's agents did
        assert set(dm.writes_from) == set(pm.agents.names)
        assert len(pm.agents.names) == (prefill_tp if per_rank[0] else 1)
    finally:
        _close(pm, dm)
        prefill.close()
        decode.close()


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_the_latent_cache_crosses_mismatched_tp_each_decode_page_written_once(prefill_tp, decode_tp):
    """DeepSeek's latent cache is replicated on every rank: each decode rank's copy of every page is written
    exactly once per layer (by one prefill replica, the pages rotating over them), the tokens are the
    colocated ones, and every prefill pages go back."""
    prompts = _prompts(4, seed=5)
    expected = [
        o.token_ids
        for o in LLM("tiny-random-deepseek", page_size=4, num_pages=PAGES).generate(prompts, GREEDY)
    ]
    prefill = LLM(
        "tiny-random-deepseek",
        tp=prefill_tp,
        role="prefill",
        page_size=4,
        num_pages=PAGES,
        max_num_batched_tokens=24,
    )
    decode = LLM("tiny-random-deepseek", tp=decode_tp, role="decode", page_size=4, num_pages=PAGES)
    pm, dm = _local_pair(prefill, decode, f"mla{prefill_tp}{decode_tp}", per_rank=(False, False))
    spec = shard_spec(decode)
    assert spec.planes == 1 and spec.num_kv_heads == 1 and spec.head_dim == 48
    writes, post = [], pm.backend.post

    def counting(peer, ops, notif):
        writes.extend(row for row in torch.as_tensor(ops).tolist() if row[2] < decode_tp)  # KV, not context
        return post(peer, ops, notif)

    pm.backend.post = counting
    try:
        ids = [f"r{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            dm.submit(rid, prompt, GREEDY)
        _run(prefill, decode, pm, dm, ids)
        assert [decode.output(rid).token_ids for rid in ids] == expected
        layer_bytes = spec.region_bytes // spec.num_layers
        page_bytes = spec.page_size * spec.head_dim * spec.itemsize
        assert all(nbytes % page_bytes == 0 for *_, nbytes in writes)
        written = [  # (decode rank, layer, page) of every page a write covers
            (dst, off // layer_bytes, (off % layer_bytes) // page_bytes + k)
            for _, _, dst, off, nbytes in writes
            for k in range(nbytes // page_bytes)
        ]
        # the prompt's KV but its last token's (the decode worker computes that one); one-token prompts: none
        pages = sum(-(-(len(p) - 1) // 4) for p in prompts if len(p) > 1)
        assert len(written) == len(set(written)) == pages * spec.num_layers * decode_tp
        assert {src for src, *_ in writes} == set(range(prefill_tp))  # every prefill replica sends
        assert prefill.allocator.num_free == PAGES
    finally:
        _close(pm, dm)
        prefill.close()
        decode.close()


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculation_on_the_decode_worker_keeps_1p1d_tokens_lossless(method, tmp_path):
    """The decode half drafts from the prompt it never computed and the tokens it decodes: ngram from the
    ids; mtp from the hidden state the prefill side wrote (its first input)."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], *_prompts(5, seed=4)]
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "mtp":
        spec["model"] = echo_head(tmp_path / "echo.safetensors")
    kwargs = {"page_size": 4, "num_pages": PAGES, "max_num_batched_tokens": 24}
    colocated = LLM("tiny-random", **kwargs, speculative_config=spec)
    plain = [o.token_ids for o in LLM("tiny-random", **kwargs).generate(prompts, GREEDY)]
    expected = colocated.generate(prompts, GREEDY)
    assert [o.token_ids for o in expected] == plain
    prefill = LLM("tiny-random", role="prefill", **kwargs)
    decode = LLM("tiny-random", role="decode", page_size=4, num_pages=PAGES, speculative_config=spec)
    pm, dm = _local_pair(prefill, decode, "speculative-" + method)
    try:
        ids = [f"s{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            dm.submit(rid, prompt, GREEDY)
        _run(prefill, decode, pm, dm, ids)
        outs = [decode.output(rid) for rid in ids]
        assert [o.token_ids for o in outs] == plain
        assert sum(o.num_accepted_tokens for o in outs) > 0
        assert decode.allocator.num_free == PAGES and prefill.allocator.num_free == PAGES
    finally:
        _close(pm, dm)
    if method == "mtp":  # the echo head on tiny-random: some drafts rejected, most accepted
        assert sum(o.num_accepted_tokens for o in outs) < sum(o.num_drafted_tokens for o in outs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_mtp_heads_first_input_on_the_decode_worker_is_the_colocated_one_bit_for_bit(dtype):
    """The context the prefill worker writes is the hidden state the MTP head needs: on the decode worker
    the head's first input (embedding of the last prompt token, hidden state of the one before) equals a
    colocated run's bit for bit. Prompt lengths 25 and 49 with 24-token chunks make both sides compute
    position prompt_len - 2 in the same chunks (kernels' rounding depends on their shapes)."""
    spec = {"method": "mtp", "num_speculative_tokens": 2, "model": "random"}
    kwargs = {"page_size": 4, "num_pages": PAGES, "max_num_batched_tokens": 24, "dtype": dtype}
    prompts = [list(range(100, 125)), list(range(300, 349))]
    colocated = LLM("tiny-random", **kwargs, speculative_config=spec)
    colocated_inputs = record_head_inputs(colocated)
    expected = [colocated.generate([p], GREEDY)[0] for p in prompts]  # one at a time, as below
    prefill = LLM("tiny-random", role="prefill", **kwargs)
    decode = LLM("tiny-random", role="decode", **kwargs, speculative_config=spec)
    decode_inputs = record_head_inputs(decode)
    pm, dm = _local_pair(prefill, decode, "mtp-context-" + dtype)
    try:
        for rid, prompt in (("a", prompts[0]), ("b", prompts[1])):
            dm.submit(rid, prompt, GREEDY)
            _run(prefill, decode, pm, dm, [rid])
    finally:
        _close(pm, dm)
    for out, rid in zip(expected, "ab", strict=True):
        assert decode.output(rid).token_ids == out.token_ids
        embedded, hidden = decode_inputs[rid]
        assert torch.equal(embedded, colocated_inputs[out.request_id][0])
        assert torch.equal(hidden, colocated_inputs[out.request_id][1]) and hidden.abs().sum() > 0
