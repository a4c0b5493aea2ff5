"""What structured output and logprobs cost the requests beside them (SmolLM2, CPU, one thread).

    python -m pytest experiments/bench/bench_api.py --benchmark-enable -s -p no:cacheprovider

20 requests at once (concurrency 20), 48 new tokens each (a JSON schema that needs more than 48 tokens,
so every request runs to its length), the same prompts in every case: none constrained; a quarter with a
JSON schema; a quarter, and all, asking for logprobs=5. TPOT p50 over the 20 requests (they step
together, so the constrained ones' TPOT is the others'); rounds interleave the cases. Then the grammar's
own costs: compile time, cold (a fresh engine's first compile, with the vocabulary's table) and cached,
and one mask (fill the matcher's bitmask, apply it to a row of logits) mid-way through a JSON object.
"""

import os
import statistics
import time

import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputs

DTYPE = os.environ.get("PDKERNELS_BENCH_DTYPE", "bfloat16")
CONCURRENCY, NEW_TOKENS, ROUNDS = 20, 48, int(os.environ.get("PDKERNELS_BENCH_ROUNDS", "3"))
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "scores": {"type": "array", "items": {"type": "integer"}, "minItems": 40},
    },
    "required": ["title", "scores"],
    "additionalProperties": False,
}
CASES = {
    "none": lambda i: {},
    "json schema, 1 in 4": lambda i: (
        {"structured_outputs": StructuredOutputs(json=SCHEMA)} if i % 4 == 0 else {}
    ),
    "logprobs=5, 1 in 4": lambda i: {"logprobs": 5} if i % 4 == 0 else {},
    "logprobs=5, all": lambda i: {"logprobs": 5},
}
TPOTS: dict[str, list[float]] = {}  # case -> TPOT p50 per round
COMPILE: list[float] = []


@pytest.fixture(scope="module")
def llm():
    from pdkernels import ops

    torch.set_num_threads(1)
    ops.set_backend("torch")
    yield LLM("smollm2-135m", dtype=DTYPE, num_pages=512, max_num_seqs=CONCURRENCY)
    ops.set_backend("auto")


def _prompts(llm):
    return [llm.apply_chat_template(f"Give the scores of team {i} as JSON.") for i in range(CONCURRENCY)]


def test_cost_of_grammars_and_logprobs(benchmark, llm):
    prompts = _prompts(llm)

    def one_round():
        for case, extra in CASES.items():
            params = [
                SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, **extra(i)) for i in range(CONCURRENCY)
            ]
            outs = llm.generate(prompts, params)
            assert all(len(o.token_ids) == NEW_TOKENS for o in outs)
            TPOTS.setdefault(case, []).append(statistics.median(o.tpot for o in outs))

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)


def test_grammar_compile_and_mask_time(benchmark):
    def measure():
        fresh = LLM("smollm2-135m", dtype=DTYPE, num_pages=8)
        spec = StructuredOutputs(json=SCHEMA)
        start = time.perf_counter()
        matcher = fresh.core.grammars.matcher(spec)
        cold_s = time.perf_counter() - start
        start = time.perf_counter()
        fresh.core.grammars.matcher(spec)
        cached_s = time.perf_counter() - start
        for t in fresh.tokenizer.encode('{"title": "Team A", "scores": [1, 2'):
            assert matcher.accept_token(t)
        row = torch.zeros(fresh.config.arch.vocab_size)
        fresh.core.grammars.mask(row, matcher, spec)  # the first builds the table of control-byte tokens
        start = time.perf_counter()
        for _ in range(200):
            fresh.core.grammars.mask(row, matcher, spec)
        return cold_s, fresh.core.grammars.compile_s[0], cached_s, (time.perf_counter() - start) / 200

    COMPILE.extend(benchmark.pedantic(measure, rounds=1, iterations=1))


def teardown_module():
    if TPOTS:
        base = statistics.median(TPOTS["none"])
        print(f"\n{DTYPE}, {CONCURRENCY} requests at once, {NEW_TOKENS} new tokens, {ROUNDS} rounds")
        print("| case | TPOT p50 ms (median of rounds) | vs none | rounds |")
        print("| --- | ---: | ---: | --- |")
        for case, rounds in TPOTS.items():
            every = statistics.median(rounds)
            spread = " / ".join(f"{1e3 * r:.0f}" for r in rounds)
            print(f"| {case} | {1e3 * every:.1f} | {100 * (every / base - 1):+.1f}% | {spread} |")
    if COMPILE:
        cold, compile_only, cached, mask = COMPILE
        print(
            f"grammar: first use {1e3 * cold:.0f} ms (import xgrammar, vocabulary table, compile), "
            f"compile alone {1e3 * compile_only:.1f} ms, cached {1e3 * cached:.2f} ms; "
            f"one mask {1e3 * mask:.3f} ms"
        )
