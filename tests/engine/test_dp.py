"""Data-parallel attention (engine/dp.py): dp engines, each with its own requests and KV pages, the
routed experts spread over every rank and reached through an all-to-all, give the tokens of one engine."""

import json
import random

import pytest

from engine import DPLLM, LLM, SamplingParams, StructuredOutputs, make_llm
from engine.config import ModelConfig
from engine.dp import EngineDied
from engine.model import Shard
from engine.weights import load_model

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
MODELS = ("tiny-random-deepseek", "tiny-random-moe")


def _prompts(n=6, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(rng.choice([1, 5, 17, 40]))] for _ in range(n)]


@pytest.fixture(scope="module")
def one_engine():
    """Each model's greedy tokens from one engine (dp 1, tp 1, fp32)."""
    out = {}
    for name in MODELS:
        with LLM(name, page_size=4, num_pages=64) as llm:
            out[name] = [o.token_ids for o in llm.generate(_prompts(), GREEDY)]
    return out


def _run(llm, prompts, **kw):
    ids = [llm.add_request(p, GREEDY, **kw) for p in prompts]
    ranks = [llm.front.dp_rank_of(r) for r in ids]
    done = {}
    while llm.has_unfinished():
        done.update((o.request_id, o) for o in llm.step() if o.finished)
    return [done[r] for r in ids], ranks


@pytest.mark.parametrize(
    "name, tp",
    [(name, tp) for name in MODELS for tp in (1, 2) if (name, tp) != ("tiny-random-moe", 2)]
    + [pytest.param("tiny-random-moe", 2, marks=pytest.mark.slow)],  # make test: DeepSeek's at tp 2
)
def test_dp2_gives_the_tokens_of_one_engine(one_engine, name, tp):
    """Requests spread over both groups (the fewer requests first), and all of them on group 1 while
    group 0 has none (its ranks join every all-to-all idle): the tokens of dp 1 either way."""
    with DPLLM(name, dp=2, tp=tp, page_size=4, num_pages=64) as llm:
        outs, ranks = _run(llm, _prompts())
        assert ranks == [0, 1] * 3
        assert [o.token_ids for o in outs] == one_engine[name]
        assert [o.prompt_token_ids for o in outs] == _prompts()
        outs, ranks = _run(llm, _prompts()[:3], dp_rank=1)
        assert ranks == [1] * 3 and [o.token_ids for o in outs] == one_engine[name][:3]
        assert llm.allocator.num_free == 64 and not llm.has_unfinished()


def test_dp2_in_bf16_gives_the_tokens_of_one_engine_in_bf16():
    """bf16 rows cross the all-to-all widened to fp32 (gloo moves none) and come back exact."""
    prompts = _prompts()[:4]
    with LLM("tiny-random-deepseek", dtype="bfloat16", page_size=4, num_pages=64) as llm:
        want = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    with DPLLM("tiny-random-deepseek", dtype="bfloat16", dp=2, page_size=4, num_pages=64) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want


def test_generate_fans_a_family_out_on_its_first_ones_group(one_engine):
    """n = 2 through generate: both completions on the first one's group, sharing its prompt pages."""
    prompts = _prompts()[:3]
    with DPLLM("tiny-random-deepseek", dp=2, page_size=4, num_pages=64) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True, n=2))
    for out, want in zip(outs, one_engine["tiny-random-deepseek"], strict=False):
        assert [c.token_ids for c in out.outputs] == [want, want]


def test_the_experts_are_spread_over_every_rank_once():
    config = load_model("tiny-random-deepseek", weights=False).config
    held = []
    for dp_rank in range(2):
        for rank in range(2):
            shard = Shard.of(config, rank, 2, dp=2, dp_rank=dp_rank)
            assert shard.world_rank == dp_rank * 2 + rank
            assert shard.q_heads == Shard.of(config, rank, 2).q_heads  # attention as TP 2
            held += range(*shard.experts)
    assert held == list(range(config.moe.num_experts))


def test_bad_dp_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="dp=2 needs an MoE model"):
        DPLLM("tiny-random", dp=2)
    with pytest.raises(ValueError, match=r"tp x dp = 16 ranks divide; got 8 experts"):
        DPLLM("tiny-random-moe", dp=8, tp=2)
    with pytest.raises(ValueError, match="dp must be an integer >= 1"):
        DPLLM("tiny-random-moe", dp=0)
    with pytest.raises(ValueError, match="runs without speculative_config, kv_tiers or cuda_graphs"):
        DPLLM("tiny-random-moe", dp=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert isinstance(load_model("tiny-random-moe", weights=False).config, ModelConfig)
    # an LLM is one group's engine: the groups are composed by a DPLLM (make_llm picks by dp)
    with pytest.raises(ValueError, match=r"dp=2: an LLM is one DP group's engine; engine.dp.DPLLM runs"):
        LLM("tiny-random-moe", dp=2)
    with pytest.raises(ValueError, match=r"DPLLM runs dp >= 2 DP groups, got dp=1"):
        DPLLM("tiny-random-moe")


def test_make_llm_builds_the_engine_the_config_describes():
    with make_llm("tiny-random-moe", page_size=4, num_pages=16) as one:
        assert type(one) is LLM
    with make_llm("tiny-random-moe", dp=2, page_size=4, num_pages=16) as two:
        assert type(two) is DPLLM and two.front.engines is two.dp_engines
        assert two.pages == (32, 32)  # both groups' pages


def test_a_request_the_other_engine_refuses_fails_alone_and_one_aborted_there_ends():
    with DPLLM("tiny-random-moe", dp=2, page_size=4, num_pages=64) as llm:
        with pytest.raises(ValueError, match=r"dp_rank must be an integer in \[0, 2\), got 2"):
            llm.add_request([5, 6, 7], GREEDY, dp_rank=2)
        long = SamplingParams(max_tokens=40, ignore_eos=True)
        llm.add_request([5, 6, 7], long, request_id="there", dp_rank=1)
        with pytest.raises(ValueError, match="already in use"):
            llm.add_request([5, 6, 7], GREEDY, request_id="there")
        llm.step()
        llm.abort("there")
        ended = {}
        while llm.has_unfinished():
            ended.update((o.request_id, o) for o in llm.step() if o.finished)
        assert ended["there"].finish_reason == "abort" and len(ended["there"].token_ids) < 40
        outs, _ = _run(llm, [[5, 6, 7]], dp_rank=1)  # its engine serves on
        assert outs[0].finish_reason == "length"


def test_an_engine_that_dies_fails_the_step_instead_of_hanging():
    llm = DPLLM("tiny-random-moe", dp=2, page_size=4, num_pages=64)
    llm.dp_engines.procs[0].kill()
    llm.dp_engines.procs[0].join()
    with pytest.raises(EngineDied, match="DP engine 1 has exited"):
        llm.generate(_prompts()[:2], GREEDY)
    llm.close()


def test_a_grammar_loaded_at_the_front_is_loaded_in_every_group():
    """A worker loads each client grammar the server compiled (Grammars.load): with DP the request may run
    on another group's engine, which must find it loaded too instead of compiling it on the step loop
    that every group shares."""
    spec = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    with DPLLM("tiny-random-moe", dp=2, page_size=4, num_pages=64) as llm:
        compiled = llm.core.grammars.compiler.compile_grammar(spec.grammar_of()).serialize_json()
        llm.front.load_grammar(spec, compiled)
        params = SamplingParams(max_tokens=30, structured_outputs=spec)
        rid = llm.add_request([5, 6, 7, 8], params, dp_rank=1)
        done = {}
        while llm.has_unfinished():
            done.update((o.request_id, o) for o in llm.step() if o.finished)
        assert llm.front.dp_rank_of(rid) == 0 and done[rid].finish_reason in ("stop", "length")
        if done[rid].finish_reason == "stop":
            assert isinstance(json.loads(done[rid].text), dict)
        assert llm.grammar_compiles == 0  # group 1 found it loaded
