"""The two messenger halves in one process over the local backend, driving two real engines."""

import random
import time
from dataclasses import replace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.disagg import DecodeSide, PrefillSide, decode_messenger, prefill_messenger, shard_spec
from engine.kv_cache import OutOfPages
from tests.heads import echo_head, record_head_inputs
from tests.kept import finished, keep_outputs
from transfer.backends import make_backend
from transfer.config import TransferConfig
from transfer.plan import plan_array
from transfer.protocol import local_channel, wait_hello

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PAGES = 128


def _local_pair(prefill, decode, tag, source=PrefillSide, sink=DecodeSide, **config):
    """Both messenger halves in this process: local backend, in-process control queues."""
    config = TransferConfig(backend="local", **config)
    keep_outputs(prefill), keep_outputs(decode)
    decode_end, prefill_end = local_channel()
    pm = prefill_messenger(prefill, make_backend("local", f"p-{tag}"), config, side=source)
    pm.add_peer(prefill_end)
    dm = decode_messenger(decode, make_backend("local", f"d-{tag}"), config, side=sink)
    dm.add_peer("prefill-0", decode_end, wait_hello(decode_end, timeout_s=1))
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


def _run(prefill, decode, pm, dm, ids, prefill_polls=True, timeout_s=60.0, tick=None):
    """Drive both sides until ids finished; tick (a worker's own chores) runs first each turn and says
    whether it has nothing left to do. Bounded in time, not turns: a turn that only polls takes
    microseconds, and a count of them ran out before a control message arrived under a loaded suite."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        idle = tick() if tick is not None else True
        if prefill_polls:
            pm.poll()
            if prefill.has_unfinished():
                prefill.step()
        dm.poll()
        if decode.has_unfinished():
            decode.step()
        if idle and all(finished(decode, i) for i in ids) and not dm.pending and not pm.transfers:
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
        dm.submit(rid, prompt, GREEDY)
    _run(prefill, decode, pm, dm, ids)
    assert [decode.output(rid).token_ids for rid in ids] == expected
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES


def test_abort_from_decode_mid_transfer_frees_both_sides(pair):
    prefill, decode, pm, dm = pair
    dm.submit("long", list(range(100, 160)), GREEDY)  # 59 tokens: three 24-token chunks
    dm.submit("short", list(range(200, 210)), GREEDY)
    pm.poll()
    prefill.step()  # the first chunk is computed (and partly sent)
    dm.abort("long")
    _run(prefill, decode, pm, dm, ["long", "short"])
    long, short = decode.output("long"), decode.output("short")
    assert long.finish_reason == "error" and "aborted" in long.error and not long.token_ids
    assert short.finish_reason == "length" and len(short.token_ids) == 8
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES


@pytest.mark.parametrize(
    "stage, prefill_progress",
    [("handshake_timeout_s", 0), ("first_layer_timeout_s", 1), ("completion_timeout_s", 2)],
)
def test_each_stage_deadline_fails_the_request_but_holds_pages_until_the_prefill_side_answers(
    pair, stage, prefill_progress
):
    """The prefill worker stalls after 0 (never reads), 1 (accepts, computes nothing) or 2 (one chunk sent)
    steps; the stage's deadline fails the request, and its pages wait for the prefill side's answer."""
    prefill, decode, pm, dm = pair
    dm.submit("stuck", list(range(100, 160)), GREEDY)  # three 24-token chunks
    if prefill_progress >= 1:
        pm.poll()
    give_up = time.monotonic() + 10
    if prefill_progress >= 2:
        prefill.step()
        while not dm.pending["stuck"].received:  # the sender thread posts the chunk's pages: landed
            dm.poll()
            assert time.monotonic() < give_up
    dm.config = replace(dm.config, **{stage: 1e-6})  # only now is the stalled stage past its deadline
    while not finished(decode, "stuck"):
        dm.poll()
        decode.step()  # hands the failed request back
        assert time.monotonic() < give_up
    out = decode.output("stuck")
    assert out.finish_reason == "error" and stage in out.error, out.error
    assert (dm.pending["stuck"].received > 0) == (prefill_progress == 2)
    assert decode.allocator.num_free < PAGES  # pinned until the prefill side confirms nothing is in flight
    _run(prefill, decode, pm, dm, ["stuck"])  # the prefill worker wakes up, sees the abort, answers
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES
    dm.config = replace(dm.config, **{stage: 60.0})
    dm.submit("later", list(range(300, 320)), GREEDY)  # the pair still works
    _run(prefill, decode, pm, dm, ["later"])
    assert decode.output("later").finish_reason == "length"


def test_abort_from_prefill_mid_transfer_frees_both_sides(pair):
    prefill, decode, pm, dm = pair
    dm.submit("long", list(range(100, 160)), GREEDY)
    dm.submit("short", list(range(200, 210)), GREEDY)
    pm.poll()
    prefill.step()
    pm.abort("long", "prefill worker draining")
    _run(prefill, decode, pm, dm, ["long", "short"])
    long, short = decode.output("long"), decode.output("short")
    assert long.finish_reason == "error" and "draining" in long.error and not long.token_ids
    assert short.finish_reason == "length"
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES


def test_a_silent_but_living_prefill_worker_keeps_its_pages_quarantined(pair):
    """Silence fails the request, but the hung peer may still write: its pages wait until it answers."""
    prefill, decode, pm, dm = pair
    dm.submit("r", list(range(100, 160)), GREEDY)
    pm.poll()
    prefill.step()
    (peer,) = dm.peers.values()
    peer.channel.peer_silent_for = lambda: 60.0  # as if no heartbeat came for a minute
    dm.poll()
    out = decode.output("r")
    assert out.finish_reason == "error" and "silent" in out.error
    for _ in range(3):
        dm.poll()
    assert decode.allocator.num_free < PAGES  # its process is alive (it is this one): pages stay pinned
    del peer.channel.peer_silent_for
    _run(prefill, decode, pm, dm, ["r"])  # it resumes, reads the Abort, answers Ended
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES


def test_recompute_policy_prefills_a_failed_transfer_locally():
    """on_transfer_failure=recompute: aborted or refused transfers still finish, with the same tokens."""
    prompts = [list(range(100, 160)), list(range(200, 230)), list(range(300, 340))]
    expected = [
        o.token_ids for o in LLM("tiny-random", page_size=4, num_pages=PAGES).generate(prompts, GREEDY)
    ]
    prefill = LLM("tiny-random", role="prefill", page_size=4, num_pages=PAGES, max_num_batched_tokens=24)
    decode = LLM("tiny-random", role="decode", page_size=4, num_pages=PAGES)
    pm, dm = _local_pair(prefill, decode, "recompute", on_transfer_failure="recompute")
    try:
        for i, prompt in enumerate(prompts):
            dm.submit(f"r{i}", prompt, GREEDY)
        pm.poll()
        prefill.step()
        dm.abort("r0", "decode side changed its mind")  # mid-transfer
        pm.abort("r1", "prefill worker draining")  # from the other side
        _run(prefill, decode, pm, dm, ["r0", "r1", "r2"])
        assert [decode.output(f"r{i}").token_ids for i in range(3)] == expected
        assert all(decode.output(f"r{i}").finish_reason == "length" for i in range(3))
        assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES
    finally:
        _close(pm, dm)


def test_a_request_moved_to_another_decode_worker_mid_prefill_is_taken_once_the_old_one_is_reaped():
    """The driver moved r to decode B (A died) before the prefill worker heard of it: B's request for the
    same id waits while A's transfer stops, then runs; B gets the colocated tokens, every page is back."""
    prompt = list(range(100, 160))
    expected = LLM("tiny-random", page_size=4, num_pages=PAGES).generate([prompt], GREEDY)[0].token_ids
    prefill = LLM("tiny-random", role="prefill", page_size=4, num_pages=PAGES, max_num_batched_tokens=24)
    decodes = [LLM("tiny-random", role="decode", page_size=4, num_pages=PAGES) for _ in range(2)]
    config = TransferConfig(backend="local")
    keep_outputs(prefill)
    pm = prefill_messenger(prefill, make_backend("local", "p-moved"), config)
    dms = []
    for i, decode in enumerate(decodes):
        keep_outputs(decode)
        decode_end, prefill_end = local_channel()
        pm.add_peer(prefill_end)
        dm = decode_messenger(decode, make_backend("local", f"d{i}-moved"), config)
        dm.add_peer("prefill-0", decode_end, wait_hello(decode_end, timeout_s=1))
        dms.append(dm)
    try:
        dms[0].submit("r", prompt, GREEDY)
        pm.poll()
        prefill.step()  # A's prefill is under way (24 of 59 tokens)
        assert "r" in pm.transfers
        dms[1].submit("r", prompt, GREEDY)
        deadline = time.monotonic() + 60
        while not finished(decodes[1], "r") and time.monotonic() < deadline:
            pm.poll()
            if prefill.has_unfinished():
                prefill.step()
            for dm, decode in zip(dms, decodes, strict=True):
                dm.poll()
                if decode.has_unfinished():
                    decode.step()
        out = decodes[1].output("r")
        assert out.finish_reason == "length" and out.token_ids == expected
        assert pm.refused == 0
        for _ in range(50):  # A hears its transfer ended; the prefill side reaps what is left
            pm.poll()
            dms[0].poll()
            if not pm.transfers and not dms[0].pending:
                break
            time.sleep(0.01)
        assert prefill.allocator.num_free == PAGES and decodes[1].allocator.num_free == PAGES
    finally:
        pm.close()
        pm.backend.close()
        for dm in dms:
            dm.backend.close()


def test_transfer_config_rejects_bad_values():
    with pytest.raises(ValueError, match=r"on_transfer_failure must be one of \('fail', 'recompute'\)"):
        TransferConfig(on_transfer_failure="retry")
    with pytest.raises(ValueError, match="handshake_timeout_s must be a number of seconds > 0"):
        TransferConfig(handshake_timeout_s=0)
    with pytest.raises(ValueError, match="backend must be one of"):
        TransferConfig(backend="tcp")


def test_layers_stream_while_the_forward_pass_runs():
    """SmolLM2 (30 layers): layer 0's pages are posted before the pass that computed them has finished."""
    prefill = LLM("smollm2-135m", role="prefill", num_pages=64, max_num_batched_tokens=512)
    decode = LLM("smollm2-135m", role="decode", num_pages=64)
    pm, dm = _local_pair(prefill, decode, "stream")
    passes = []
    run = prefill.runner.run

    def timed_run(batch, counter=None):
        start = time.perf_counter()
        out = run(batch, counter)
        passes.append((start, time.perf_counter()))
        return out

    prefill.runner.run = timed_run
    try:
        dm.submit("r", list(range(1000, 1300)), GREEDY)  # 299 tokens prefilled in one pass
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
            sent[request_id] = _full_heads(prefill.kv_caches, shard_spec(prefill), self.pages(request_id))
            super().release(request_id)

    class Sink(DecodeSide):
        def admit(self, request_id, context):  # what landed, before decoding appends to the pages
            landed[request_id] = _full_heads(
                decode.kv_caches, shard_spec(decode), decode.allocator.pages(request_id)
            )
            super().admit(request_id, context)

    pm, dm = _local_pair(prefill, decode, f"tp{prefill_tp}{decode_tp}", source=Source, sink=Sink)
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
    finally:
        _close(pm, dm)
        prefill.close()
        decode.close()


def test_a_send_timeout_frees_the_pages_at_once(pair):
    """Nothing was sent, so nothing can land: the pages need no quarantine."""
    prefill, decode, pm, dm = pair
    (peer,) = dm.peers.values()

    def refuse(msg, timeout_s=10.0):
        raise TimeoutError("the peer took nothing")

    peer.channel.send = refuse
    dm.submit("r", list(range(100, 140)), GREEDY)
    out = decode.output("r")
    assert out.finish_reason == "error" and "could not reach" in out.error
    assert decode.allocator.num_free == PAGES and not dm.pending and len(dm._free_slots) == 64


def test_a_plan_that_raises_takes_nothing(pair):
    from transfer.protocol import Hello

    prefill, decode, pm, dm = pair
    (peer,) = dm.peers.values()
    peer.hello = Hello.of(replace(peer.hello.spec, num_layers=3), "elsewhere")  # a worker that does not fit
    with pytest.raises(ValueError, match="disagree on num_layers"):
        dm.submit("r", list(range(100, 140)), GREEDY)
    assert decode.allocator.num_free == PAGES and "r" not in decode.seqs and not dm.pending


def test_an_unexpected_error_on_the_sender_thread_fails_its_request_not_the_thread(pair):
    """A backend that raises something other than TransferError (a NIXL bug, say) mid-post."""
    prefill, decode, pm, dm = pair
    post = pm.backend.post

    def broken(peer, ops, notif):
        if b"|bad|" in notif:
            raise RuntimeError("injected")
        return post(peer, ops, notif)

    pm.backend.post = broken
    dm.submit("bad", list(range(100, 140)), GREEDY)
    _run(prefill, decode, pm, dm, ["bad"])
    out = decode.output("bad")
    assert out.finish_reason == "error" and "injected" in out.error and pm._thread.is_alive()
    dm.submit("good", list(range(200, 240)), GREEDY)
    _run(prefill, decode, pm, dm, ["good"])
    assert decode.output("good").finish_reason == "length"
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES


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
    assert not dm.peers["prefill-0"].lost and dm.peers["prefill-0"].hello.agent == "p-restarted"
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
    backlog = [(rid, p, params) for rid, p in prompts.items()]

    def worker() -> bool:  # as the decode worker: preempted requests first, then new ones, while pages last
        backlog[:0] = [(s.request_id, s.all_ids, s.params) for s in decode.take_refetches()]
        while backlog:
            try:
                dm.submit(*backlog[0])
            except OutOfPages:
                break
            backlog.pop(0)
        return not backlog

    try:
        _run(prefill, decode, pm, dm, list(prompts), tick=worker)
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
    pm, dm = _local_pair(prefill, decode, f"mla{prefill_tp}{decode_tp}")
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
