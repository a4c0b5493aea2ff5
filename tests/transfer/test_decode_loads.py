"""A decode worker that holds a disaggregated request's leading pages below device memory (its host pool
here; files and the pool go the same way) loads them instead of being sent them, when the load is
expected to end before the transfer would land (kv_tiers.decode_loads); the prefill worker is asked only
for the rest. Tokens equal colocated; a load that fails or is aborted falls back; every page comes back."""

import random

import pytest

from engine import LLM
from tests.tiers import stalled
from tests.transfer.messengers import GREEDY, PAGES, _close, _local_pair, _run

SMALL = {"page_size": 4, "num_pages": 48}  # a 120-token prompt and two others evict it into the host pool


def _prompts():
    rng = random.Random(3)
    a, b, c = ([rng.randrange(3, 49000) for _ in range(120)] for _ in range(3))
    more = [9, 10, 11, 12, 13, 14, 15, 16, 17]
    # each again with a new message; then a exactly (121 tokens: its 30 full pages are all it needs)
    return [a + [7], b + [7], c + [7], a + more, b + more, c + more, a + [7]]


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tiny-random", enable_prefix_caching=False, page_size=4, num_pages=PAGES)
    return [llm.generate([p], GREEDY)[0].token_ids for p in _prompts()]


def _pair(tag, decode_loads, **tiers):
    prefill = LLM("tiny-random", role="prefill", page_size=4, num_pages=PAGES, max_num_batched_tokens=24)
    decode = LLM(
        "tiny-random",
        role="decode",
        **SMALL,
        kv_tiers={"host_bytes": 4 << 20, "decode_loads": decode_loads, **tiers},
    )
    pm, dm = _local_pair(prefill, decode, tag)
    return prefill, decode, pm, dm


def _serve(pair, prompts, first=0):
    """Each prompt alone through the pair; returns the request ids."""
    prefill, decode, pm, dm = pair
    ids = []
    for i, prompt in enumerate(prompts, first):
        dm.submit(f"r{i}", prompt, GREEDY)
        _run(prefill, decode, pm, dm, [f"r{i}"])
        ids.append(f"r{i}")
    return ids


def _all_free(pair):
    prefill, decode, _, _ = pair
    assert decode.tiers.drain()
    assert decode.allocator.num_free == decode.allocator.num_pages and prefill.allocator.num_free == PAGES
    assert not any(decode.tiers.host.busy.values())


def test_pages_in_the_host_pool_load_instead_of_being_sent(reference):
    pair = prefill, decode, pm, dm = _pair("always", "always")
    try:
        ids = _serve(pair, _prompts())
        assert [decode.output(r).token_ids for r in ids] == reference
        assert decode.kv_tier_stats["host"]["hit_tokens"] == 4 * 120  # 30 pages each, from the host pool
        assert [decode.output(r).num_cached_tokens for r in ids[3:]] == [120] * 4
        # r3-r5: only the new message's pages were sent; r6 held all it needed: nothing was asked for
        assert all(dm.timings[r].nbytes < dm.timings["r0"].nbytes / 4 for r in ids[3:6])
        assert "r6" not in dm.timings
        _all_free(pair)
    finally:
        _close(pm, dm)


def test_never_sends_every_page_the_device_lacks(reference):
    pair = prefill, decode, pm, dm = _pair("never", "never")
    try:
        ids = _serve(pair, _prompts())
        assert [decode.output(r).token_ids for r in ids] == reference
        assert decode.kv_tier_stats["host"]["hit_tokens"] == 0
        assert dm.timings["r3"].nbytes >= dm.timings["r0"].nbytes
        _all_free(pair)
    finally:
        _close(pm, dm)


@pytest.mark.parametrize("token_s, loads", [(1.0, True), (1e-9, False)])
def test_cost_loads_only_what_should_land_before_the_transfer(reference, token_s, loads):
    """The messenger's measured time per prompt token against the host pool's time per page."""
    pair = prefill, decode, pm, dm = _pair(f"cost-{loads}", "cost")
    try:
        ids = _serve(pair, _prompts()[:3])
        dm.token_s["prefill-0"] = token_s  # as if measured: a slow prefill worker, or an instant one
        ids += _serve(pair, _prompts()[3:4], first=3)
        assert [decode.output(r).token_ids for r in ids] == reference[:4]
        assert (decode.kv_tier_stats["host"]["hit_tokens"] == 120) is loads
        _all_free(pair)
    finally:
        _close(pm, dm)


def test_the_messenger_measures_a_prompt_tokens_time_per_peer():
    pair = prefill, decode, pm, dm = _pair("measure", "cost")
    try:
        _serve(pair, _prompts()[:1])
        assert 0 < dm.token_s["prefill-0"] < 60 / 120
        _all_free(pair)
    finally:
        _close(pm, dm)


@pytest.mark.parametrize("which", [3, 6])  # with the rest sent, and with nothing to send
def test_a_load_past_its_deadline_is_computed_after_the_sent_kv_landed(reference, which):
    pair = prefill, decode, pm, dm = _pair(f"late-{which}", "always", store_deadline_s=0.05)
    go = None
    try:
        _serve(pair, _prompts()[:3])
        go = stalled(decode)
        rid = _serve(pair, _prompts()[which : which + 1], first=which)[0]
        go.set()
        assert decode.output(rid).token_ids == reference[which]
        assert decode.kv_tier_stats["host"]["hit_tokens"] == 0  # nothing loaded: it was computed
        _all_free(pair)
    finally:
        if go is not None:
            go.set()
        _close(pm, dm)


def test_an_abort_while_its_pages_load_frees_them_on_both_sides(reference):
    pair = prefill, decode, pm, dm = _pair("abort", "always")
    go = None
    try:
        _serve(pair, _prompts()[:3])
        go = stalled(decode)
        dm.submit("gone", _prompts()[3], GREEDY)
        assert decode.scheduler.aside["gone"].load is not None
        decode.abort("gone")
        dm.abort("gone")
        go.set()
        dm.submit("again", _prompts()[3], GREEDY)  # the same prompt, after: loads it again
        _run(prefill, decode, pm, dm, ["gone", "again"])
        assert decode.output("again").token_ids == reference[3]
        assert decode.output("gone").finish_reason == "abort"
        _all_free(pair)
    finally:
        if go is not None:
            go.set()
        _close(pm, dm)


def test_bad_decode_loads_names_the_field_and_the_allowed_values():
    with pytest.raises(
        ValueError, match=r"kv_tiers.decode_loads must be one of \('cost', 'always', 'never'\)"
    ):
        LLM("tiny-random", role="decode", kv_tiers={"host_bytes": 1 << 20, "decode_loads": "sometimes"})
