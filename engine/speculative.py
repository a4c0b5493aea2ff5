"""Speculative decoding on the decode (or colocated) worker: draft k tokens, verify them in one pass.

A decoding sequence's step computes its last token plus k drafted ones (the paged cache takes their K/V
like any chunk; attention is the extend kernel's). The logits at those k + 1 positions decide: at
temperature 0 the longest prefix of drafts that equals the target's argmax is accepted, then the target's
own next token; otherwise rejection sampling keeps the target distribution exactly (a draft d with draft
probability q(d) is accepted with probability min(1, p(d) / q(d)); a rejected one is replaced by a sample
of max(0, p - q) normalized). The KV of rejected positions stays in the cache as garbage that the next
step overwrites; the pages past the sequence's length go back to the allocator.

Proposers, with vLLM's config names: `ngram` (prompt lookup: the tokens that followed the latest earlier
occurrence of the context's last n tokens, n from prompt_lookup_max down to prompt_lookup_min) and `mtp`
(a DeepSeek-style multi-token-prediction head fed by the target's hidden states: engine/mtp.py; `model`
names its weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a step verifies: the server's front reads SpeculativeConfig alone
    import torch
    from torch import Tensor

METHODS = ("ngram", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 2
    prompt_lookup_min: int = 2  # a one-token match proposes too often on text that does not repeat
    prompt_lookup_max: int = 4
    model: str | None = None  # mtp: None (the target checkpoint's MTP layer), "random" or a .safetensors

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        if self.model is not None and (self.method != "mtp" or not isinstance(self.model, str)):
            raise ValueError(
                f"speculative_config.model is the mtp head's weights (None, 'random' or a .safetensors "
                f"path) and only for method 'mtp'; got {self.model!r} with method {self.method!r}"
            )
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{key} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"speculative_config.prompt_lookup_max ({self.prompt_lookup_max}) must be >= "
                f"prompt_lookup_min ({self.prompt_lookup_min})"
            )

    @staticmethod
    def of(config: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(config).__name__}")
        unknown = sorted(set(config) - set(SpeculativeConfig.__dataclass_fields__))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}")
        return SpeculativeConfig(**config)


def ngram_drafts(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens (longest n first)."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # latest match first, not the suffix itself
            if tokens[start : start + n] == pattern:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


def verify_greedy(logits: Tensor, drafts: list[int]) -> tuple[list[int], int]:
    """logits [k + 1, vocab] at the last token and each draft -> (tokens to append, drafts accepted)."""
    from pdkernels import ops

    target = ops.argmax(logits).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return drafts[:accepted] + [target[accepted]], accepted


def verify_sampled(
    probs: Tensor, drafts: list[int], generator: torch.Generator | None
) -> tuple[list[int], int]:
    """probs [k + 1, vocab] (the target's, after temperature / top-k / top-p) -> (tokens, accepted).

    The drafts come from a deterministic proposer: q is a point mass on each draft, so a draft d is
    accepted with probability p(d), and a rejected one is replaced by a sample of p with d removed."""
    import torch

    out = []
    for i, d in enumerate(drafts):
        p = probs[i]
        if torch.rand((), generator=generator).item() < p[d].item():
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        total = residual.sum()
        if total <= 0:  # p was a point mass on d: accepting was certain; numerically a tie
            out.append(d)
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out, i
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out, len(drafts)
