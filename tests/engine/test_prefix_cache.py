"""Prefix caching in the engine (engine/kv/cache.py, engine/scheduler.py): shared leading pages are not
computed again, and greedy outputs are the same as without the cache, through chunked prefill,
preemption, speculative decoding and TP."""

import random

import pytest

from engine import LLM, SamplingParams
from engine.kv.cache import page_hashes
from tests.kept import keep_outputs

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def _shared(n, seed=0, system=37):
    """n prompts that start with one system prompt of `system` tokens, then 1-40 tokens of their own."""
    rng = random.Random(seed)
    head = [rng.randrange(3, 49000) for _ in range(system)]
    return [head + [rng.randrange(3, 49000) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def _one_by_one(llm, prompts, params=GREEDY):
    return [llm.generate([p], params)[0] for p in prompts]


def test_a_repeated_prompt_shares_its_full_pages_and_computes_the_rest():
    llm = LLM("tiny-random", page_size=4, num_pages=64)
    prompt = list(range(100, 122))  # 22 tokens: 5 full pages
    first, again = _one_by_one(llm, [prompt, prompt])
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 20
    assert again.token_ids == first.token_ids
    exact = list(range(200, 220))  # 20 tokens, a whole number of pages: the last one is computed
    _one_by_one(llm, [exact])
    assert _one_by_one(llm, [exact])[0].num_cached_tokens == 16
    assert _one_by_one(llm, [[7, 8, 9]])[0].num_cached_tokens == 0  # no full page to share
    stats = llm.prefix_cache_stats
    assert stats["hits"] == 36 and stats["queries"] == 22 + 22 + 20 + 20 + 3
    assert llm.allocator.num_free == 64  # cached pages count as free


@pytest.mark.parametrize(
    "kwargs",
    [
        {"page_size": 4, "num_pages": 512},
        {"page_size": 8, "num_pages": 512, "max_num_batched_tokens": 24},  # chunked prefill
        # pressure: preemption and recompute, and eviction of cached pages
        {
            "page_size": 4,
            "num_pages": 40,
            "max_num_batched_tokens": 64,
            "max_num_seqs": 6,
            "reserved_tokens": 0,
        },
    ],
)
def test_greedy_outputs_with_the_cache_equal_those_without(kwargs):
    prompts = _shared(12) + _shared(4, seed=1)
    plain = LLM("tiny-random", enable_prefix_caching=False, **kwargs)
    reference = _one_by_one(plain, prompts)
    assert all(o.num_cached_tokens == 0 for o in reference) and plain.allocator.num_cached == 0
    llm = LLM("tiny-random", **kwargs)
    batched = llm.generate(prompts, GREEDY)  # all at once: later ones hit pages earlier ones named
    assert [o.token_ids for o in batched] == [o.token_ids for o in reference]
    again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in reference]
    assert sum(o.num_cached_tokens for o in again) > sum(o.num_cached_tokens for o in batched) > 0
    assert llm.allocator.num_free == kwargs["num_pages"]
    if kwargs.get("reserved_tokens") == 0:
        assert llm.preemption_stats["preemptions"] > 0 and llm.allocator.num_evicted > 0


def test_a_conversation_reuses_its_history_prompt_and_reply():
    """Turn 2's prompt is turn 1's prompt, its reply and a new message: all of turn 1's full pages hit
    (the reply's too: pages a request filled while decoding are named)."""
    llm = LLM("tiny-random", page_size=4, num_pages=128)
    plain = LLM("tiny-random", page_size=4, num_pages=128, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=13, ignore_eos=True)
    turn, expected = _shared(1)[0], 0
    for _ in range(4):
        out = llm.generate([turn], params)[0]
        assert out.token_ids == plain.generate([turn], params)[0].token_ids
        assert out.num_cached_tokens == expected
        history = turn + out.token_ids
        expected = ((len(history) - 1) // 4) * 4  # the last reply token's KV was never computed
        turn = history + [11, 12, 13, 14, 15]
    assert expected > 60


def test_reset_forgets_cached_pages_but_not_pages_in_use():
    llm = LLM("tiny-random", page_size=4, num_pages=64)
    keep_outputs(llm)
    prompt = list(range(100, 130))
    _one_by_one(llm, [prompt])
    assert llm.allocator.num_cached > 0
    llm.add_request(prompt, GREEDY, request_id="live")
    llm.step()  # "live" shares the cached pages
    assert llm.output("live").num_cached_tokens == 28
    dropped = llm.reset_prefix_cache()
    assert dropped > 0 and llm.allocator.num_cached == 0
    while llm.has_unfinished():
        llm.step()
    assert llm.output("live").token_ids == _one_by_one(llm, [prompt])[0].token_ids
    assert llm.allocator.num_free == 64


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculative_decoding_with_the_cache_is_lossless_and_caches_no_draft(method):
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "mtp":
        spec["model"] = "random"
    repeating = [1, 2, 3, 4, 5, 6, 7, 8] * 5
    prompts = [repeating + [9, 10], repeating + [11], _shared(1)[0], _shared(1)[0] + [5]]
    kwargs = {"page_size": 4, "num_pages": 96, "max_num_batched_tokens": 32}
    reference = _one_by_one(LLM("tiny-random", enable_prefix_caching=False, **kwargs), prompts)
    llm = LLM("tiny-random", speculative_config=spec, **kwargs)
    outs = _one_by_one(llm, prompts)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert outs[1].num_cached_tokens > 0 and outs[3].num_cached_tokens > 0
    if method == "mtp":  # the head's input before the last prompt token is computed, never cached
        assert all(len(o.prompt_token_ids) - o.num_cached_tokens >= 2 for o in outs)
    # every cached page holds a prefix of some request's tokens that were confirmed, not drafted
    confirmed = [o.prompt_token_ids + o.token_ids for o in outs]
    names = {h for ids in confirmed for h in page_hashes(ids, 4, llm.scheduler.salt, [])}
    assert set(llm.allocator._page) <= names


def test_tp2_shares_pages_on_every_rank():
    prompts = _shared(6, seed=2)
    reference = _one_by_one(
        LLM("tiny-random", page_size=4, num_pages=64, enable_prefix_caching=False), prompts
    )
    with LLM("tiny-random", tp=2, page_size=4, num_pages=64) as llm:
        outs = _one_by_one(llm, prompts)
        assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
        assert all(o.num_cached_tokens == 36 for o in outs[1:])


def test_prefill_role_computes_only_what_its_cache_lacks():
    prefill = LLM("tiny-random", role="prefill", page_size=4, num_pages=64)
    keep_outputs(prefill)
    for rid, prompt in (("a", list(range(100, 133))), ("b", list(range(100, 130)) + [5, 6])):
        prefill.add_request(prompt, GREEDY, request_id=rid)
        computed = 0
        while prefill.has_unfinished():
            prefill.step()
            computed += prefill.core.last_step.prefill_tokens if prefill.core.last_step else 0
            prefill.core.last_step = None
        assert prefill.output(rid).finish_reason == "prefilled"
        assert computed == (33 if rid == "a" else 32 - 28)
        prefill.handoff.release(rid)
    assert prefill.allocator.num_free == 64


def test_requests_of_different_cache_salts_share_no_page():
    """cache_salt (vLLM's): the same prompt under another salt finds nothing cached (no timing or
    cached_tokens oracle across tenants); under its own salt it finds its prefix; no salt is a salt of
    its own too."""
    from engine import LLM, SamplingParams

    llm = LLM("tiny-random", page_size=4, num_pages=128)
    prompt = list(range(10, 60))

    def cached(salt):
        out = llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True, cache_salt=salt))[0]
        return out.num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # another tenant's prefix is not found
    assert cached(None) == 0
    assert cached("tenant-a") == 48 and cached("tenant-b") == 48 and cached(None) == 48
    greedy = [llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True, cache_salt=s))[0].token_ids
              for s in ("tenant-a", "tenant-c")]  # fmt: skip
    assert greedy[0] == greedy[1]  # the same tokens, cached or not
