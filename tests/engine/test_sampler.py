import pytest
import torch

from engine.sampler import logprobs_of, probabilities, processed, sample
from engine.sequence import SamplingParams, Sequence


def _seqs(params, prompt=(5, 6), outputs=()):
    out = []
    for p in params:
        seq = Sequence("r", list(prompt), p)
        seq.output_ids = list(outputs)
        out.append(seq)
    return out


def test_greedy_and_top_k_1_pick_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1)] * 2
    assert sample(logits, _seqs(params)) == logits.argmax(-1).tolist()


def test_seeded_sampling_repeats_and_top_p_keeps_the_head():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=7)
    draws = [sample(logits, _seqs([p]))[0] for _ in range(2)]
    assert draws[0] == draws[1]
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-6)
    assert sample(logits, _seqs([tiny_p])) == logits.argmax(-1).tolist()


def test_temperature_spreads_the_draws():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    seq = _seqs([SamplingParams(temperature=1.0, seed=0)])
    draws = [sample(logits, seq)[0] for _ in range(300)]
    counts = [draws.count(i) for i in range(3)]
    assert counts[0] > counts[1] > counts[2] > 0  # softmax([2, 1, 0]) = 0.67, 0.24, 0.09


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"temperature": -1}, "temperature must be 0 \\(greedy\\) or in \\[0.01, 100"),
        ({"temperature": 1e-300}, "temperature must be 0 \\(greedy\\) or in \\[0.01, 100"),
        ({"top_p": 0}, "top_p must be in"),
        ({"top_p": 1e-300}, "top_p must be in \\[1e-06, 1\\]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in \\[-2, 2\\]"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in \\[-2, 2\\]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in \\[0.01, 100.0\\]"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty must be in \\[0.01, 100.0\\]"),
        ({"min_p": 1.5}, "min_p must be in \\[0, 1\\]"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be in \\[0, max_tokens=10\\]"),
        ({"logit_bias": {3: 101}}, "logit_bias\\[3\\] must be in \\[-100, 100\\]"),
        ({"logit_bias": {-1: 1}}, "logit_bias keys must be token ids"),
        ({"stop_token_ids": [-2]}, "stop_token_ids must be a list of token ids"),
        ({"logprobs": 21}, "logprobs must be None or an integer in \\[0, 20\\]"),
        ({"logprobs": -1}, "logprobs must be None or an integer in \\[0, 20\\]"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def _reference(logits, prompt, outputs, p, eos=()):
    """vLLM's processing written out in plain torch, one token at a time."""
    row = logits.clone().double()
    for t, b in (p.logit_bias or {}).items():
        row[t] += b
    if len(outputs) < p.min_tokens:
        for t in (*eos, *p.stop_token_ids):
            row[t] = float("-inf")
    for t in set(prompt) | set(outputs):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(outputs):
        row[t] -= p.frequency_penalty * outputs.count(t) + p.presence_penalty
    return row.float()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.7},
        {"presence_penalty": -0.5, "frequency_penalty": -1.0},
        {"repetition_penalty": 1.3},
        {"repetition_penalty": 0.8},
        {"logit_bias": {7: 5.0, 9: -100}},
        {"min_tokens": 4, "stop_token_ids": (11, 12)},
        {"min_tokens": 3},  # only EOS barred
        {"repetition_penalty": 1.2, "frequency_penalty": 0.3, "presence_penalty": 0.2, "logit_bias": {3: 2}},
    ],
)
def test_processed_logits_match_the_torch_reference(kwargs):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 3
    prompt, outputs = [1, 2, 3, 3, 40], [7, 7, 9, 3, 50]
    p = SamplingParams(max_tokens=16, **kwargs)
    seq = _seqs([p], prompt, outputs[:2])[0]
    want = _reference(logits, prompt, outputs, p, eos=(13,))
    got = processed(logits, seq, (13,), drafted=outputs[2:])  # drafts count as outputs before the row
    torch.testing.assert_close(got, want)
    assert processed(logits, _seqs([SamplingParams()])[0]) is not logits  # a copy, never the model's row


def test_min_p_keeps_tokens_within_its_fraction_of_the_likeliest():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04]))
    probs = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.15))  # 0.15 * 0.5 = 0.075
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.1, 0, 0]) / 0.9)


def test_penalties_and_bias_change_greedy_picks_too():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    assert sample(logits, _seqs([SamplingParams()], outputs=[1])) == [1]
    assert sample(logits, _seqs([SamplingParams(presence_penalty=1.5)], outputs=[1])) == [2]
    assert sample(logits, _seqs([SamplingParams(logit_bias={0: 10})])) == [0]
    assert sample(logits, _seqs([SamplingParams(min_tokens=2, stop_token_ids=[1])], outputs=[2])) == [2]


def test_logprobs_are_the_models_log_softmax_with_ranks():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(5))
    want = torch.log_softmax(logits, -1)
    picked = [int(want[0].argmax()), int(want[1].argsort()[-5]), 17]
    entries = logprobs_of(logits, picked, 3)
    for row, token, entry in zip(want, picked, entries, strict=True):
        assert next(iter(entry)) == token  # the picked token first
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-5)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(3)
        for rank, (value, t) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
            assert entry[t].logprob == pytest.approx(value, abs=1e-5) and entry[t].rank == rank
        assert len(entry) == 3 + (token not in top.indices.tolist())
    assert entries[1][picked[1]].rank == 5
    assert [list(e) for e in logprobs_of(logits, picked, 0)] == [[t] for t in picked]


# ---- through the engine (tiny-random: random weights, so greedy outputs are arbitrary but fixed) ----


@pytest.fixture(scope="module")
def tiny():
    from engine import LLM

    return LLM("tiny-random", page_size=4, num_pages=128)


PROMPT = [11, 200, 3000, 45, 45, 45, 7]


def test_logit_bias_stop_token_ids_and_min_tokens_in_generate(tiny):
    base = tiny.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    forced = tiny.generate([PROMPT], SamplingParams(max_tokens=5, ignore_eos=True, logit_bias={1234: 100}))
    assert forced[0].token_ids == [1234] * 5
    stop = base[0]
    cut = tiny.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[stop]))[0]
    assert cut.token_ids == [stop] and cut.finish_reason == "stop"
    late = SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[stop], min_tokens=6)
    held = tiny.generate([PROMPT], late)[0]
    assert stop not in held.token_ids[:6] and len(held.token_ids) > 6
    assert tiny.allocator.num_free == tiny.allocator.num_pages


def test_repetition_penalty_stops_a_greedy_loop(tiny):
    loop = [45] * 12
    plain = tiny.generate([loop], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    penalized = SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=100.0)
    seen = tiny.generate([loop], penalized)[0].token_ids
    assert len(set(seen)) == 12 and 45 not in seen  # each token already there is pushed down
    assert len(set(plain)) < 12 or plain != seen


def test_stop_strings_wait_for_min_tokens_and_can_be_kept():
    from engine import LLM

    llm = LLM("tiny-random", page_size=4, num_pages=64)
    out = llm.generate("Hello there", SamplingParams(max_tokens=20, ignore_eos=True))[0]
    stop = out.text[len(out.text) // 2 :][:3]
    kept = SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True)
    cut = llm.generate("Hello there", kept)[0]
    assert cut.finish_reason == "stop" and cut.text.endswith(stop) and out.text.startswith(cut.text)
    late = SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,), min_tokens=20)
    assert llm.generate("Hello there", late)[0].text == out.text  # no stop before 20 tokens


def test_logprobs_of_decode_steps_equal_a_prefill_of_the_same_tokens(tiny):
    """The value at each output position (computed by a decode step over the paged cache) equals the one
    a fresh prefill of prompt + the outputs before it gives: two paths, one distribution."""
    out = tiny.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=4))[0]
    assert out.outputs[0].logprobs == out.logprobs and len(out.logprobs) == 6
    for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert next(iter(entry)) == token and entry[token].rank == 1  # greedy picks the top one
        assert 4 <= len(entry) <= 5 and entry[token].decoded_token == tiny.tokenizer.decode([token])
        tiny.reset_prefix_cache()
        again = tiny.generate([PROMPT + out.token_ids[:j]], SamplingParams(max_tokens=1, logprobs=4))[0]
        for t, lp in again.logprobs[0].items():
            assert entry[t].logprob == pytest.approx(lp.logprob, abs=1e-4) and entry[t].rank == lp.rank
    assert tiny.generate([PROMPT], SamplingParams(max_tokens=2))[0].logprobs is None  # only when asked


def test_speculation_with_penalties_and_bias_stays_lossless():
    """Drafted rows are processed with the drafts before them as outputs: greedy tokens and logprobs equal
    those without speculation (the verify path is the same for every proposer; ngram drafts here)."""
    from engine import LLM

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    prompts = [[5, 6, 7, 8] * 6, [9, 10] * 10, PROMPT]
    params = SamplingParams(
        max_tokens=16,
        ignore_eos=True,
        repetition_penalty=1.1,
        frequency_penalty=0.2,
        logit_bias={6: 1.0},
        min_tokens=4,
        stop_token_ids=[10],
        logprobs=2,
    )
    plain = LLM("tiny-random", page_size=4, num_pages=128).generate(prompts, params)
    llm = LLM("tiny-random", page_size=4, num_pages=128, speculative_config=spec)
    fast = llm.generate(prompts, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    for a, b in zip(fast, plain, strict=True):
        assert [list(e) for e in a.logprobs] == [list(e) for e in b.logprobs]
        for ea, eb in zip(a.logprobs, b.logprobs, strict=True):
            assert [lp.logprob for lp in ea.values()] == pytest.approx(
                [lp.logprob for lp in eb.values()], abs=1e-4
            )
    assert sum(o.num_drafted_tokens for o in fast) > 0
    assert llm.allocator.num_free == llm.allocator.num_pages


def test_n_completions_share_one_prompt_computation(tiny):
    """n = 3: the first completion computes the prompt; the others start once its KV is cached and
    compute only the last partial page; seeds seed, seed + 1, seed + 2; every page free after."""
    prompt = list(range(100, 131))  # 31 tokens: 7 full pages of 4, then 3 tokens
    tiny.reset_prefix_cache()
    out = tiny.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True)
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 6 for c in out.outputs)
    for i, c in enumerate(out.outputs):
        tiny.reset_prefix_cache()
        alone = tiny.generate(
            [prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=11 + i, ignore_eos=True)
        )
        assert c.token_ids == alone[0].token_ids
    tiny.reset_prefix_cache()
    before = tiny.prefix_cache_stats["hits"]
    tiny.generate([prompt], SamplingParams(max_tokens=2, n=3, ignore_eos=True))
    assert tiny.prefix_cache_stats["hits"] - before == 2 * 28  # siblings: 7 pages each from the first
    greedy = tiny.generate([prompt], SamplingParams(max_tokens=5, n=2, ignore_eos=True))[0].outputs
    assert greedy[0].token_ids == greedy[1].token_ids
    assert tiny.allocator.num_free == tiny.allocator.num_pages
    with pytest.raises(ValueError, match="generate"):
        tiny.add_request(prompt, SamplingParams(n=2))
    with pytest.raises(ValueError, match="n must be an integer in \\[1, 64\\]"):
        SamplingParams(n=0)


def test_a_later_completion_waits_for_the_first_without_holding_up_others():
    """add_request(after=): the second completion of a prompt waits, out of the queue, until the first
    one's prompt KV is computed, then shares its pages; a request queued behind it goes on meanwhile."""
    from engine import LLM

    llm = LLM("tiny-random", page_size=4, num_pages=64, max_num_batched_tokens=20)
    prompt, other = list(range(100, 131)), list(range(400, 410))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    llm.add_request(prompt, params, "a")
    llm.add_request(prompt, params, "b", after="a")
    llm.add_request(other, params, "c")
    llm.step()  # a: 20 of its 31 prompt tokens
    llm.step()  # a: the other 11; b waits for them; c, behind b, takes the 9 tokens left
    assert [llm.core.seqs[r].num_computed for r in "abc"] == [31, 0, 9]
    done = {}
    while llm.has_unfinished():
        done.update((o.request_id, o) for o in llm.step() if o.finished)
    assert done["b"].num_cached_tokens == 28 and done["a"].num_cached_tokens == 0  # 7 pages of 4
    assert llm.allocator.num_free == llm.allocator.num_pages
    llm.add_request(prompt, params, "d", after="nobody")  # an unknown first one: an ordinary request
    llm.add_request(other, params, "e", after="d")  # not the same prompt: ordinary too
    assert llm.core.seqs["d"].after is None and llm.core.seqs["e"].after is None
    with pytest.raises(ValueError, match="n=2: add_request takes one completion"):
        llm.add_request(prompt, SamplingParams(n=2))
