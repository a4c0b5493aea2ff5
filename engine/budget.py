"""An SLO-driven step budget: each step's prompt tokens sized so that every request decoding in it stays
inside its time per output token (Sarathi-Serve's stall-free batching, with the chunk sized from the SLO,
each request's own slack and the worker's measured step times instead of fixed).

The engine measures every step it runs and fits, by least squares over its latest steps,

    step seconds = a + b * decode tokens + c * prompt tokens

A request's TPOT is the mean of its intervals, so one long step costs it that step over all its intervals,
not at once. Each decoding request i has produced its intervals so far in E_i seconds since its first
token; after this step of S seconds and h_i more decode-only steps of d = a + b * decodes each (h_i: the
tokens it may still generate after this step's, at most HORIZON_TOKENS), its mean stays within the target
while

    S <= target * (intervals so far + 1 + h_i) - E_i - h_i * d

The step takes the least of these over its decodes, and the prompt tokens that fit in it: (S - a - b *
decodes) / c, none when that is under MIN_PROMPT_TOKENS (a chunk that small costs more per token than it
moves: the requests' slack grows instead), never more than the engine's max_num_batched_tokens. So a
request that has run under the target lends its slack to a prompt, one that has run over it takes none
until decode-only steps bring it back, and a step with nothing decoding takes the full budget: no TPOT
to keep. HORIZON_TOKENS bounds the bet on a request's future steps (max_tokens counts them; one that
stops at EOS sooner has fewer to spread a long step over). Until the fit has steps of two sizes (the
first few steps) the budget is the full one, whose steps the fit then learns from.
"""

from __future__ import annotations

from collections import deque

import numpy as np

MIN_PROMPT_TOKENS = 32
HORIZON_TOKENS = 16  # a request's future decode steps counted on, at most
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


def decode_state(token_times: list[float], now: float, remaining: int) -> tuple[int, float, int]:
    """What SloBudget.prompt_tokens needs of a decoding request: (its intervals so far, seconds since its
    first token, tokens it may still generate after this step's), from its output tokens' times."""
    if not token_times:
        return 0, 0.0, max(remaining, 0)
    return len(token_times) - 1, now - token_times[0], max(remaining, 0)


class SloBudget:
    """The prompt tokens a step may take beside its decodes, to keep each decoding request's mean time
    per output token within target_s."""

    def __init__(self, target_s: float, max_tokens: int):
        self.target_s, self.max_tokens = target_s, max_tokens
        self.model = StepTimeModel()

    def step_seconds(self, decoding: list[tuple[int, float, int]]) -> float:
        """The longest step that keeps every one of `decoding` (decode_state's tuples) within the target,
        counting its next HORIZON_TOKENS decode-only steps at the modelled time (the fit is there)."""
        a, b, _ = self.model.coef
        d = a + b * len(decoding)
        return min(
            self.target_s * (done + 1 + min(left, HORIZON_TOKENS)) - elapsed - min(left, HORIZON_TOKENS) * d
            for done, elapsed, left in decoding
        )

    def prompt_tokens(self, decoding: list[tuple[int, float, int]]) -> int:
        """Prompt tokens beside these decodes (decode_state's tuples, one a decoding request)."""
        if not decoding or self.model.coef is None:
            return self.max_tokens
        a, b, c = self.model.coef
        room = int((self.step_seconds(decoding) - a - b * len(decoding)) / c)
        return 0 if room < MIN_PROMPT_TOKENS else min(self.max_tokens, room)

    def observe(self, decode: int, prompt: int, seconds: float) -> None:
        """A step ran: the model learns from it."""
        self.model.observe(decode, prompt, seconds)
