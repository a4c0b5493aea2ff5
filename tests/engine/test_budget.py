"""The SLO-driven step budget (engine/budget.py): the step-time fit recovers a known machine, the budget
gives prompts what keeps every decoding request's mean interval within its target (its slack so far, and
its next steps up to a horizon), and the engine's text does not change."""

import random

import pytest

from engine import LLM, SamplingParams
from engine.budget import HORIZON_TOKENS, MIN_PROMPT_TOKENS, SloBudget, StepTimeModel, decode_state

A, B, C = 0.004, 0.0015, 0.00025  # seconds: per step, per decode token, per prompt token


def _steps(model, n=64, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        d, p = rng.randrange(0, 20), rng.choice([0, 0, 64, 200, 512])
        model.observe(d, p, A + B * d + C * p)


def test_the_fit_recovers_the_machine_it_measured():
    model = StepTimeModel()
    _steps(model)
    assert model.coef == pytest.approx((A, B, C), rel=1e-6)


def test_steps_of_one_shape_tell_nothing_and_the_budget_stays_full():
    model = StepTimeModel()
    for _ in range(32):
        model.observe(4, 128, 0.05)  # one kind of step: a, b and c cannot be told apart
    assert model.fit() is None
    budget = SloBudget(0.1, 2048)
    for _ in range(32):
        budget.model.observe(4, 128, 0.05)
    assert budget.prompt_tokens(_fresh(4)) == 2048


def _fresh(n):
    """n requests at their first decode step, with no token to come after it."""
    return [(0, 0.0, 0)] * n


@pytest.mark.parametrize(
    "target, decode, expected",
    [
        (0.1, 8, lambda a, b, c: int((0.1 - a - 8 * b) / c)),  # what the target leaves after the decodes
        (0.1, 0, lambda *_: 2048),  # nothing decoding: no TPOT to keep
        (0.01, 8, lambda *_: 0),  # the decodes alone pass it: no prompt token until slack builds
        (10.0, 8, lambda *_: 2048),  # never past the engine's own budget
    ],
)
def test_the_budget_leaves_the_decodes_their_target(target, decode, expected):
    budget = SloBudget(target, 2048)
    _steps(budget.model)
    # from the fit's coefficients (A, B, C to 1e-6), not A, B, C: 336.0 tokens exactly must not truncate to
    # 335 on a CPU whose least-squares solve ends a bit lower
    assert budget.prompt_tokens(_fresh(decode)) == expected(*budget.model.coef)


def test_a_request_under_the_target_lends_its_slack_and_one_over_it_takes_none():
    budget = SloBudget(0.02, 2048)
    _steps(budget.model)
    # the fit's own coefficients (A, B, C to 1e-6: the test above): a count at a whole number of tokens
    # must not hang on the last bit of a least-squares solve, which differs between CPUs' BLAS kernels
    a, b, c = budget.model.coef
    d = a + 8 * b  # a decode-only step of 8: 16 ms of the 20
    # at its first decode, nothing to come: what the target leaves moves 16 prompt tokens, under the minimum
    assert budget.prompt_tokens(_fresh(8)) == 0
    ahead = [(4, 4 * d, 0)] * 8  # 4 intervals of 16 ms: 16 ms saved
    assert budget.prompt_tokens(ahead) == int((0.02 * 5 - 4 * d - d) / c)  # 80 tokens
    late = (4, 4 * 0.025, 0)  # 25 ms each: over
    assert budget.prompt_tokens([*ahead[:7], late]) == 0  # the tightest request decides
    # tokens to come: each of its next decode-only steps gives back 4 ms
    coming = [(0, 0.0, 40)] * 8
    slack = 0.02 * (1 + HORIZON_TOKENS) - HORIZON_TOKENS * d
    assert budget.prompt_tokens(coming) == int((slack - d) / c)
    assert budget.prompt_tokens([(0, 0.0, 3)] * 8) == int((0.02 * 4 - 3 * d - d) / c)  # 3 more, not 16
    assert MIN_PROMPT_TOKENS > 16


def test_decode_state_reads_a_request_s_token_times():
    assert decode_state([10.0, 10.5, 11.0], now=11.2, remaining=5) == (2, pytest.approx(1.2), 5)
    assert decode_state([], now=3.0, remaining=2) == (0, 0.0, 2)  # no token yet: no slack spent
    assert decode_state([1.0], now=2.0, remaining=-1) == (0, 1.0, 0)


def test_steps_with_decodes_take_only_the_budget_and_the_text_does_not_change():
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 40000) for _ in range(300)] for _ in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in LLM("tiny-random", max_num_batched_tokens=512).generate(prompts, params)]
    llm = LLM("tiny-random", max_num_batched_tokens=512, step_target_s=0.1)
    budget = llm.scheduler.budget
    budget.model.coef = (0.0, 0.001, 0.001)  # as if measured: 100 tokens fill a step
    budget.model.observe = lambda *step: None  # and kept so
    allowed = []
    sized = budget.prompt_tokens
    budget.prompt_tokens = lambda states: allowed.append(sized(states)) or allowed[-1]  # what each step got
    for i, p in enumerate(prompts):
        llm.add_request(p, params, request_id=f"r{i}")
    sizes, done = [], {}
    while llm.has_unfinished():
        asked = len(allowed)
        done.update((o.request_id, o.token_ids) for o in llm.step() if o.finished)
        if llm.core.last_step is not None and len(allowed) > asked:  # a step with decodes
            sizes.append((llm.core.last_step.prefill_tokens, allowed[-1]))
            llm.core.last_step = None
    assert [done[f"r{i}"] for i in range(6)] == expected
    assert sizes and any(p > 0 for p, _ in sizes)  # prompts went on beside the decodes ...
    assert all(p <= allowed for p, allowed in sizes)  # ... within what the target left them


@pytest.mark.parametrize("value", [0, -1, 61, "fast", True])
def test_a_bad_step_target_names_the_field(value):
    with pytest.raises(ValueError, match=r"step_target_s must be None or seconds in \(0, 60\]"):
        LLM("tiny-random", step_target_s=value)
