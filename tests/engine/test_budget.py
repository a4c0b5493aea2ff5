"""The SLO-driven step budget (engine/budget.py): the step-time fit recovers a known machine, the budget
gives prompts what keeps a step with decodes within its target, and the engine's text does not change."""

import random

import pytest

from engine import LLM, SamplingParams
from engine.budget import CREDIT_STEPS, MIN_PROMPT_TOKENS, SloBudget, StepTimeModel

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
    assert budget.prompt_tokens(4) == 2048


@pytest.mark.parametrize(
    "target, decode, expected",
    [
        (0.1, 8, int((0.1 - A - 8 * B) / C)),  # what the target leaves after the decodes
        (0.1, 0, 2048),  # nothing decoding: no TPOT to keep
        (0.01, 8, 0),  # the decodes alone pass it: no prompt token until credit builds
        (10.0, 8, 2048),  # never past the engine's own budget
    ],
)
def test_the_budget_leaves_the_decodes_their_target(target, decode, expected):
    budget = SloBudget(target, 2048)
    _steps(budget.model)
    assert budget.prompt_tokens(decode) == expected


def test_steps_under_the_target_save_credit_for_a_bigger_chunk_and_late_ones_spend_it():
    budget = SloBudget(0.02, 2048)
    _steps(budget.model)
    budget.credit = 0.0
    # 8 decodes alone: 16 ms of the 20; what is left moves 16 prompt tokens, under the minimum
    assert budget.prompt_tokens(8) == 0
    for _ in range(4):
        budget.observe(8, 0, A + 8 * B)  # 4 ms under the target each
    assert budget.credit == pytest.approx(0.016)
    assert budget.prompt_tokens(8) == int((0.02 + 0.016 - A - 8 * B) / C)  # 80 tokens
    budget.observe(8, 80, 0.1)  # a step far past it: the credit goes below zero, bounded
    assert budget.credit == pytest.approx(-CREDIT_STEPS * 0.02)
    assert budget.prompt_tokens(8) == 0
    for _ in range(100):
        budget.observe(1, 0, 0.0)
    assert budget.credit == pytest.approx(CREDIT_STEPS * 0.02)  # bounded above too
    assert MIN_PROMPT_TOKENS > 16


def test_steps_with_decodes_take_only_the_budget_and_the_text_does_not_change():
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 40000) for _ in range(300)] for _ in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in LLM("tiny-random", max_num_batched_tokens=512).generate(prompts, params)]
    llm = LLM("tiny-random", max_num_batched_tokens=512, step_target_s=0.1)
    budget = llm.scheduler.budget
    budget.model.coef = (0.0, 0.001, 0.001)  # as if measured: 100 tokens fill a step
    budget.model.observe = lambda *step: None  # and kept so
    for i, p in enumerate(prompts):
        llm.add_request(p, params, request_id=f"r{i}")
    sizes, done = [], {}
    while llm.has_unfinished():
        decoding = sum(1 for s in llm.scheduler.running if s.num_computed == s.num_tokens - 1)
        allowed = budget.prompt_tokens(decoding)  # before the step: it moves the credit
        done.update((o.request_id, o.token_ids) for o in llm.step() if o.finished)
        if llm.last_step is not None and decoding:
            sizes.append((llm.last_step.prefill_tokens, allowed))
            llm.last_step = None
    assert [done[f"r{i}"] for i in range(6)] == expected
    assert sizes and any(p > 0 for p, _ in sizes)  # prompts went on beside the decodes ...
    assert all(p <= allowed for p, allowed in sizes)  # ... within what the target left them


@pytest.mark.parametrize("value", [0, -1, 61, "fast", True])
def test_a_bad_step_target_names_the_field(value):
    with pytest.raises(ValueError, match=r"step_target_s must be None or seconds in \(0, 60\]"):
        LLM("tiny-random", step_target_s=value)
