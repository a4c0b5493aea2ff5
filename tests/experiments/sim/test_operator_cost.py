"""experiments/sim/operator_cost.py: a step priced operator by operator from the committed A100 fits
(OPT-13B on one A100: a batch-1 decode step at 544 tokens of KV 17.9 ms, DistServe's vLLM profile 19.9; a
512-token prefill 69.6 ms, the profile's 103), H100 from its datasheet, and what it cannot price refused."""

import re

import pytest

from experiments.sim.cost import CostModel, Efficiency
from experiments.sim.hardware import hardware
from experiments.sim.models import sim_model
from experiments.sim.operator_cost import OperatorCost


def _cost(model="opt-13b", hw="a100-80gb", tp=1, dp=1):
    return OperatorCost(sim_model(model), hardware(hw), tp, Efficiency(), dp)


def test_opt_13b_steps_on_an_a100():
    cost = _cost()
    assert cost.decode_time([544]) == pytest.approx(17.90e-3, rel=0.01)
    assert cost.prefill_time([512]) == pytest.approx(69.55e-3, rel=0.01)
    # a prompt batched into a batch-1 decode step: what the interference rows price
    assert cost.step_time([(128, 0)], [544]) / cost.decode_time([544]) == pytest.approx(1.547, rel=0.01)
    assert cost.decode_time([544] * 32) < 2 * cost.decode_time([544])  # decode reads its weights once


def test_the_layers_are_the_operators_and_the_rest_is_the_roofline_s():
    ops, roof = _cost(), CostModel(sim_model("opt-13b"), hardware("a100-80gb"), 1, Efficiency())
    assert ops.lm_head_time(1) == roof.lm_head_time(1) and ops.allreduce_time(64) == roof.allreduce_time(64)
    assert ops.linear_time(1) != roof.linear_time(1)
    h100 = _cost(hw="h100")
    assert h100.prefill_time([2048]) < 0.5 * ops.prefill_time([2048])  # 3.2x the peak
    tp2 = _cost("llama-3-8b", tp=2)
    assert tp2.allreduce_time(8) > 0 and tp2.linear_time(512) < _cost("llama-3-8b").linear_time(512)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(model="deepseek-r1"), "prices dense models; deepseek-r1 has experts or a latent cache"),
        (dict(hw="h200"), "knows the GPUs ('a100-80gb', 'h100'); got hardware 'h200'"),
        (dict(model="llama-3-8b", dp=2), "prices dp=1"),
    ],
)
def test_what_it_cannot_price_is_refused(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _cost(**kw)
