"""Speculative decoding (ngram, and the MTP head of engine/mtp.py): lossless at temperature 0,
distribution-preserving otherwise, no page left behind; colocated and with TP (1P1D: tests/transfer)."""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.mtp import random_head_weights
from engine.speculative import SpeculativeConfig, ngram_drafts, verify_greedy, verify_sampled
from pdkernels.testing import all_pairs
from tests.heads import bigram, echo_head
from tests.kept import keep_outputs

REPEATING = [
    "The fox jumps over the dog. The fox jumps over the dog. The fox jumps over the",
    "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3,",
    "def f(x): return x + 1\ndef g(x): return x + 1\ndef h(x):",
]


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    return echo_head(tmp_path_factory.mktemp("heads") / "echo.safetensors")


def _spec(method, k, echo):
    """ngram; mtp with the echo head (most drafts accepted on tiny-random) or a random one (almost none)."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    return {"method": "mtp", "num_speculative_tokens": k, "model": echo if method == "mtp-echo" else "random"}


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(rng.choice([1, 5, 17, 40]))] for _ in range(n)]


def test_ngram_drafts_follow_the_latest_match_longest_first():
    assert ngram_drafts([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [7, 1]  # the latest [1, 2, 3]
    assert ngram_drafts([5, 6, 5], 3, 1, 2) == [6, 5]  # n=2 [6, 5] has no earlier match; n=1 [5] does
    assert ngram_drafts([1, 2, 3], 2, 1, 3) == []


SETTINGS = [
    {"page_size": 4, "num_pages": 256},
    {"page_size": 4, "num_pages": 40, "max_num_batched_tokens": 24, "max_num_seqs": 5},  # chunks, preemption
]
_PLAIN: dict[int, list[list[int]]] = {}  # greedy tokens without speculation, per setting


@pytest.mark.parametrize(  # every pair of (method, k, setting): 6 cases, not 12
    "method,k,setting", all_pairs(["ngram", "mtp-echo", "mtp-random"], [2, 4], range(len(SETTINGS)))
)
def test_greedy_outputs_with_speculation_equal_those_without(method, k, setting, echo):
    greedy, kwargs = SamplingParams(max_tokens=20, ignore_eos=True), SETTINGS[setting]
    prompts = REPEATING + _prompts(8)
    if setting not in _PLAIN:
        _PLAIN[setting] = [o.token_ids for o in LLM("tiny-random", **kwargs).generate(prompts, greedy)]
    llm = LLM("tiny-random", speculative_config=_spec(method, k, echo), **kwargs)
    spec = llm.generate(prompts, greedy)
    assert [o.token_ids for o in spec] == _PLAIN[setting]
    assert sum(o.num_drafted_tokens for o in spec) > 0
    assert (sum(o.num_accepted_tokens for o in spec) > 0) == (method != "mtp-random")
    assert all(o.num_accepted_tokens <= o.num_drafted_tokens for o in spec)
    assert llm.allocator.num_free == llm.allocator.num_pages


@pytest.mark.slow  # make test-all: make test checks speculation lossless on the tiny models, every method
def test_smollm2_greedy_with_speculation_equals_without():
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = LLM("smollm2-135m", num_pages=64).generate(REPEATING[:2], greedy)
    spec = LLM("smollm2-135m", num_pages=64, speculative_config={"num_speculative_tokens": 4}).generate(
        REPEATING[:2], greedy
    )
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.num_accepted_tokens for o in spec) > 0
    mtp = {"method": "mtp", "num_speculative_tokens": 2, "model": "random"}  # SmolLM2 has no MTP layer
    spec = LLM("smollm2-135m", num_pages=64, speculative_config=mtp).generate(REPEATING[:1], greedy)
    assert spec[0].token_ids == plain[0].token_ids and spec[0].num_drafted_tokens > 0


def test_mtp_echo_head_on_a_bigram_target_has_every_draft_accepted_a_random_head_almost_none(echo):
    """The accept path end to end (each verify step appends k + 1 tokens), and the reject-and-roll-back
    path (each appends one), against the same target."""
    greedy = SamplingParams(max_tokens=25, ignore_eos=True)
    prompts = REPEATING + _prompts(4, seed=7)
    plain = bigram(LLM("tiny-random", page_size=4, num_pages=128)).generate(prompts, greedy)
    for head, low, high in ((echo, 1.0, 1.0), ("random", 0.0, 0.05)):
        llm = bigram(
            LLM(
                "tiny-random",
                page_size=4,
                num_pages=128,
                speculative_config={"method": "mtp", "num_speculative_tokens": 3, "model": head},
            )
        )
        spec = llm.generate(prompts, greedy)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        drafted, accepted = (
            sum(getattr(o, f) for o in spec) for f in ("num_drafted_tokens", "num_accepted_tokens")
        )
        assert drafted > 0 and low <= accepted / drafted <= high, (head, accepted, drafted)
        if head == echo:  # the first token from the prompt's pass, then 4 per verify step (3 + the target's)
            assert all(o.num_verify_steps == 6 for o in spec)
        assert llm.allocator.num_free == 128


def test_mtp_head_weights_are_checked(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(ValueError, match="model is the mtp head's weights"):
        SpeculativeConfig.of({"method": "ngram", "model": "random"})
    with pytest.raises(ValueError, match="no MTP head in the target checkpoint"):
        LLM("tiny-random", speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="existing .safetensors file"):
        LLM("tiny-random", speculative_config={"method": "mtp", "model": str(tmp_path / "none.safetensors")})
    head = random_head_weights(LLM("tiny-random", num_pages=4).config.arch)
    head["eh_proj.weight"] = head["eh_proj.weight"][:, :10].contiguous()
    save_file(head, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=r"eh_proj.weight .* has shape \(128, 10\), not \(128, 256\)"):
        LLM("tiny-random", speculative_config={"method": "mtp", "model": str(tmp_path / "bad.safetensors")})
    del head["hnorm.weight"]
    save_file(head, str(tmp_path / "short.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['hnorm.weight'\]"):
        LLM("tiny-random", speculative_config={"method": "mtp", "model": str(tmp_path / "short.safetensors")})


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


@pytest.mark.parametrize("method", ["ngram", "mtp-echo"])
def test_hundred_requests_with_speculation_stops_and_aborts_leave_no_page_behind(method, echo):
    llm = LLM(
        "tiny-random",
        page_size=4,
        num_pages=160,
        max_num_seqs=8,
        max_num_batched_tokens=48,
        speculative_config=_spec(method, 3, echo),
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
    assert llm.allocator.num_free == 160 and not llm.core.seqs


def test_speculative_config_is_checked():
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig.of({"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
        SpeculativeConfig.of({"num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown key"):
        SpeculativeConfig.of({"num_speculative": 2})


@pytest.mark.parametrize("method", ["ngram", "mtp-echo"])
def test_speculation_with_tensor_parallelism_gives_the_tp1_tokens(method, echo):
    """The TP ranks mirror each verify chunk (its drafts are in the step's input ids); the MTP head runs on
    the lead rank, from the full hidden states."""
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = LLM("tiny-random", page_size=4, num_pages=64).generate(REPEATING, greedy)
    with LLM(
        "tiny-random", tp=2, page_size=4, num_pages=64, speculative_config=_spec(method, 3, echo)
    ) as llm:
        spec = llm.generate(REPEATING, greedy)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.num_accepted_tokens for o in spec) > 0
