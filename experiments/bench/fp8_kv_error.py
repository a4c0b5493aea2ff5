"""How far attention over FP8 (e4m3) KV lands from attention over the KV as computed, on a real model and
a real text: SmolLM2-135M in fp32 reads the Python language reference as it ships in the standard library
(pydoc_data.topics: English prose and grammar), prompt by prompt; at every decode step and layer, the
decode attention runs over the sequences' pages as computed (the reference) and over the same pages
through e4m3 with a scale per page and head, and with one scale per layer and plane (per tensor: the
layer's own amax, the best static scale). The error is each sequence's output's distance from the
reference over the reference's norm; the table gives its median, 99th percentile and maximum, with the
same pages through bf16 beside them for scale.

    python -m experiments.bench.fp8_kv_error [--prompts 8] [--tokens 384] [--steps 16] [--agreement 200]
    python -m experiments.bench.fp8_kv_error --engine 200
    python -m experiments.bench.fp8_kv_error --perplexity 20

--agreement N: greedy text of N other prompts (128 tokens each, 64 new) with the decode steps attending
over their pages through each variant, against the text over the pages as computed. --engine N: greedy
text of N prompts through an engine whose cache is e4m3 (prefill attention reading it too), against one
whose cache is fp32. --perplexity N: the perplexity of N windows of 512 tokens of the same text, prefilled
in passes of 128 tokens (each pass's attention reading the earlier passes' pages and its own as stored):
an engine storing fp32 pages (as computed), the same with the pages read through bf16, e4m3 per page and
head, or e4m3 per tensor, and an engine whose cache is e4m3 (pages stored so).

The engine runs its Python layers here (the fused C++ decode step, which never calls the attention op, is
set aside).
"""

from __future__ import annotations

import argparse
import math
import random

import torch

from pdkernels import kv_quant, ops

# how the pages are stored: bf16 (the usual KV, for scale), e4m3 scaled per page and head, per tensor
VARIANTS = {
    "bf16": lambda c: c.to(torch.bfloat16).to(c.dtype),
    "fp8, a scale per page and head": lambda c: kv_quant.round_trip_pages(c, "HND"),
    "fp8, a scale per layer and plane": kv_quant.round_trip_tensor,
}


def text_prompts(tokenizer, n: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """n windows of `tokens` tokens of the language reference: each from a topic and an offset drawn by
    seed (no two the same)."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    texts = [tokenizer.encode(topics[name]) for name in sorted(topics)]
    windows = [(t, start) for t, ids in enumerate(texts) for start in range(0, len(ids) - tokens, tokens)]
    return [texts[t][start : start + tokens] for t, start in rng.sample(windows, n)]


def _python_layers(llm):
    """llm with its decode steps in the Python layers, which call pdkernels.ops.decode_attention."""
    llm.model.decoder = None
    return llm


def measure(prompts: int = 8, tokens: int = 384, steps: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per variant, every (sequence, layer, step)'s relative error of decode attention over FP8 KV."""
    from engine import LLM, SamplingParams

    llm = _python_layers(LLM("smollm2-135m", dtype="float32", page_size=16, num_pages=prompts * 40,
                             max_num_batched_tokens=prompts * tokens))  # fmt: skip
    errors: dict[str, list[torch.Tensor]] = {name: [] for name in VARIANTS}
    attend = ops.decode_attention

    def measured(q, cache, kv_indptr, kv_indices, kv_last_page_len, *args, **kwargs):
        out = attend(q, cache, kv_indptr, kv_indices, kv_last_page_len, *args, **kwargs)
        used, local = kv_indices.unique(return_inverse=True)  # the pages these sequences read, renumbered
        for name, round_trip in VARIANTS.items():
            fp8 = attend(q, round_trip(cache[used]), kv_indptr, local, kv_last_page_len, *args, **kwargs)
            err = (fp8 - out).flatten(1).norm(dim=1) / out.flatten(1).norm(dim=1)
            errors[name].append(err)
        return out

    ops.decode_attention = measured
    try:
        texts = text_prompts(llm.tokenizer, prompts, tokens, seed)
        llm.generate(texts, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    finally:
        ops.decode_attention = attend
    return {name: torch.cat(e) for name, e in errors.items()}


def agreement(prompts: int = 200, tokens: int = 128, new_tokens: int = 64, seed: int = 1) -> dict[str, dict]:
    """Greedy text with the decode steps attending over their pages through each variant against the pages
    as computed (as a decode worker storing them so would, fed by a prefill worker in full precision):
    per variant, the mean tokens until the first that differs, the mean of the new_tokens that match
    position by position, and the share of the prompts whose text is the same."""
    from engine import LLM, SamplingParams

    llm = LLM(
        "smollm2-135m",
        dtype="float32",
        kv_layout="NHD",
        page_size=16,
        max_num_seqs=prompts,
        num_pages=prompts * -(-(tokens + new_tokens) // 16) + 16,
        max_num_batched_tokens=prompts * tokens,
    )  # fmt: skip  (one prefill step, then decode steps)
    texts = text_prompts(llm.tokenizer, prompts, tokens, seed)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    reference = [o.token_ids for o in llm.generate(texts, params)]
    attend, out = ops.decode_attention, {}
    for name, round_trip in VARIANTS.items():

        def stored(q, cache, kv_indptr, kv_indices, kv_last_page_len, *args, round_trip=round_trip, **kwargs):
            used, local = kv_indices.unique(return_inverse=True)
            return attend(q, round_trip(cache[used]), kv_indptr, local, kv_last_page_len, *args, **kwargs)

        ops.decode_attention = stored
        try:
            got = [o.token_ids for o in llm.generate(texts, params)]
        finally:
            ops.decode_attention = attend
        out[name] = _compare(reference, got, new_tokens)
    return out


def _compare(reference: list[list[int]], got: list[list[int]], new_tokens: int) -> dict:
    pairs = [list(zip(r, g, strict=True)) for r, g in zip(reference, got, strict=True)]
    first = [next((i for i, (a, b) in enumerate(p) if a != b), len(p)) for p in pairs]
    same = [sum(a == b for a, b in p) for p in pairs]
    n = len(pairs)
    return {
        "prompts": n,
        "first_difference": sum(first) / n,
        "matching": sum(same) / n,
        "identical": sum(f == new_tokens for f in first) / n,
    }


def engine_agreement(prompts: int = 200, tokens: int = 128, new_tokens: int = 64, seed: int = 1) -> dict:
    """The same prompts through an engine that stores its KV in e4m3 (cache.kv_dtype='fp8_e4m3': every
    page quantized as written, prefill and decode attention both reading it so) against one storing it in
    fp32, both on the Python layers (the fused C++ decode step serves fp32 caches only)."""
    from engine import LLM, SamplingParams

    texts, got = None, {}
    for kv_dtype in ("auto", "fp8_e4m3"):
        llm = _python_layers(LLM(
            "smollm2-135m", dtype="float32", kv_dtype=kv_dtype, page_size=16, max_num_seqs=prompts,
            num_pages=prompts * -(-(tokens + new_tokens) // 16) + 16, max_num_batched_tokens=prompts * tokens,
        ))  # fmt: skip
        texts = texts or text_prompts(llm.tokenizer, prompts, tokens, seed)
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        got[kv_dtype] = [o.token_ids for o in llm.generate(texts, params)]
        del llm
    return {
        "fp8, a scale per page and head (the engine's cache)": _compare(
            got["auto"], got["fp8_e4m3"], new_tokens
        )
    }


def perplexity(prompts: int = 20, tokens: int = 512, chunk: int = 128, seed: int = 2) -> dict[str, dict]:
    """Per way of storing the pages, the perplexity of the windows' tokens after their first (each
    predicted from the ones before it by the prefill's hidden states: every row's, not only the last)."""
    ways = [("fp32 (as computed)", "auto", None)]
    ways += [(f"{name} (as read)", "auto", round_trip) for name, round_trip in VARIANTS.items()]
    ways += [("fp8, a scale per page and head (the engine's cache, as written)", "fp8_e4m3", None)]
    return {
        name: _perplexity(kv_dtype, round_trip, prompts, tokens, chunk, seed)
        for name, kv_dtype, round_trip in ways
    }


def _perplexity(kv_dtype: str, round_trip, prompts: int, tokens: int, chunk: int, seed: int) -> dict:
    """One way's perplexity: an engine storing its pages in kv_dtype, its attention ops reading them
    through round_trip where one is given (the pages a call reads, dequantized as they were read)."""
    from engine import LLM, SamplingParams

    llm = _python_layers(LLM(
        "smollm2-135m", dtype="float32", kv_dtype=kv_dtype, page_size=16, enable_prefix_caching=False,
        num_pages=-(-tokens // 16) + 8, max_num_seqs=1, max_num_batched_tokens=chunk,
    ))  # fmt: skip
    texts = text_prompts(llm.tokenizer, prompts, tokens, seed)
    nll, run = [], llm.runner.run
    attend = {op: getattr(ops, op) for op in ("decode_attention", "extend_attention")}

    def scored(batch, counter=None):
        step, row = run(batch, counter), 0
        for c in batch.chunks:
            ids = c.seq.prompt_ids
            known = [p for p in range(c.start, c.end) if p + 1 < len(ids)]  # a next token to score
            if known:
                logits = llm.model.logits(step.hidden[row : row + len(known)])
                target = torch.tensor([ids[p + 1] for p in known])
                nll.append(torch.nn.functional.cross_entropy(logits, target, reduction="sum").item())
            row += c.num_tokens
        return step

    def stored(op):
        at = 2 if op == "extend_attention" else 1  # the cache's argument; its page indices two after it

        def read(*args, **kwargs):
            args = list(args)
            used, local = args[at + 2].unique(return_inverse=True)
            args[at], args[at + 2] = round_trip(args[at][used]), local
            return attend[op](*args, **kwargs)

        return read

    llm.runner.run = scored
    try:
        if round_trip is not None:
            for op in attend:
                setattr(ops, op, stored(op))
        for text in texts:
            llm.generate([text], SamplingParams(max_tokens=1, ignore_eos=True))
    finally:
        for op, fn in attend.items():
            setattr(ops, op, fn)
    count = sum(len(t) - 1 for t in texts)
    return {"prompts": len(texts), "tokens": count, "perplexity": math.exp(sum(nll) / count)}


def perplexity_table(rows: dict[str, dict]) -> str:
    lines = ["| KV stored as | windows | tokens scored | perplexity |", "| --- | ---: | ---: | ---: |"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['prompts']} | {r['tokens']:,} | {r['perplexity']:.4f} |")
    return "\n".join(lines)


def agreement_table(rows: dict[str, dict], new_tokens: int) -> str:
    lines = [
        f"| KV stored as | prompts | tokens until the first difference (of {new_tokens}) | matching tokens "
        f"(of {new_tokens}) | texts identical |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['prompts']} | {r['first_difference']:.1f} | {r['matching']:.1f} | "
            f"{r['identical']:.0%} |"
        )
    return "\n".join(lines)


def table(errors: dict[str, torch.Tensor]) -> str:
    rows = ["| KV stored as | samples | median | p99 | max |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, e in errors.items():
        p = torch.quantile(e.double(), torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
        rows.append(f"| {name} | {len(e):,} | {p[0]:.2e} | {p[1]:.2e} | {e.max().item():.2e} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=384)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--agreement", type=int, default=0, metavar="N", help="also greedy text of N prompts")
    parser.add_argument(
        "--engine",
        type=int,
        default=0,
        metavar="N",
        help="only greedy text of N prompts through an e4m3 cache",
    )
    parser.add_argument(
        "--perplexity",
        type=int,
        default=0,
        metavar="N",
        help="only the perplexity of N windows of 512 tokens",
    )
    a = parser.parse_args(argv)
    if a.perplexity:
        print(perplexity_table(perplexity(a.perplexity)))
        return
    if a.engine:
        print(agreement_table(engine_agreement(a.engine), 64))
        return
    print(table(measure(a.prompts, a.tokens, a.steps, a.seed)))
    if a.agreement:
        print()
        print(agreement_table(agreement(a.agreement), 64))


if __name__ == "__main__":
    main()
