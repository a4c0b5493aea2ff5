"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.sequence import SamplingParams


def sample(
    logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """logits [n, vocab] fp32 -> one token id per row."""
    tokens = logits.argmax(-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_row(logits[i], p, generators[i])
    return tokens


def _sample_row(logits: Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probabilities(logits, p).cpu(), 1, generator=generator))


def probabilities(logits: Tensor, p: SamplingParams) -> Tensor:
    """The distribution a non-greedy request samples from: temperature, then top-k, then top-p."""
    logits = logits / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum(-1, keepdim=True)
