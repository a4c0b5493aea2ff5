"""A toy model and a stub cost model with round step times, shared by the simulator's tests."""

from experiments.sim.cost import CostModel
from experiments.sim.models import SimModel

# 2 layers, hidden 8, 4 heads of 2 (MHA): 32 bytes of KV per token at 1 byte per parameter
TOY = SimModel(
    "toy", 2, hidden=8, heads=4, kv_heads=4, head_dim=2, intermediate=16, vocab=10, bytes_per_param=1
)


def fixed_steps(base_s: float, per_prefill_token_s: float) -> type[CostModel]:
    """A CostModel whose every step takes base_s plus per_prefill_token_s per prefill token; decode
    steps take base_s whatever the batch."""

    class FixedSteps(CostModel):
        def step_time(self, chunks, decode_kv_lens, sampled=None):
            if not chunks and not decode_kv_lens:
                return 0.0
            return base_s + per_prefill_token_s * sum(n for n, _ in chunks)

        def decode_time(self, kv_lens):
            return base_s

    return FixedSteps
