"""An engine whose KV cache is e4m3 (cache.kv_dtype='fp8_e4m3'): pages quantized as they are written, a
scale per page, plane and head beside them, dequantized as attention reads them (pdkernels/kv_quant.py);
its prefix cache shares those pages as they are; what it does not cover yet is refused by name."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from tests.engine.test_prefix_cache import _one_by_one, _shared

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
FP8 = {"kv_dtype": "fp8_e4m3", "page_size": 4, "num_pages": 128}


@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
def test_an_fp8_cache_holds_e4m3_pages_and_its_prefix_hits_give_the_tokens_computed_without_them(kv_layout):
    """A full page is written once, by the prefill pass that computes it, so a page found in the prefix
    cache holds the bits its own prompt would have written: the greedy tokens with the cache (batched,
    then again with every prompt's pages cached) are those of one prompt at a time without it."""
    prompts = _shared(8)
    plain = LLM("tiny-random", enable_prefix_caching=False, kv_layout=kv_layout, **FP8)
    arch = plain.config.arch
    assert plain.kv_cache.dtype == torch.float8_e4m3fn  # one byte an element, where the model's are four
    assert plain.model.kv_scales.shape == (arch.num_layers, 128, 2, arch.num_kv_heads)
    reference = _one_by_one(plain, prompts, GREEDY)
    exact = _one_by_one(LLM("tiny-random", enable_prefix_caching=False, kv_layout=kv_layout), prompts, GREEDY)
    assert [o.token_ids for o in reference] != [o.token_ids for o in exact]  # e4m3 changed some token
    llm = LLM("tiny-random", kv_layout=kv_layout, **FP8)
    batched = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == [o.token_ids for o in again] == [o.token_ids for o in reference]
    assert sum(o.num_cached_tokens for o in again) > sum(o.num_cached_tokens for o in batched)
    assert llm.allocator.num_free == 128


def test_tp_ranks_keep_their_heads_pages_and_scales_and_give_the_one_rank_tokens():
    """A scale per page, plane and head: each TP rank quantizes its own heads as one rank would, so TP 2
    gives TP 1's tokens; each rank's cache and scales are views of one region, the lead's mapping of a
    rank's region is that rank's."""
    prompts = _shared(6)
    one = [o.token_ids for o in LLM("tiny-random", **FP8).generate(prompts, GREEDY)]
    with LLM("tiny-random", tp=2, **FP8) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == one
        rank1_region, rank1_cache = llm.kv_regions[1], llm.kv_caches[1]
        assert rank1_cache.dtype == torch.float8_e4m3fn and rank1_region.dtype == torch.uint8
        assert rank1_cache.untyped_storage().data_ptr() == rank1_region.untyped_storage().data_ptr()
        assert rank1_cache.view(torch.uint8).any()  # the rank wrote its pages into what the lead maps
        scales = rank1_region[rank1_cache.numel() :].view(torch.float32)
        assert scales.numel() == llm.config.arch.num_layers * 128 * 2 * (llm.config.arch.num_kv_heads // 2)
        assert (scales != 1.0).any()  # and its scales after them


def test_an_mla_latent_cache_in_e4m3_keeps_a_scale_per_page_and_its_prefix_hits_give_the_same_tokens():
    """DeepSeek's latent cache: one plane of one head, a scale per page of latent rows; what its prefix
    cache shares gives the tokens computed without it, and e4m3 changed some token."""
    prompts = _shared(6)
    plain = LLM("tiny-random-deepseek", enable_prefix_caching=False, **FP8)
    assert plain.model.kv_scales.shape == (plain.config.arch.num_layers, 128, 1, 1)
    reference = _one_by_one(plain, prompts, GREEDY)
    exact = _one_by_one(
        LLM("tiny-random-deepseek", enable_prefix_caching=False, page_size=4), prompts, GREEDY
    )
    assert [o.token_ids for o in reference] != [o.token_ids for o in exact]
    llm = LLM("tiny-random-deepseek", **FP8)
    llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in reference]
    assert sum(o.num_cached_tokens for o in again) > 0 and llm.allocator.num_free == 128


def test_dp_groups_each_keep_their_own_e4m3_pages_and_give_one_engine_s_tokens():
    """DP 2 of DeepSeek (its latent cache in e4m3 in each group, the experts shared): each request's
    pages live in one group, quantized as one engine would, so the tokens are one engine's."""
    from engine.dp import DPLLM

    prompts = _shared(6)
    with LLM("tiny-random-deepseek", **FP8) as one:
        want = [o.token_ids for o in one.generate(prompts, GREEDY)]
    with DPLLM("tiny-random-deepseek", dp=2, **FP8) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want


def test_the_host_pool_brings_evicted_e4m3_pages_back_with_their_scales():
    """A page below device memory is its e4m3 bytes and its scales (LLM.page_tensors): evicted from a
    small cache and loaded back, the prompts that come back give the tokens they give without any cache."""
    import random

    rng = random.Random(0)
    firsts = [[rng.randrange(3, 30000) for _ in range(120)] for _ in range(4)]
    prompts = firsts + [p + [11, 12, 13] for p in firsts]  # each back after the others evicted it
    small = {"kv_dtype": "fp8_e4m3", "page_size": 4, "num_pages": 48, "max_num_seqs": 2}
    reference = _one_by_one(LLM("tiny-random", enable_prefix_caching=False, **small), prompts, GREEDY)
    llm = LLM("tiny-random", kv_tiers={"host_bytes": 4 << 20}, **small)
    outs = _one_by_one(llm, prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert [o.num_cached_tokens for o in outs[4:]] == [120] * 4  # every full page, from the host pool
    arch = llm.config.arch
    page = arch.num_layers * 2 * arch.num_kv_heads * 4 * arch.head_dim  # e4m3: a byte an element
    assert llm.tiers.fmt.payload == page + arch.num_layers * 2 * arch.num_kv_heads * 4  # and its scales
    assert llm.kv_tier_stats["host"]["hit_tokens"] == 480


def test_an_fp8_cache_salts_its_page_names_apart_from_the_model_dtype_s():
    """The same tokens' pages in e4m3 and in the model's dtype are different KV: never the same name."""
    a, b = LLM("tiny-random", page_size=4), LLM("tiny-random", **FP8)
    assert a.scheduler.salt != b.scheduler.salt


@pytest.mark.parametrize(
    "model, overrides, named",
    [
        ("tiny-random", {"kv_dtype": "fp8"}, "kv_dtype must be one of ('auto', 'fp8_e4m3'), got 'fp8'"),
        ("tiny-random", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "got spec"),
    ],
)
def test_what_an_fp8_cache_does_not_cover_yet_is_refused_by_name(model, overrides, named):
    settings = {"kv_dtype": "fp8_e4m3", **overrides}
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        LLM(model, **settings) if model != "tiny-random" else EngineConfig.of(model, **settings)
