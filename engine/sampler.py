"""Next-token sampling with vLLM's parameters and order: the model's logits, then logit_bias, min_tokens
(EOS and stop_token_ids barred until then), the repetition / frequency / presence penalties; then the pick:
greedy argmax, or temperature, min_p, top-k, top-p and a draw from the request's own generator.

Log-probabilities are the log-softmax of the model's logits before any of this (vLLM's default
`logprobs_mode`), computed only for the requests that ask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.sequence import SamplingParams, Sequence
from pdkernels import ops

MASKED_LOGPROB = -9999.0


@dataclass
class Logprob:
    """One token's log-probability at a position and its rank there (1: the likeliest), as vLLM's."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def sample(logits: Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...] = ()) -> list[int]:
    """logits [n, vocab] fp32, one row per sequence -> one token id per row."""
    tokens = ops.argmax(logits).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy and not p.processes_logits:
            continue
        row = processed(logits[i], seq, eos_ids)
        tokens[i] = int(row.argmax()) if p.greedy else draw(probabilities(row, p), seq.generator)
    return tokens


def draw(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def processed(
    logits: Tensor, seq: Sequence, eos_ids: tuple[int, ...] = (), drafted: list[int] | None = None
) -> Tensor:
    """One row of logits after logit_bias, min_tokens and the penalties, for the position after the
    sequence's outputs plus `drafted` (speculative tokens before this row's position). A new tensor."""
    p = seq.params
    row = logits.float().clone()
    if not p.processes_logits:
        return row
    outputs = seq.output_ids + (drafted or [])
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=row.device)
        row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device))
    if len(outputs) < p.min_tokens:
        barred = [t for t in (*eos_ids, *p.stop_token_ids) if t < row.numel()]
        if barred:
            kept = row[barred]
            row[barred] = float("-inf")
            if not torch.isfinite(row).any():  # a grammar that allows only the end: it ends
                row[barred] = kept
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.prompt_ids) | set(outputs)), device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and outputs:
        counts = torch.bincount(torch.tensor(outputs), minlength=row.numel()).to(row)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row)
    return row


def probabilities(logits: Tensor, p: SamplingParams) -> Tensor:
    """The distribution a non-greedy request samples from: temperature, min_p, top-k, then top-p."""
    logits = logits / p.temperature
    if p.min_p:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        drop[..., 0] = False  # the likeliest stays whatever top_p rounds to in fp32
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum(-1, keepdim=True)


def logprobs_of(logits: Tensor, tokens: list[int], k: int) -> list[dict[int, Logprob]]:
    """logits [n, vocab] (the model's, unprocessed) and the token picked at each row -> per row, the
    picked token's Logprob first, then the k likeliest tokens' (vLLM's shape; the picked one once)."""
    # a token a grammar masked out has -inf, which JSON cannot carry: -9999 stands for it (as in vLLM)
    logp = torch.log_softmax(logits.float(), -1).clamp(min=MASKED_LOGPROB)
    picked = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])
    ranks = (logp > picked).sum(-1) + 1
    top = torch.topk(logp, k, -1) if k else None
    out = []
    for i, token in enumerate(tokens):
        entry = {token: Logprob(float(picked[i]), int(ranks[i]))}
        if top is not None:
            for rank, (value, t) in enumerate(
                zip(top.values[i].tolist(), top.indices[i].tolist(), strict=True), 1
            ):
                entry.setdefault(t, Logprob(value, rank))
        out.append(entry)
    return out
