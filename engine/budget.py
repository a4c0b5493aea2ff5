"""An SLO-driven step budget: each step's prompt tokens sized so that the sequences decoding in it stay
inside a time per output token (Sarathi-Serve's stall-free batching, with the chunk sized from the SLO
and the worker's own measured step times instead of fixed).

The engine measures every step it runs and fits, by least squares over its latest steps,

    step seconds = a + b * decode tokens + c * prompt tokens

then gives a step with d decode tokens at most (target - a - b * d) / c prompt tokens (at least
MIN_PROMPT_TOKENS, so prompts still advance when the decodes alone fill the target; at most the
engine's max_num_batched_tokens). A step with nothing decoding takes the full budget: no TPOT to keep.
Until the fit has steps of two sizes (the first few steps) the budget is the full one, whose steps the
fit then learns from.
"""

from __future__ import annotations

from collections import deque

import numpy as np

MIN_PROMPT_TOKENS = 32
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

    def predict(self, decode: int, prompt: int) -> float | None:
        if self.coef is None:
            return None
        a, b, c = self.coef
        return a + b * decode + c * prompt


class SloBudget:
    """The prompt tokens a step may take beside its decodes, to keep its time within target_s."""

    def __init__(self, target_s: float, max_tokens: int):
        self.target_s, self.max_tokens = target_s, max_tokens
        self.model = StepTimeModel()

    def prompt_tokens(self, decode: int) -> int:
        if decode == 0 or self.model.coef is None:
            return self.max_tokens
        a, b, c = self.model.coef
        room = (self.target_s - a - b * decode) / c
        return int(min(self.max_tokens, max(MIN_PROMPT_TOKENS, room)))
