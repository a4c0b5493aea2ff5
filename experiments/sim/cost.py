"""A roofline cost model of one serving step, and of moving a request's KV between workers.

Each op class of a step takes max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x efficiency)):
- linear: every projection and MLP (experts: the ones the batch's tokens touch), FLOPs 2 x active
  weights x tokens, bytes the weights read once per step;
- attention: causal prefill over the prefix plus the chunk, or decode over the KV length; bytes the KV
  read (and written);
- LM head: only for the tokens that sample;
- TP communication: two ring all-reduces of the step's activations per layer over NVLink, each also
  the hardware's all-reduce latency (Hardware.allreduce_s: 0 for a datasheet preset, measured on a CPU,
  where gloo's latency rules).
Everything divides over TP ranks (weights, heads, KV; replicated MLA latents do not shrink with TP).

An instance may also run attention data-parallel (dp > 1, as SGLang's and vLLM's DP attention for
DeepSeek): its tp x dp ranks each hold their own sequences and KV, the attention side (projections,
dense layers, LM head) is replicated over the dp groups, and the routed and shared experts are spread
over all ranks (expert parallel), with an all-to-all dispatch and combine of each MoE layer's tokens over
NVLink (its bandwidth, and the latency of the engine's three exchanges a layer, Hardware.alltoall_s
each, and of the groups' agreement a step, an all-reduce; no expert load imbalance). A step's time is
one rank's, the batch split evenly over the dp groups.

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
    seq_overhead_s: float = 0.0  # fixed cost per sequence in a step (per-sequence work outside the roofline)
    # fixed cost per step of an instance of more than one rank (the lead's message to its other ranks,
    # their wake-up, the slowest one's lag), beyond its collectives
    ranks_overhead_s: float = 0.0

    def __post_init__(self):
        for key in ("linear", "attention", "memory", "comm"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"efficiency.{key} must be in (0, 1], got {getattr(self, key)!r}")
        for key in ("step_overhead_s", "seq_overhead_s", "ranks_overhead_s"):
            if getattr(self, key) < 0:
                raise ValueError(f"efficiency.{key} must be >= 0, got {getattr(self, key)!r}")


def _roof(flops: float, nbytes: float, hw: Hardware, eff_flops: float, eff: Efficiency) -> float:
    return max(flops / (hw.flops * eff_flops), nbytes / (hw.hbm_bw * eff.memory))


@dataclass(frozen=True)
class CostModel:
    model: SimModel
    hw: Hardware
    tp: int = 1
    eff: Efficiency = Efficiency()
    dp: int = 1  # attention data-parallel groups (experts expert-parallel over tp x dp ranks)

    def __post_init__(self):
        if self.tp < 1 or self.model.heads % self.tp:
            raise ValueError(f"tp={self.tp} must be >= 1 and divide the {self.model.heads} heads")
        if self.dp < 1:
            raise ValueError(f"dp={self.dp} must be >= 1")

    @property
    def ranks(self) -> int:
        return self.tp * self.dp

    # ---- pieces ----------------------------------------------------------------------------------

    def kv_bytes_per_token_per_rank(self) -> float:
        m = self.model
        if m.mla:  # one latent per token, replicated on every rank
            return m.kv_bytes_per_token()
        return m.kv_bytes_per_token() / min(self.tp, m.kv_heads)  # fewer kv heads than ranks: one each

    @cached_property
    def _params(self) -> tuple[float, float, float]:
        """(attention-side weights, of which active per token, routed+shared experts' active weights
        per token): the attention side is the projections of every layer and the dense layers' MLPs."""
        m = self.model
        total = sum(m.layer_params(i, active=False) for i in range(m.layers))
        active = sum(m.layer_params(i, active=True) for i in range(m.layers))
        experts_active = m.moe_layers * self._expert_params(m.active_experts)
        return total - m.moe_layers * self._expert_params(m.experts), active - experts_active, experts_active

    def _expert_params(self, routed: float) -> float:
        """One MoE layer's routed (`routed` of them) and shared experts' weights (0 for dense models)."""
        m = self.model
        return (routed + m.shared_experts) * m.mlp_params(m.expert_intermediate) if m.experts else 0.0

    def weights_read(self, tokens: float) -> float:
        """Bytes of weights a step over `tokens` tokens reads, over all ranks: the attention side, and of
        each MoE layer the expected distinct routed experts among tokens x active uniform picks."""
        m = self.model
        touched = m.experts * (1 - (1 - m.active_experts / m.experts) ** tokens) if m.experts else 0
        return (self._params[0] + m.moe_layers * self._expert_params(touched)) * m.bytes_per_param

    def weight_bytes_per_rank(self) -> float:
        """What one rank holds: the attention side and embeddings sharded by TP, experts over all ranks."""
        m = self.model
        experts = m.moe_layers * self._expert_params(m.experts)
        embeddings = (1 if m.tied_embeddings else 2) * m.vocab * m.hidden
        return ((self._params[0] + embeddings) / self.tp + experts / self.ranks) * m.bytes_per_param

    @cached_property
    def _memo(self) -> dict:
        """What a step's pieces cost by their arguments (a simulated run asks the same few thousand times)."""
        return {}

    def _kept(self, piece, n: int) -> float:
        """piece(n), computed once per cost model and n."""
        key = (piece.__name__, n)
        if key not in self._memo:
            self._memo[key] = piece(n)
        return self._memo[key]

    def linear_time(self, tokens: int) -> float:
        """Projections and MLPs of every layer for `tokens` tokens (weights read once). With dp > 1 a
        rank runs the attention side for its 1/dp of the tokens and its share of every token's experts."""
        return self._kept(self._linear_time, tokens)

    def _linear_time(self, tokens: int) -> float:
        m = self.model
        side, side_active, experts_active = self._params
        experts_read = self.weights_read(tokens) - side * m.bytes_per_param
        flops = 2 * (tokens / self.dp) * side_active / self.tp + 2 * tokens * experts_active / self.ranks
        nbytes = side * m.bytes_per_param / self.tp + experts_read / self.ranks
        return _roof(flops, nbytes, self.hw, self.eff.linear, self.eff)

    def attention_time(self, new_tokens: int, prefix: int) -> float:
        """Causal attention of new_tokens tokens after prefix cached ones (decode: new_tokens=1), on
        the rank that holds the sequence."""
        per_pair, per_token = self._attention_rates
        pairs = new_tokens * prefix + new_tokens * (new_tokens + 1) / 2  # (query, key) pairs, causal
        return max(pairs * per_pair, (prefix + new_tokens) * per_token)

    @cached_property
    def _attention_rates(self) -> tuple[float, float]:
        """Seconds of attention a (query, key) pair computes and a token of KV reads: the roofline's two
        terms per unit (each grows linearly, so a step's is the larger of their multiples)."""
        m = self.model
        qk_dim = m.head_dim + (m.rope_dim if m.mla else 0)
        flops = 2 * m.heads * (qk_dim + m.head_dim) * m.layers / self.tp
        return (
            _roof(flops, 0, self.hw, self.eff.attention, self.eff),
            _roof(0, self.kv_bytes_per_token_per_rank(), self.hw, self.eff.attention, self.eff),
        )

    def decode_attention_time(self, kv_lens: list[int]) -> float:
        """Attention of one new token for each sequence. FLOPs and bytes are both proportional to each
        sequence's KV length + 1, so the sum of rooflines is one roofline of the total."""
        if not kv_lens:
            return 0.0
        return self.attention_time(1, sum(kv_lens) + len(kv_lens) - 1)

    def lm_head_time(self, sampled: int) -> float:
        return self._kept(self._lm_head_time, sampled)

    def _lm_head_time(self, sampled: int) -> float:
        m = self.model
        flops = 2 * (sampled / self.dp) * m.vocab * m.hidden / self.tp
        nbytes = m.vocab * m.hidden * m.bytes_per_param / self.tp if sampled else 0
        return _roof(flops, nbytes, self.hw, self.eff.linear, self.eff)

    def allreduce_time(self, tokens: int) -> float:
        """Two ring all-reduces of the activations per layer (each its bandwidth and latency)."""
        if self.tp == 1:
            return 0.0
        nbytes = tokens / self.dp * self.model.hidden * self.model.activation_bytes
        one = 2 * (self.tp - 1) / self.tp * nbytes / (self.hw.nvlink_bw * self.eff.comm)
        return 2 * self.model.layers * (one + self.hw.allreduce_s)

    def alltoall_time(self, tokens: int) -> float:
        """Expert parallel over dp groups: each MoE layer sends every token's hidden state to the ranks
        of its active experts and back (dispatch and combine); a rank sends its 1/dp of the tokens. Plus
        the latencies: three exchanges an MoE layer (counts, rows, rows back: engine/moe.py's dispatch)
        and the groups' agreement a step (an all-reduce)."""
        m = self.model
        if self.dp == 1:
            return 0.0
        if not m.experts:
            return self.hw.allreduce_s
        nbytes = tokens / self.dp * m.active_experts * m.hidden * m.activation_bytes
        one = (self.ranks - 1) / self.ranks * nbytes / (self.hw.nvlink_bw * self.eff.comm)
        return 2 * m.moe_layers * one + 3 * m.moe_layers * self.hw.alltoall_s + self.hw.allreduce_s

    # ---- steps -----------------------------------------------------------------------------------

    def step_time(
        self, chunks: list[tuple[int, int]], decode_kv_lens: list[int], sampled: int | None = None
    ) -> float:
        """One forward pass: prefill chunks (new tokens, prefix length) and decode sequences (KV length
        before this token). sampled: tokens that sample (default: every decode sequence)."""
        tokens = sum(n for n, _ in chunks) + len(decode_kv_lens)
        if tokens == 0:
            return 0.0
        attn = sum(self.attention_time(n, p) for n, p in chunks) + self.decode_attention_time(decode_kv_lens)
        attn /= self.dp  # the sequences spread over the dp groups
        sampled = len(decode_kv_lens) if sampled is None else sampled
        return (
            self.linear_time(tokens)
            + attn
            + self.lm_head_time(sampled)
            + self.allreduce_time(tokens)
            + self.alltoall_time(tokens)
            + self.eff.step_overhead_s
            + (self.eff.ranks_overhead_s if self.ranks > 1 else 0.0)
            + self.eff.seq_overhead_s * (len(chunks) + len(decode_kv_lens)) / self.dp
        )

    def step_bytes(
        self, chunks: list[tuple[int, int]], decode_kv_lens: list[int], sampled: int | None = None
    ) -> float:
        """What one forward pass (as step_time's arguments) reads from memory on a rank: the weights once,
        each sequence's KV, the LM head where a token samples (what a neighbour on the same memory slows)."""
        m = self.model
        tokens = sum(n for n, _ in chunks) + len(decode_kv_lens)
        if tokens == 0:
            return 0.0
        side = self._params[0] * m.bytes_per_param
        weights = side / self.tp + (self.weights_read(tokens) - side) / self.ranks
        kv = sum(n + p for n, p in chunks) + sum(decode_kv_lens) + len(decode_kv_lens)
        sampled = len(decode_kv_lens) if sampled is None else sampled
        head = m.vocab * m.hidden * m.bytes_per_param / self.tp if sampled else 0.0
        return weights + kv * self.kv_bytes_per_token_per_rank() / self.dp + head

    def prefill_time(self, prompt_lens: list[int]) -> float:
        """A batch of whole prompts in one pass (each samples its first token)."""
        return self.step_time([(n, 0) for n in prompt_lens], [], sampled=len(prompt_lens))

    def decode_time(self, kv_lens: list[int]) -> float:
        return self.step_time([], kv_lens)


def transfer_time(kv_bytes: float, hw: Hardware, links: int, eff: Efficiency) -> float:
    """Seconds the link takes to carry a request's KV. links: NICs sending in parallel (one per prefill
    rank that holds a distinct shard). When it leaves and what of it shows after the prefill (layer
    streaming hides what the passes' compute covers, one request's pages wait for another's) is the
    simulation's: simulate.Simulation.prefilled."""
    return kv_bytes / (hw.nic_bw * links * eff.comm)
