"""ngram speculative decoding on SmolLM2 (CPU): TPOT, tokens per step and acceptance per prompt class.

    python -m pytest experiments/bench/bench_speculative.py --benchmark-enable -s -p no:cacheprovider

Each prompt runs alone (batch 1), 64 greedy new tokens, with k = 0 (no speculation), 2 and 4. Classes:
`copy` (asked to repeat a text it was given), `code` (asked to edit code it was given) and `open` (no
text to copy from: drafts rarely match). TPOT: first to last new token over 63; tokens per step: new
tokens over steps. In float32 the outputs must equal k = 0's (lossless); in bfloat16 a verify pass's
GEMMs at M = k + 1 round differently from M = 1, so greedy outputs may part after a while: the table says
how many tokens agree.
"""

import os
import statistics

import pytest

from engine import LLM, SamplingParams

NEW_TOKENS = 64
DTYPE = os.environ.get("PDKERNELS_BENCH_DTYPE", "bfloat16")
TEXT = (
    "The committee met on Tuesday to review the budget. It agreed to fund the library repairs, to delay "
    "the new bus route until spring, and to ask the council for a second report on the harbour wall."
)
CODE = (
    "def total(items):\n    result = 0\n    for item in items:\n        result = result + item.price\n"
    "    return result\n"
)
PROMPTS = {
    "copy": [
        f"Repeat the following text exactly.\n\n{TEXT}\n\nRepeated text:\n",
        f"Rewrite this paragraph word for word:\n{TEXT}\nRewritten:\n",
    ],
    "code": [
        f"Rename `result` to `sum_` in this function and print the whole function.\n\n{CODE}\nAnswer:\n",
        f"Add a docstring to this function and print the whole function.\n\n{CODE}\nAnswer:\n",
    ],
    "open": ["Write a short story about a lighthouse keeper.", "List some ideas for a birthday party."],
}
RESULTS: dict[tuple[str, int], dict] = {}


@pytest.fixture(scope="module")
def engines():
    from pdkernels import ops

    ops.set_backend("torch")
    yield {
        k: LLM(
            "smollm2-135m",
            dtype=DTYPE,
            num_pages=64,
            speculative_config={"method": "ngram", "num_speculative_tokens": k} if k else None,
        )
        for k in (0, 2, 4)
    }
    ops.set_backend("auto")


@pytest.mark.parametrize("kind", list(PROMPTS))
@pytest.mark.parametrize("k", [0, 2, 4])
def test_speculative_decode(benchmark, engines, kind, k):
    llm = engines[k]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [llm.apply_chat_template(p) for p in PROMPTS[kind]]
    outs = benchmark.pedantic(lambda: [llm.generate([p], greedy)[0] for p in prompts], rounds=1, iterations=1)
    reference = [engines[0].generate([p], greedy)[0].token_ids for p in prompts]
    same = [_common_prefix(o.token_ids, ref) for o, ref in zip(outs, reference, strict=True)]
    if DTYPE == "float32":
        assert [o.token_ids for o in outs] == reference  # lossless
    tpots = [o.tpot for o in outs]
    drafted = sum(o.num_drafted_tokens for o in outs)
    # steps: the prefill that samples the first token, then one per decode step (a verify step makes
    # accepted + 1 tokens): n - accepted in all
    steps = sum(len(o.token_ids) - o.num_accepted_tokens for o in outs)
    RESULTS[(kind, k)] = {
        "tpot_ms": 1e3 * statistics.median(tpots),
        "tokens_per_step": sum(len(o.token_ids) for o in outs) / steps,
        "acceptance": sum(o.num_accepted_tokens for o in outs) / drafted if drafted else None,
        "same_prefix": min(same),  # tokens equal to k = 0's before the first difference (of 64)
    }
    benchmark.extra_info.update(RESULTS[(kind, k)])


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def teardown_module():
    if not RESULTS:
        return
    print(f"\n{DTYPE}\n| prompts | k | TPOT p50 ms | tokens / step | acceptance | same tokens as k = 0 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for (kind, k), r in sorted(RESULTS.items()):
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        same = f"{r['same_prefix']} / {NEW_TOKENS}"
        print(f"| {kind} | {k} | {r['tpot_ms']:.1f} | {r['tokens_per_step']:.2f} | {acc} | {same} |")
