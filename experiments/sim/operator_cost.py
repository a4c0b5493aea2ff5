"""The step model over operators: a CostModel whose layers (projections, MLP, norms, rope, activation,
residual adds, attention) are priced operator by operator by the models fitted on published GPU profiles
(experiments/sim/attention_ops.py's parameters: experiments/sim/data/a100-operators.json), and whose LM
head, collectives and overheads are priced as CostModel prices them. The same simulator, router and
scheduler run over it (`sim.cost: operators`); dense models only (an expert's or a latent cache's operators
are not in the profiles), on a GPU the operator models know (the one they were fitted on, or another from
its datasheet).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from experiments.sim import attention_ops
from experiments.sim.attention_ops import Shape
from experiments.sim.cost import CostModel

# the hardware presets (experiments/sim/hardware.py) the operator models know, by their profiles' GPU names
GPU_OF = {"a100-80gb": "a100", "h100": "h100"}


@dataclass(frozen=True)
class OperatorCost(CostModel):
    params: Path = field(default=attention_ops.PARAMS)

    def __post_init__(self):
        super().__post_init__()
        m = self.model
        if m.experts or m.mla:
            raise ValueError(
                f"sim.cost=operators prices dense models; {m.name} has experts or a latent cache"
            )
        if self.hw.name not in GPU_OF:
            raise ValueError(
                f"sim.cost=operators knows the GPUs {tuple(GPU_OF)}; got hardware {self.hw.name!r}"
            )
        if self.dp != 1:
            raise ValueError(
                f"sim.cost=operators prices dp=1 (a dense model's attention data parallel); got {self.dp}"
            )

    @cached_property
    def _fitted(self) -> tuple[dict, dict]:
        ops, attention, _ = attention_ops.load_params(self.params)
        return ops, attention

    @property
    def gpu(self) -> str:
        return GPU_OF[self.hw.name]

    @cached_property
    def shape(self) -> Shape:
        m = self.model
        return Shape(m.name, m.heads, m.kv_heads, m.hidden, m.intermediate, m.gated_mlp, m.rotary)

    def _linear_time(self, tokens: int) -> float:
        """Every layer's operators but attention at the step's tokens on one TP rank."""
        ops, _ = self._fitted
        return self.model.layers * attention_ops.layer_ops_seconds(ops, self.shape, self.gpu, self.tp, tokens)

    def attention_time(self, new_tokens: int, prefix: int) -> float:
        """Prefill attention of a chunk after prefix cached tokens, every layer."""
        _, attention = self._fitted
        one = attention_ops.prefill_attention_seconds(
            attention, self.shape, self.gpu, self.tp, new_tokens, prefix
        )
        return self.model.layers * one

    def decode_attention_time(self, kv_lens: list[int]) -> float:
        """One call over the batch a layer, each sequence over its KV and its new token, every layer."""
        if not kv_lens:
            return 0.0
        _, attention = self._fitted
        kv = [n + 1 for n in kv_lens]
        return self.model.layers * attention_ops.decode_attention_seconds(
            attention, self.shape, self.gpu, self.tp, kv
        )
