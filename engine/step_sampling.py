"""What a step does with its logits (StepSampler, a member of the engine's core: `llm.core.sampler`): each
sampling chunk's grammar mask, its token (or its drafts' verification) and its logprobs, one chunk at a
time, so that a row whose parameters break the arithmetic fails its own sequence only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.sampler import logprobs_of, probabilities, processed, sample
from engine.speculative import verify_greedy, verify_sampled
from pdkernels import ops

log = logging.getLogger("engine.llm")


class StepSampler:
    """Sampling, verification, grammars and logprobs of a step. eos_token_ids: the model's; tokenizer:
    decodes logprobs' tokens; grammars: the engine's Grammars, asked for only when a chunk has one (they
    are built on first use)."""

    def __init__(self, eos_token_ids, tokenizer, grammars: Callable[[], object]):
        self.eos, self.tokenizer, self.grammars = eos_token_ids, tokenizer, grammars

    def sample(self, sampling, rows, plain, logits: torch.Tensor):
        """(plain chunks' tokens in order, id(chunk) -> verified drafts, id(chunk) -> logprobs, id(chunk)
        -> the exception that failed it). Each chunk is sampled on its own, so a row whose parameters
        break the arithmetic fails its own sequence only (a failed plain chunk's token is -1)."""
        eos = self.eos
        # the common case in one call; rows in a run (every row, usually) as a view: indexing copied the
        # [rows, vocab] fp32 logits first (0.9 ms of a 50 ms batch-20 decode step, SmolLM2 on one core)
        run = plain and plain[-1] - plain[0] + 1 == len(plain)
        greedy = (
            ops.argmax(logits[plain[0] : plain[-1] + 1] if run else logits[plain]).tolist() if plain else []
        )
        tokens, verified, logprobs, failed, k = [], {}, {}, {}, 0
        for c, (lo, hi) in zip(sampling, rows, strict=True):
            try:
                if c.seq.grammar is not None:  # grammars first: what the rest sees
                    self._constrain(c, logits[lo:hi])
                if c.drafts:
                    verified[id(c)] = self._verify(c, logits[lo:hi])
                    new = verified[id(c)][0]
                else:
                    p = c.seq.params
                    plain_row = p.greedy and not p.processes_logits and c.seq.grammar is None
                    new = [greedy[k] if plain_row else sample(logits[lo:hi], [c.seq], eos)[0]]
                if c.seq.params.logprobs is not None:
                    logprobs[id(c)] = self._logprobs_of(c, logits[lo : lo + len(new)], new)
            except Exception as e:  # this request's own: logged, and only it ends
                log.warning("sampling failed for %s: %r", c.seq.request_id, e)
                failed[id(c)], new = e, [-1]
            if not c.drafts:
                tokens.append(new[0])
                k += 1
        return tokens, verified, logprobs, failed

    def _verify(self, chunk, logits: torch.Tensor) -> tuple[list[int], int]:
        """(tokens to append, drafts accepted) of a chunk with drafts, from its 1 + k rows of logits."""
        seq, p = chunk.seq, chunk.seq.params
        if p.processes_logits:  # row j follows the outputs and the first j drafts
            eos = self.eos
            logits = torch.stack([processed(row, seq, eos, chunk.drafts[:j]) for j, row in enumerate(logits)])
        if p.greedy:
            return verify_greedy(logits, chunk.drafts)
        probs = torch.stack([probabilities(row, p) for row in logits]).cpu()
        return verify_sampled(probs, chunk.drafts, seq.generator)

    def _constrain(self, chunk, logits: torch.Tensor) -> None:
        """Mask a constrained chunk's rows in place: row j as the grammar stands after its first j drafts
        (each accepted into the matcher to mask the next row, then all rolled back: _append_token
        accepts the tokens the step keeps)."""
        matcher, drafts, taken, grammars = chunk.seq.grammar, chunk.drafts, 0, self.grammars()
        for j, row in enumerate(logits):
            if not grammars.mask(row, matcher, chunk.seq.params.structured_outputs) or j == len(drafts):
                break
            if not matcher.accept_token(drafts[j]):
                break  # this draft is masked out: verification rejects it, later rows are never read
            taken += 1
        if taken:
            matcher.rollback(taken)

    def _logprobs_of(self, chunk, logits: torch.Tensor, new: list[int]) -> dict[int, dict]:
        """{j: the chunk's j-th new token's Logprob entry} (its request asked for logprobs)."""
        entries = logprobs_of(logits, new, chunk.seq.params.logprobs)
        for entry in entries:
            for token, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([token], skip_special_tokens=False)
        return dict(enumerate(entries))
