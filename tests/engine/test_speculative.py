"""Speculative decoding (ngram): lossless at temperature 0, distribution-preserving otherwise, no page
left behind; colocated and as the decode half of a 1P1D pair."""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.speculative import SpeculativeConfig, ngram_drafts, verify_greedy, verify_sampled
from tests.kept import keep_outputs

REPEATING = [
    "The fox jumps over the dog. The fox jumps over the dog. The fox jumps over the",
    "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3,",
    "def f(x): return x + 1\ndef g(x): return x + 1\ndef h(x):",
]


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(rng.choice([1, 5, 17, 40]))] for _ in range(n)]


def test_ngram_drafts_follow_the_latest_match_longest_first():
    assert ngram_drafts([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [7, 1]  # the latest [1, 2, 3]
    assert ngram_drafts([5, 6, 5], 3, 1, 2) == [6, 5]  # n=2 [6, 5] has no earlier match; n=1 [5] does
    assert ngram_drafts([1, 2, 3], 2, 1, 3) == []


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize(
    "kwargs",
    [
        {"page_size": 4, "num_pages": 256},
        {
            "page_size": 4,
            "num_pages": 40,
            "max_num_batched_tokens": 24,
            "max_num_seqs": 5,
        },  # chunks, preemption
    ],
)
def test_greedy_outputs_with_speculation_equal_those_without(k, kwargs):
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = REPEATING + _prompts(8)
    plain = LLM("tiny-random", **kwargs).generate(prompts, greedy)
    llm = LLM("tiny-random", speculative_config={"method": "ngram", "num_speculative_tokens": k}, **kwargs)
    spec = llm.generate(prompts, greedy)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.num_accepted_tokens for o in spec) > 0 and sum(o.num_drafted_tokens for o in spec) > 0
    assert all(o.num_accepted_tokens <= o.num_drafted_tokens for o in spec)
    assert llm.allocator.num_free == llm.allocator.num_pages


def test_smollm2_greedy_with_speculation_equals_without():
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = LLM("smollm2-135m", num_pages=64).generate(REPEATING[:2], greedy)
    spec = LLM("smollm2-135m", num_pages=64, speculative_config={"num_speculative_tokens": 4}).generate(
        REPEATING[:2], greedy
    )
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.num_accepted_tokens for o in spec) > 0


def test_rejection_sampling_keeps_the_target_distribution():
    """A point-mass draft of token 2 against p: the first token's frequencies match p (fixed seed)."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    probs = torch.stack([p, torch.full((5,), 0.2)])
    g = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.zeros(5)
    accepted = 0
    for _ in range(n):
        tokens, acc = verify_sampled(probs, [2], g)
        counts[tokens[0]] += 1
        accepted += acc
    freq = counts / n
    assert torch.allclose(freq, p, atol=0.012), freq  # about 3.5 standard errors at n = 20000
    assert abs(accepted / n - 0.3) < 0.012  # a draft is accepted with probability p(draft)


def test_greedy_verify_accepts_the_matching_prefix_then_the_targets_token():
    logits = torch.full((4, 6), -1.0)
    for row, best in enumerate([3, 1, 5, 0]):
        logits[row, best] = 1.0
    assert verify_greedy(logits, [3, 1, 2]) == ([3, 1, 5], 2)
    assert verify_greedy(logits, [3, 1, 5]) == ([3, 1, 5, 0], 3)
    assert verify_greedy(logits, [4, 1, 5]) == ([3], 0)


def test_hundred_requests_with_speculation_stops_and_aborts_leave_no_page_behind():
    llm = LLM(
        "tiny-random",
        page_size=4,
        num_pages=160,
        max_num_seqs=8,
        max_num_batched_tokens=48,
        speculative_config={"num_speculative_tokens": 3},
    )
    keep_outputs(llm)
    rng = random.Random(5)
    ids = []
    for i, prompt in enumerate(REPEATING * 10 + [p for p in _prompts(70, seed=2)]):
        params = SamplingParams(
            max_tokens=rng.randint(1, 24),
            temperature=rng.choice([0.0, 0.0, 0.9]),
            seed=i,
            stop=rng.choice([(), ("e",), ("the", "a")]),
        )
        ids.append(llm.add_request(prompt, params))
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
        if steps % 4 == 0:
            llm.abort(rng.choice(ids))
    outs = [llm.output(i) for i in ids]
    assert all(o.finished for o in outs) and {o.finish_reason for o in outs} >= {"abort", "length"}
    assert sum(o.num_accepted_tokens for o in outs) > 0
    assert llm.allocator.num_free == 160 and not llm.seqs


def test_speculative_config_is_checked():
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig.of({"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
        SpeculativeConfig.of({"num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown key"):
        SpeculativeConfig.of({"num_speculative": 2})


def test_speculation_with_tensor_parallelism_gives_the_tp1_tokens():
    """The TP ranks mirror each verify chunk (its drafts are in the step's input ids)."""
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = LLM("tiny-random", page_size=4, num_pages=64).generate(REPEATING, greedy)
    with LLM(
        "tiny-random", tp=2, page_size=4, num_pages=64, speculative_config={"num_speculative_tokens": 3}
    ) as llm:
        spec = llm.generate(REPEATING, greedy)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.num_accepted_tokens for o in spec) > 0
