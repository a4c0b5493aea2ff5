"""The two messenger halves in one process over the local backend, driving two real engines: tokens,
aborts, deadlines and failures."""

import time
from dataclasses import replace

import pytest

from engine import LLM
from engine.disagg import decode_messenger, prefill_messenger
from tests.kept import finished, keep_outputs
from tests.transfer.messengers import GREEDY, PAGES, _close, _local_pair, _prompts, _run
from transfer.backends import make_backend
from transfer.config import TransferConfig
from transfer.protocol import local_channel, wait_hello


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


@pytest.mark.parametrize("late_s", [0.0, 3600.0])
def test_a_cancelled_request_is_computed_no_further_than_its_next_step(pair, late_s):
    """A client's cancel during prefill (its time in the Abort): the prefill side stops the request at
    once, so none of its prompt is computed more than one step after the cancel (late_tokens). The same
    cancel stamped an hour before it arrives (a cancel that reached the prefill worker late) counts every
    pass after its first: the count sees work done for nobody."""
    from transfer.prefill import late_tokens

    prefill, decode, pm, dm = pair
    dm.submit("long", list(range(100, 220)), GREEDY)  # 119 tokens: five 24-token chunks
    pm.poll()
    prefill.step()
    prefill.step()  # two chunks computed
    dm.abort("long", "aborted: the client went away", cancelled_at=time.time() - late_s)
    _run(prefill, decode, pm, dm, ["long"])
    assert decode.output("long").finish_reason == "error"
    assert pm.tokens_after_cancel == (24 if late_s else 0)  # the second pass: the first after it is free
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES
    assert late_tokens([(1, 10.0, 24), (2, 11.0, 24), (3, 12.0, 24)], 10.5) == 24  # pass 2 is let go
    assert late_tokens([(1, 10.0, 24)], 10.5) == 0 and late_tokens([], 1.0) == 0


def test_the_runtime_s_cancel_stops_a_prefill_whose_decode_worker_does_not_answer(pair):
    """The runtime tells the prefill worker itself that the client left (pm.cancel): with the decode side
    not polling (frozen), the prefill side computes none of the rest, counts it cancelled, and its Ended
    fails the request on the decode side once that side polls again; every page comes back."""
    prefill, decode, pm, dm = pair
    dm.submit("long", list(range(100, 220)), GREEDY)  # five 24-token chunks
    pm.poll()
    prefill.step()  # one chunk computed
    pm.cancel("long", time.time())
    pm.cancel("long", time.time())  # sent twice (the decode worker's Abort too, later): counted once
    for _ in range(5):
        pm.poll()
        prefill.step()  # nothing left of it to compute
    assert not prefill.has_unfinished() and pm.cancelled_in_flight == 1
    _run(prefill, decode, pm, dm, ["long"])
    assert decode.output("long").finish_reason == "error" and pm.tokens_after_cancel == 0
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES
    pm.cancel("unknown", time.time())  # no one's business here
    assert pm.cancelled_in_flight == 1


def test_a_cancel_that_overtakes_its_request_ends_the_request_as_it_arrives(pair):
    """The runtime's Cancel can reach the prefill worker before the decode worker's PrefillRequest (sent
    just after the client left, before that worker heard): the request ends as it arrives, none of it
    computed, and the decode side frees its pages; the next request is served."""
    prefill, decode, pm, dm = pair
    pm.cancel("late", time.time())  # nothing of it here yet
    dm.submit("late", list(range(100, 220)), GREEDY)
    pm.poll()
    assert not prefill.has_unfinished() and pm.cancelled_in_flight == 1
    _run(prefill, decode, pm, dm, ["late"])
    late = decode.output("late")
    assert late.finish_reason == "error" and "the client went away" in late.error and not late.token_ids
    assert pm.tokens_after_cancel == 0
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES
    dm.submit("next", list(range(100, 220)), GREEDY)
    _run(prefill, decode, pm, dm, ["next"])
    assert decode.output("next").finish_reason == "length"


def test_a_cancel_that_arrives_after_the_kv_landed_counts_the_passes_after_it(pair):
    """The prefill side keeps a finished transfer's passes a while: an Abort that comes after its KV
    landed (sent here by hand, stamped before the passes began) is counted against them."""
    from transfer.protocol import Abort

    prefill, decode, pm, dm = pair
    stamp = time.time()
    dm.submit("done", list(range(100, 160)), GREEDY)  # 59 tokens: three 24-token chunks
    seq = dm.pending["done"].seq
    _run(prefill, decode, pm, dm, ["done"])
    assert pm.tokens_after_cancel == 0
    dm.peers["prefill-0"].channel.send(Abort("done", seq, "late", stamp))
    give_up = time.monotonic() + 10
    while pm.tokens_after_cancel == 0:
        pm.poll()
        assert time.monotonic() < give_up, "the late Abort was not counted"
    assert pm.tokens_after_cancel == 35  # passes 2 and 3 (24 + 11 tokens): the first is let go


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
    """Silence fails the request, but the hung (or cut-off) peer may still write: its pages wait, set
    aside, until it answers; the request id is free at once, to be sent again."""
    prefill, decode, pm, dm = pair
    prompt = list(range(100, 160))
    dm.submit("r", prompt, GREEDY)
    pm.poll()
    prefill.step()
    (peer,) = dm.peers.values()
    peer.channel.peer_silent_for = lambda: 60.0  # as if no heartbeat came for a minute
    dm.poll()
    out = decode.output("r")
    assert out.finish_reason == "error" and "silent" in out.error
    assert dm.peer_lost == {"r"}
    for _ in range(3):
        dm.poll()
    held = PAGES - decode.allocator.num_free
    assert held == 15  # its process is alive (it is this one): pages stay pinned, set aside
    assert len(dm.fenced) == 1 and dm.holds(peer.name) and not decode.allocator.pages("r")
    decode.core.forget("r")
    dm.forget("r")
    dm.submit("r", prompt, GREEDY)  # the id again: the only peer is lost, so it ends at once
    assert "no live prefill worker" in decode.output("r").error
    assert PAGES - decode.allocator.num_free == held  # what it took came back; the set-aside stay
    decode.core.forget("r")
    del peer.channel.peer_silent_for
    _run(prefill, decode, pm, dm, [])  # it resumes, reads the Abort, answers Ended (of the first seq)
    assert not dm.fenced and prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES
    dm.submit("r", prompt, GREEDY)  # and once it talks again, the same id is served as usual
    _run(prefill, decode, pm, dm, ["r"])
    assert decode.output("r").finish_reason == "length"
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


@pytest.mark.parametrize("mode", ["layer", "chunk", "request"])
def test_each_send_mode_moves_the_same_kv_at_its_own_time(mode):
    """A 59-token prompt prefilled in three 24-token passes, sent per layer, per chunk or whole: the same
    tokens as colocated; per chunk, each pass's pages go in one post of every layer once the pass began;
    whole, one post after the last pass began and after its prefill was computed."""
    prefill = LLM("tiny-random", role="prefill", page_size=4, num_pages=PAGES, max_num_batched_tokens=24)
    decode = LLM("tiny-random", role="decode", page_size=4, num_pages=PAGES)
    pm, dm = _local_pair(prefill, decode, f"mode-{mode}", send_mode=mode)
    passes, run = [], prefill.runner.run

    def timed_run(batch, counter=None):
        passes.append(time.perf_counter())
        return run(batch, counter)

    prefill.runner.run = timed_run
    prompt = list(range(100, 160))
    expected = LLM("tiny-random", page_size=4, num_pages=PAGES).generate([prompt], GREEDY)[0].token_ids
    try:
        dm.submit("r", prompt, GREEDY)
        _run(prefill, decode, pm, dm, ["r"])
        assert decode.output("r").token_ids == expected
        assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES
        layers = prefill.config.arch.num_layers
        posts: dict[float, list[int]] = {}  # post time -> the layers it carried
        for _, layer, at in pm.post_log:
            posts.setdefault(at, []).append(layer)
        (sent,) = pm.done_log
        assert sent.request_id == "r" and sent.first_post == min(posts) and sent.done >= max(posts)
        assert len(passes) == 3 and sent.started < passes[0] and sent.computed > passes[-1]
        if mode == "chunk":
            assert len(posts) == 3 and all(sorted(v) == list(range(layers)) for v in posts.values())
            assert all(at > start for at, start in zip(sorted(posts), passes, strict=True))
        if mode == "request":
            assert len(posts) == 1 and sorted(posts[sent.first_post]) == list(range(layers))
            assert sent.first_post > sent.computed > passes[-1]
    finally:
        _close(pm, dm)


def test_transfer_config_names_the_send_modes():
    with pytest.raises(ValueError, match=r"send_mode must be one of \('layer', 'chunk', 'request'\)"):
        TransferConfig(send_mode="pass")


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
    assert decode.allocator.num_free == PAGES and "r" not in decode.core.seqs and not dm.pending


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


def test_requests_past_the_context_slots_wait_for_a_transfer_to_land():
    """At 256 streams a 1P1D server failed 378 of 512 requests with "no free context slot".
    Past the decode side's transfer.context_slots a request is not taken (NoFreeSlot, nothing reserved)
    and goes again once a transfer lands; a prefill side given more requests than its own slots (as by
    two decode workers) queues them instead of refusing. Tokens as colocated, every page back."""
    from engine.disagg import DecodeSide, PrefillSide
    from transfer.decode import NoFreeSlot

    prefill = LLM("tiny-random", role="prefill", page_size=4, num_pages=PAGES, max_num_batched_tokens=24)
    decode = LLM("tiny-random", role="decode", page_size=4, num_pages=PAGES)
    keep_outputs(prefill), keep_outputs(decode)
    decode_end, prefill_end = local_channel()
    pm = prefill_messenger(prefill, make_backend("local", "p-slots"), TransferConfig(backend="local",
                           context_slots=1), side=PrefillSide)  # fmt: skip
    pm.add_peer(prefill_end)
    dm = decode_messenger(decode, make_backend("local", "d-slots"), TransferConfig(backend="local",
                          context_slots=2), side=DecodeSide)  # fmt: skip
    dm.add_peer("prefill-0", decode_end, wait_hello(decode_end, timeout_s=1))
    prompts = [p for p in _prompts(12) if len(p) > 1][:6]
    ids = [f"s{i}" for i in range(len(prompts))]
    backlog, waits = list(zip(ids, prompts, strict=True)), []

    def tick() -> bool:
        while backlog:
            free = decode.allocator.num_free
            try:
                dm.submit(*backlog[0], GREEDY)
            except NoFreeSlot:
                assert decode.allocator.num_free == free and backlog[0][0] not in decode.core.seqs
                waits.append(backlog[0][0])
                return False
            backlog.pop(0)
        return True

    _run(prefill, decode, pm, dm, ids, tick=tick)
    expected = LLM("tiny-random", page_size=4, num_pages=PAGES).generate(prompts, GREEDY)
    assert [decode.output(rid).token_ids for rid in ids] == [o.token_ids for o in expected]
    assert waits and pm.refused == 0  # some waited on each side's slots; none was refused
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES
    _close(pm, dm)


def test_a_request_fetched_again_before_its_old_transfer_is_reaped_waits_for_it(pair):
    """At 256 streams on 1P1D a preempted request, fetched again, reached the prefill worker
    before that side had reaped its first transfer, and was refused ("already being prefilled here"): the
    newer one from the same owner now waits, and is taken once the old one is reaped."""
    import msgspec

    from transfer.protocol import Abort

    prefill, decode, pm, dm = pair
    dm.submit("again", list(range(100, 130)), GREEDY)
    pm.poll()  # accepted: its transfer is held here until reaped
    old = pm.transfers["again"]
    newer = msgspec.structs.replace(old.req, seq=old.req.seq + 1)
    refused = pm.refused
    pm._accept(newer, old.channel)
    assert pm.refused == refused and (newer, old.channel) in pm._waiting
    give_up = time.monotonic() + 60
    while not (pm.transfers.get("again") and pm.transfers["again"].req.seq == newer.seq):
        assert time.monotonic() < give_up, "the newer request was never taken"
        if prefill.has_unfinished():
            prefill.step()
        dm.poll()
        if decode.has_unfinished():
            decode.step()
        pm.poll()  # reaps the old transfer, then takes the newer one
    pm._on_abort(Abort("again", newer.seq, "the test is done with it"), old.channel)
    _run(prefill, decode, pm, dm, ["again"])
    assert decode.output("again").finish_reason == "length" and pm.refused == refused
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES


@pytest.mark.parametrize(
    "field, value",
    [
        ("model", "another-config"),  # another model of the same KV shape
        ("weights", "another-checkpoint"),  # another checkpoint (or seed) of the same model
        ("tokenizer", "another-vocab"),  # the same ids would be other text
        ("dtype", "float16"),  # page sizes and layouts convert: tests/transfer/test_messenger_pages.py
    ],
)
def test_a_prefill_worker_whose_kv_would_not_mean_the_same_is_refused_at_connect(pair, field, value):
    """The decode side checks a prefill worker's Hello against its own cache before any transfer: a field
    they disagree on is refused, naming it and both values (found later it would be garbage text); a new
    process of a known peer that does not fit is asked nothing and counted."""
    from transfer.protocol import Hello, local_channel

    prefill, decode, pm, dm = pair
    (peer,) = dm.peers.values()
    own = getattr(dm.spec, field)
    hello = Hello.of(replace(peer.hello.spec, **{field: value}), "elsewhere")
    with pytest.raises(ValueError) as err:
        dm.add_peer("prefill-1", local_channel()[0], hello)
    message = str(err.value)
    assert "prefill worker prefill-1 cannot send its KV to this decode worker: prefill and decode " in message
    assert f"disagree on {field}: {value!r} (prefill) vs {own!r} (decode)" in message, message
    assert "prefill-1" not in dm.peers
    dm._rejoin(peer, hello)  # prefill-0 restarted as a worker that does not fit
    assert peer.lost and dm.dropped["Hello of a peer that does not fit"] == 1
    assert dm.submit("r", list(range(100, 140)), GREEDY) is False  # nothing is asked of it
    assert not dm.pending and "r" in dm.peer_lost


def test_both_sides_of_a_real_pair_share_model_weights_and_tokenizer_digests(pair):
    prefill, decode, pm, dm = pair
    (peer,) = dm.peers.values()
    assert peer.hello.spec == pm.spec and all(
        len(getattr(pm.spec, f)) == 16 for f in ("model", "weights", "tokenizer")
    )
