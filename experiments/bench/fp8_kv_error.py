"""How far attention over FP8 (e4m3) KV lands from attention over the KV as computed, on a real model and
a real text: SmolLM2-135M in fp32 reads the Python language reference as it ships in the standard library
(pydoc_data.topics: English prose and grammar), prompt by prompt; at every decode step and layer, the
decode attention runs over the sequences' pages as computed (the reference) and over the same pages
through e4m3 with a scale per page and head, and with one scale per layer and plane (per tensor: the
layer's own amax, the best static scale). The error is each sequence's output's distance from the
reference over the reference's norm; the table gives its median, 99th percentile and maximum, with the
same pages through bf16 beside them for scale.

    python -m experiments.bench.fp8_kv_error [--prompts 8] [--tokens 384] [--steps 16]

The engine runs its Python layers here (an NHD cache: the fused C++ step never calls the attention op).
"""

from __future__ import annotations

import argparse
import random

import torch

from pdkernels import kv_quant, ops

# how the pages are stored: bf16 (the usual KV, for scale), e4m3 scaled per page and head, per tensor
VARIANTS = {
    "bf16": lambda c: c.to(torch.bfloat16).to(c.dtype),
    "fp8, a scale per page and head": lambda c: kv_quant.round_trip_pages(c, "NHD"),
    "fp8, a scale per layer and plane": kv_quant.round_trip_tensor,
}


def text_prompts(tokenizer, n: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """n slices of `tokens` tokens of the language reference, each from a topic drawn by seed."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    names = sorted(k for k, v in topics.items() if len(v) > 8 * tokens)
    return [tokenizer.encode(topics[name])[:tokens] for name in rng.sample(names, n)]


def measure(prompts: int = 8, tokens: int = 384, steps: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per variant, every (sequence, layer, step)'s relative error of decode attention over FP8 KV."""
    from engine import LLM, SamplingParams

    llm = LLM("smollm2-135m", dtype="float32", kv_layout="NHD", page_size=16, num_pages=prompts * 40,
              max_num_batched_tokens=prompts * tokens)  # fmt: skip
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
    a = parser.parse_args(argv)
    print(table(measure(a.prompts, a.tokens, a.steps, a.seed)))


if __name__ == "__main__":
    main()
