"""A roofline cost model of one serving step, and of moving a request's KV between workers.

Each op class of a step takes max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x efficiency)):
- linear: every projection and MLP (experts: the ones the batch's tokens touch), FLOPs 2 x active
  weights x tokens, bytes the weights read once per step;
- attention: causal prefill over the prefix plus the chunk, or decode over the KV length; bytes the KV
  read (and written);
- LM head: only for the tokens that sample;
- TP communication: two ring all-reduces of the step's activations per layer over NVLink.
Everything divides over TP ranks (weights, heads, KV; replicated MLA latents do not shrink with TP).
The efficiency factors (fractions of peak) are what calibration fits; the defaults are round guesses.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from experiments.sim.hardware import Hardware
from experiments.sim.models import SimModel


@dataclass(frozen=True)
class Efficiency:
    linear: float = 0.7  # of peak FLOP/s reached by GEMMs
    attention: float = 0.5  # of peak FLOP/s reached by attention
    memory: float = 0.8  # of HBM bandwidth reached by memory-bound kernels
    comm: float = 0.7  # of NVLink / NIC bandwidth reached by collectives and transfers
    step_overhead_s: float = 0.0  # fixed cost per step (launches, scheduling)

    def __post_init__(self):
        for key in ("linear", "attention", "memory", "comm"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"efficiency.{key} must be in (0, 1], got {getattr(self, key)!r}")
        if self.step_overhead_s < 0:
            raise ValueError(f"efficiency.step_overhead_s must be >= 0, got {self.step_overhead_s!r}")


def _roof(flops: float, nbytes: float, hw: Hardware, eff_flops: float, eff: Efficiency) -> float:
    return max(flops / (hw.flops * eff_flops), nbytes / (hw.hbm_bw * eff.memory))


@dataclass(frozen=True)
class CostModel:
    model: SimModel
    hw: Hardware
    tp: int = 1
    eff: Efficiency = Efficiency()

    def __post_init__(self):
        if self.tp < 1 or self.model.heads % self.tp:
            raise ValueError(f"tp={self.tp} must be >= 1 and divide the {self.model.heads} heads")

    # ---- pieces ----------------------------------------------------------------------------------

    def kv_bytes_per_token_per_rank(self) -> float:
        m = self.model
        if m.mla:  # one latent per token, replicated on every rank
            return m.kv_bytes_per_token()
        return m.kv_bytes_per_token() / min(self.tp, m.kv_heads)  # fewer kv heads than ranks: one each

    @cached_property
    def _active_params(self) -> int:
        return sum(self.model.layer_params(i, active=True) for i in range(self.model.layers))

    def linear_time(self, tokens: int) -> float:
        """Projections and MLPs of every layer for `tokens` tokens (weights read once)."""
        flops = 2 * tokens * self._active_params
        nbytes = self._weight_bytes(tokens)
        return _roof(flops / self.tp, nbytes / self.tp, self.hw, self.eff.linear, self.eff)

    def _weight_bytes(self, tokens: int) -> float:
        m = self.model
        if not m.experts:
            return self._dense_weight_bytes
        moe = m.layers - m.dense_layers
        dense = m.dense_layers * m.layer_params(0, active=False)
        return (dense + moe * self._weights_touched(m.layers - 1, tokens)) * m.bytes_per_param

    @cached_property
    def _dense_weight_bytes(self) -> float:
        return (
            sum(self.model.layer_params(i, active=False) for i in range(self.model.layers))
            * self.model.bytes_per_param
        )

    def _weights_touched(self, layer: int, tokens: int) -> float:
        m = self.model
        if not m.experts or layer < m.dense_layers:
            return m.layer_params(layer, active=False)
        # expected distinct routed experts among tokens x active_experts uniform picks
        distinct = m.experts * (1 - (1 - m.active_experts / m.experts) ** tokens)
        return m.attn_params() + (distinct + m.shared_experts) * m.mlp_params(m.expert_intermediate)

    def attention_time(self, new_tokens: int, prefix: int) -> float:
        """Causal attention of new_tokens tokens after prefix cached ones (decode: new_tokens=1)."""
        m = self.model
        qk_dim = m.head_dim + (m.rope_dim if m.mla else 0)
        pairs = new_tokens * prefix + new_tokens * (new_tokens + 1) / 2  # (query, key) pairs, causal
        flops = 2 * pairs * m.heads * (qk_dim + m.head_dim) * m.layers / self.tp
        nbytes = (prefix + new_tokens) * self.kv_bytes_per_token_per_rank()
        return _roof(flops, nbytes, self.hw, self.eff.attention, self.eff)

    def lm_head_time(self, sampled: int) -> float:
        m = self.model
        flops = 2 * sampled * m.vocab * m.hidden / self.tp
        nbytes = m.vocab * m.hidden * m.bytes_per_param / self.tp if sampled else 0
        return _roof(flops, nbytes, self.hw, self.eff.linear, self.eff)

    def allreduce_time(self, tokens: int) -> float:
        """Two ring all-reduces of the activations per layer."""
        if self.tp == 1:
            return 0.0
        nbytes = tokens * self.model.hidden * self.model.bytes_per_param
        one = 2 * (self.tp - 1) / self.tp * nbytes / (self.hw.nvlink_bw * self.eff.comm)
        return 2 * self.model.layers * one

    # ---- steps -----------------------------------------------------------------------------------

    def step_time(
        self, chunks: list[tuple[int, int]], decode_kv_lens: list[int], sampled: int | None = None
    ) -> float:
        """One forward pass: prefill chunks (new tokens, prefix length) and decode sequences (KV length
        before this token). sampled: tokens that sample (default: every decode sequence)."""
        tokens = sum(n for n, _ in chunks) + len(decode_kv_lens)
        if tokens == 0:
            return 0.0
        attn = sum(self.attention_time(n, p) for n, p in chunks)
        attn += sum(self.attention_time(1, k) for k in decode_kv_lens)
        sampled = len(decode_kv_lens) if sampled is None else sampled
        return (
            self.linear_time(tokens)
            + attn
            + self.lm_head_time(sampled)
            + self.allreduce_time(tokens)
            + self.eff.step_overhead_s
        )

    def prefill_time(self, prompt_lens: list[int]) -> float:
        """A batch of whole prompts in one pass (each samples its first token)."""
        return self.step_time([(n, 0) for n in prompt_lens], [], sampled=len(prompt_lens))

    def decode_time(self, kv_lens: list[int]) -> float:
        return self.step_time([], kv_lens)


def transfer_time(
    kv_bytes: float, hw: Hardware, links: int, eff: Efficiency, prefill_s: float = 0.0, layers: int = 1
) -> float:
    """Seconds a request's KV transfer adds after its prefill. links: NICs sending in parallel (one per
    prefill rank that holds a distinct shard). Request-level (layers=1): the whole transfer. Layer-wise
    streaming over `layers` layers: layer l leaves when its compute ends, so only what the remaining
    compute cannot hide shows, and at least the last layer's share."""
    total = kv_bytes / (hw.nic_bw * links * eff.comm)
    if layers <= 1:
        return total
    hidden = prefill_s * (layers - 1) / layers
    return max(total / layers, total - hidden)
