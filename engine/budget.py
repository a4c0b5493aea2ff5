"""An SLO-driven step budget: each step's prompt tokens sized so that the sequences decoding in it stay
inside a time per output token (Sarathi-Serve's stall-free batching, with the chunk sized from the SLO
and the worker's own measured step times instead of fixed).

The engine measures every step it runs and fits, by least squares over its latest steps,

    step seconds = a + b * decode tokens + c * prompt tokens

A request's TPOT is the mean of its intervals, so the target is kept on average, not by every step: each
step with decodes adds (target - its time) to a credit (capped at CREDIT_STEPS targets, either way), and
the next step may take (target + credit - a - b * d) / c prompt tokens beside its d decodes, none when
that is under MIN_PROMPT_TOKENS (a chunk that small costs more per token than it moves: the credit
grows instead), never more than the engine's max_num_batched_tokens. Where the decodes alone take most
of the target (a slow CPU), prompts then go in bigger, rarer chunks rather than a small one every step
past the target. A step with nothing decoding takes the full budget: no TPOT to keep. Until the fit has
steps of two sizes (the first few steps) the budget is the full one, whose steps the fit then learns
from. A request that starts as the credit is spent sees at most CREDIT_STEPS targets more over its
intervals (about 10% over 32 tokens at 3).
"""

from __future__ import annotations

from collections import deque

import numpy as np

MIN_PROMPT_TOKENS = 32
CREDIT_STEPS = 3  # the credit's bound, in targets
WINDOW = 256  # steps the fit looks back over (a machine's speed drifts: a neighbour, a frequency)
REFIT_EVERY = 8  # steps between fits (a fit costs tens of microseconds)


class StepTimeModel:
    """step seconds ~ a + b * decode tokens + c * prompt tokens, over the latest WINDOW steps."""

    def __init__(self, window: int = WINDOW):
        self.steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self.coef: tuple[float, float, float] | None = None
        self._since = 0

    def observe(self, decode: int, prompt: int, seconds: float) -> None:
        self.steps.append((decode, prompt, seconds))
        self._since += 1
        if self._since >= REFIT_EVERY:
            self._since = 0
            self.coef = self.fit()

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c), or None while the steps cannot tell them apart or c is not positive."""
        if len(self.steps) < 4:
            return None
        x = np.array([(1.0, d, p) for d, p, _ in self.steps])
        y = np.array([s for *_, s in self.steps])
        coef, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
        if rank < 3 or coef[2] <= 0:
            return None
        a, b, c = (float(v) for v in coef)
        return a, max(b, 0.0), c


class SloBudget:
    """The prompt tokens a step may take beside its decodes, to keep its time within target_s."""

    def __init__(self, target_s: float, max_tokens: int):
        self.target_s, self.max_tokens = target_s, max_tokens
        self.model = StepTimeModel()
        self.credit = 0.0  # seconds the steps with decodes ran under the target (over it: negative)

    def prompt_tokens(self, decode: int) -> int:
        if decode == 0 or self.model.coef is None:
            return self.max_tokens
        a, b, c = self.model.coef
        room = int((self.target_s + self.credit - a - b * decode) / c)
        return 0 if room < MIN_PROMPT_TOKENS else min(self.max_tokens, room)

    def observe(self, decode: int, prompt: int, seconds: float) -> None:
        """A step ran: the model learns from it, and one with decodes moves the credit."""
        self.model.observe(decode, prompt, seconds)
        if decode:
            bound = CREDIT_STEPS * self.target_s
            self.credit = max(-bound, min(bound, self.credit + self.target_s - seconds))
