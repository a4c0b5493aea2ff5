"""The CUDA-graph decode path's buffers and padding, run eagerly on the CPU (the capture itself is
checked on a GPU: tests/engine/test_gpu.py)."""

import random

import pytest

from engine import LLM, SamplingParams
from engine.graphs import DecodeGraphs, buckets_for

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(rng.choice([1, 3, 9, 30]))] for _ in range(n)]


def test_buckets_cover_max_num_seqs():
    assert buckets_for(1) == (1,)
    assert buckets_for(5) == (1, 2, 4, 8)
    assert buckets_for(64) == (1, 2, 4, 8, 16, 32, 64)
    assert buckets_for(1000)[-1] == 256


@pytest.mark.parametrize("num_prompts", [1, 5, 11])
def test_padded_static_decode_gives_the_eager_tokens(num_prompts):
    """5 sequences run in the bucket of 8 (three padding rows on the scratch page), 11 in 16; tokens equal
    a plain engine's, and no request ever owns the scratch page."""
    prompts = _prompts(num_prompts)
    plain = LLM("tiny-random", page_size=4, num_pages=128).generate(prompts, GREEDY)
    llm = LLM("tiny-random", page_size=4, num_pages=128)
    graphs = DecodeGraphs(llm.model, llm.kv_cache, 4, scratch_page=127, max_num_seqs=64, capture=False)
    llm.runner.graphs = graphs
    owned = []
    step = llm.step

    def watched():
        owned.extend(p for rid in llm.core.seqs for p in llm.allocator.pages(rid))
        return step()

    llm.step = watched
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert graphs.replays >= 7 and 127 not in owned


def test_cuda_graphs_need_a_cuda_device():
    with pytest.raises(ValueError, match="cuda_graphs=True needs device='cuda'"):
        LLM("tiny-random", page_size=4, num_pages=16, cuda_graphs=True)


def test_each_replay_writes_the_steps_own_split_plan():
    """The graph's split-length buffer holds, after each step's fill, what an eager launch would plan from
    that step's page tables (live_split_len), not one planned from the buffers' size."""
    from pdkernels.splits import live_split_len

    llm = LLM("tiny-random", page_size=4, num_pages=128)
    graphs = DecodeGraphs(llm.model, llm.kv_cache, 4, scratch_page=127, max_num_seqs=8, capture=False)
    pages = [list(range(0, 30)), list(range(30, 32))]  # 117 and 6 tokens
    graphs.run([5, 6], [116, 5], pages)
    heads = llm.model.shard.num_kv_heads
    assert int(graphs.split_len) == live_split_len(4 * (32 + 0), 117, heads, llm.kv_cache.device)
    meta = graphs._meta(2)
    assert meta.split_len is graphs.split_len and meta.num_splits >= 1
