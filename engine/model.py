"""A Llama-family decoder over a paged KV cache, running on pdkernels.ops (DeepSeek's latent attention
in engine/mla.py, routed experts in engine/moe.py).

Tokens of all sequences in a step are packed into one ragged batch [T] (no padding). Each layer appends
its K/V to the paged cache, attends over it (decode or extend attention), and runs the output
projection that bumps the layer counter. With tensor parallelism each rank holds a head shard and a
slice of the MLP; the lead rank's counter is the one the messenger polls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engine import mla, moe
from engine.collectives import all_sum
from engine.config import ModelConfig, yarn_mscale
from pdkernels import cpu, cpuinfo, invariant, kv_quant, ops


@dataclass
class BatchMeta:
    """Where a step's tokens go: FlashInfer-style page table plus per-token request/position."""

    positions: Tensor  # [T] int32, position of each token in its sequence
    batch_indices: Tensor  # [T] int32, sequence of each token
    qo_indptr: Tensor  # [B + 1] int32, tokens of sequence b are qo_indptr[b]:qo_indptr[b+1]
    kv_indptr: Tensor  # [B + 1] int32
    kv_indices: Tensor  # int32 page ids
    kv_last_page_len: Tensor  # [B] int32, after this step's append
    all_decode: bool  # one token per sequence: decode attention
    counter: Tensor | None = None  # [2, layers] int32 layer counter (prefill role, lead rank)
    max_q_len: int | None = None  # the longest chunk, known on the host (the kernels need no sync for it)
    max_kv_len: int | None = None  # the longest sequence after this step (bounds decode's KV splits)
    # a CUDA graph's live decode plan: the step's split length in a device buffer, the grid's splits
    split_len: Tensor | None = None
    num_splits: int | None = None
    # batch_invariant: each token's own page table (pdkernels.invariant.token_tables), made once a step
    token_tables: tuple[Tensor, Tensor, Tensor] | None = None


@dataclass(frozen=True)
class Shard:
    """This rank's slice of the heads and the MLP."""

    rank: int
    size: int
    q_heads: tuple[int, int]  # [start, end) of q heads
    kv_heads: tuple[int, int]  # [start, end) of kv heads (replicated when kv_heads < tp)
    mlp: tuple[int, int]
    expert_mlp: tuple[int, int] = (0, 0)  # [start, end) of every routed expert's MLP width (MoE layers)
    experts: tuple[int, int] | None = None  # expert parallelism: the whole experts [start, end) held here

    dp: int = 1  # data-parallel attention: dp groups of `size` ranks; the experts over all of them
    dp_rank: int = 0

    @staticmethod
    def of(
        config: ModelConfig,
        rank: int = 0,
        size: int = 1,
        expert_parallel: bool = False,
        dp: int = 1,
        dp_rank: int = 0,
    ) -> Shard:
        """TP rank `rank` of `size` (of DP group dp_rank of dp: its experts are its share of all
        size x dp ranks')."""
        hq = config.num_heads // size
        if config.num_kv_heads >= size:
            hkv = config.num_kv_heads // size
            kv = (rank * hkv, (rank + 1) * hkv)
        else:  # replicated: the kv head that this rank's q heads read
            head = rank * hq // (config.num_heads // config.num_kv_heads)
            kv = (head, head + 1)
        f = config.intermediate_size // size
        fe = config.moe.intermediate_size // size if config.moe else 0
        q = (rank * hq, (rank + 1) * hq)
        experts = None
        if expert_parallel or dp > 1:
            per = config.moe.num_experts // (size * dp)
            first = (dp_rank * size + rank) * per
            experts = (first, first + per)
        mlp, expert_mlp = (rank * f, (rank + 1) * f), (rank * fe, (rank + 1) * fe)
        return Shard(rank, size, q, kv, mlp, expert_mlp, experts, dp, dp_rank)

    @property
    def world_rank(self) -> int:
        return self.dp_rank * self.size + self.rank

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def rope_inv_freq(config: ModelConfig) -> Tensor:
    dim = config.rope_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":  # Llama 3.1 long-context frequency scaling
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind == "yarn":  # YaRN (DeepSeek): interpolate the low frequencies, keep the high ones
        factor, old_len = _yarn_factor(config), scaling["original_max_position_embeddings"]

        def correction_dim(rotations: float) -> float:
            return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(config.rope_theta))

        low = correction_dim(scaling.get("beta_fast") or 32)
        high = correction_dim(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
        inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    return inv_freq.float()


def _yarn_factor(config: ModelConfig) -> float:
    scaling = config.rope_scaling or {}
    return scaling.get("factor") or config.max_position / scaling["original_max_position_embeddings"]


def rope_attention_factor(config: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by (1 for other RoPE types)."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all = _yarn_factor(config), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor)


PROJECTIONS = ("qkv", "o", "gate_up", "down", "q_proj", "q_a", "q_b", "kv_a")  # plain [out, in] GEMMs


class Model:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, Tensor],
        device: torch.device,
        dtype: torch.dtype,
        shard: Shard | None = None,
        batch_invariant: bool = False,
        kv_layout: str = "HND",
    ):
        self.config, self.device, self.dtype = config, device, dtype
        self.kv_layout = kv_layout  # the paged cache's (engine.kv.cache.allocate_kv_cache): HND or NHD
        self.kv_scales: Tensor | None = None  # an e4m3 cache's: [layers, pages, planes, H] (kv_quant)
        # every token's result the same bits whatever its step holds (pdkernels.invariant): the projections
        # a row at a time, each token's attention over its own prefix, and no C++ step (its kernels differ
        # from the Python layers' by the batch's size and kind)
        self.batch_invariant = batch_invariant
        if batch_invariant and not invariant.available():  # refused here, not at the first step
            raise ValueError(
                "batch_invariant needs pdkernels' C++ extension, which is turned off (PDKERNELS_CPU_EXT=0) "
                "or could not be built here (no compiler: see the warning above): set batch_invariant=false"
            )
        self.shard = shard or Shard.of(config)
        self.tp_group = None  # the TP ranks' process group when it is not the default one (engine/tp.py)
        self.layers = [self._load_layer(weights, i) for i in range(config.num_layers)]
        self.embed = weights["model.embed_tokens.weight"].to(device, dtype)
        self.norm = weights["model.norm.weight"].to(device, dtype)
        lm_head = self.embed if config.tie_embeddings else weights["lm_head.weight"].to(device, dtype)
        # bf16 on the CPU: the projections' weights prepacked for oneDNN (pdkernels.cpu; a tied LM head
        # gets its own packed copy, the embedding stays a table)
        packing = device.type == "cpu" and ops.resolve("splitk_gemm", device) == "torch"
        self.lm_head = cpu.pack(lm_head) if packing else lm_head
        for layer in self.layers if packing else ():
            layer.update({k: cpu.pack(layer[k]) for k in PROJECTIONS if k in layer})
        if packing:  # build (first time on this machine, ~20 s) or load the C++ paths now, not in a request
            cpu.module()
        # the C++ step reads HND pages: an NHD cache takes the Python layers (whose kernels take either)
        fused = packing and not batch_invariant and kv_layout == "HND"
        self.decoder = self._dense_decoder() if fused else None
        # ... and its steps with prompt tokens: where the AMX attention takes this head dim
        self.decoder_extends = (  # where the Python layers' attention is the same AMX kernel
            self.decoder is not None
            and dtype == torch.bfloat16
            and self.decoder.extends()
            and cpuinfo.amx_bf16()
            and config.head_dim % 32 == 0
        )
        positions = torch.arange(config.max_position, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(config))  # [max_pos, D/2]
        scale = rope_attention_factor(config)
        self.cos, self.sin = (freqs.cos() * scale).to(device), (freqs.sin() * scale).to(device)

    def _dense_decoder(self):
        """The C++ step through every layer (pdkernels.cpu's DenseDecoder: the same kernels in the same
        order as forward, without the Python between them; decode steps, and steps with prompt tokens where
        their attention is the AMX kernel) where it serves: one rank, dense layers (no MLA, MoE or
        qk-norm), every projection on oneDNN's packed bf16 weights (with their panels, cpu.PanelWeight, on
        AVX-512 BF16 without AMX), or every one an fp32 weight held as int8 blocks too (cpu.Q8Weight: a GGUF
        file's Q8_0 and Q4_1 weights, on AVX2); else None."""
        ext, c = cpu.module(), self.config
        plain = not c.mla and not c.qk_norm and not any(c.is_moe_layer(i) for i in range(c.num_layers))
        if ext is None or not hasattr(ext, "DenseDecoder") or not plain or self.shard.size != 1:
            return None
        weights = [layer[k] for layer in self.layers for k in ("qkv", "o", "gate_up", "down")]
        kinds = {type(w) for w in weights}
        q8, panels, rows = [], [], cpu.PANEL_MAX_M
        if kinds == {cpu.Q8Weight} and hasattr(ext, "q8_linear"):
            q8, rows = [t for w in weights for t in (w.q, w.scales, w.offsets)], cpu.Q8_MAX_M
        elif kinds == {cpu.PanelWeight} and hasattr(ext, "bf16_linear"):
            panels = [w.panels for w in weights]
        elif kinds != {cpu.PackedWeight}:  # plain fp32 (not int8 blocks), or a mix
            return None
        norms = [layer[k] for layer in self.layers for k in ("input_norm", "post_norm")]
        d = c.head_dim
        return ext.DenseDecoder([w.data for w in weights], q8, panels, rows, norms, self.norm,
                                self.shard.num_q_heads, self.shard.num_kv_heads, d, c.rms_norm_eps,
                                1.0 / math.sqrt(d))  # fmt: skip

    def _load_layer(self, weights: dict[str, Tensor], i: int) -> dict[str, Tensor]:
        p, s, d = f"model.layers.{i}.", self.shard, self.config.head_dim

        def rows(name, lo, hi):
            return weights[p + name][lo:hi]

        layer = {
            "input_norm": weights[p + "input_layernorm.weight"],
            "post_norm": weights[p + "post_attention_layernorm.weight"],
        }
        if self.config.mla:
            layer.update(mla.load_attention(weights, p + "self_attn.", self.config, *s.q_heads))
        else:
            q = rows("self_attn.q_proj.weight", s.q_heads[0] * d, s.q_heads[1] * d)
            k = rows("self_attn.k_proj.weight", s.kv_heads[0] * d, s.kv_heads[1] * d)
            v = rows("self_attn.v_proj.weight", s.kv_heads[0] * d, s.kv_heads[1] * d)
            layer["qkv"] = torch.cat([q, k, v])  # one GEMM for q, k and v
            layer["o"] = weights[p + "self_attn.o_proj.weight"][:, s.q_heads[0] * d : s.q_heads[1] * d]
        if self.config.is_moe_layer(i):  # routed experts (engine/moe.py); the router is not sharded
            layer.update(moe.load_experts(weights, p + "mlp.", self.config.moe, *s.expert_mlp, s.experts))
        else:
            layer["gate_up"] = torch.cat(
                [rows("mlp.gate_proj.weight", *s.mlp), rows("mlp.up_proj.weight", *s.mlp)]
            )
            layer["down"] = weights[p + "mlp.down_proj.weight"][:, s.mlp[0] : s.mlp[1]]
        if self.config.qk_norm:
            layer["q_norm"] = weights[p + "self_attn.q_norm.weight"]
            layer["k_norm"] = weights[p + "self_attn.k_norm.weight"]
        fp32 = ("router", "router_bias") if self.config.moe and self.config.moe.fp32_router else ()
        return {
            k: w.to(self.device, torch.float32 if k in fp32 else self.dtype).contiguous()
            for k, w in layer.items()
        }

    def rms_norm(self, x: Tensor, w: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)).to(x.dtype) * w

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [T, H, D], cos/sin [T, 1, D/2]: rotate the two halves of each head (Hugging Face's layout)."""
        return ops.rope(x, cos, sin, validate=False)

    def linear(self, x: Tensor, w: Tensor | cpu.PackedWeight) -> Tensor:
        if self.batch_invariant:
            return invariant.linear_rows(x, w)
        if x.shape[0] <= 64 or isinstance(w, cpu.PackedWeight):
            return ops.linear(x, w, validate=False)
        return F.linear(x, w)

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of x over this rank's TP group (tp_group: its process group under data-parallel
        attention; None, the default group, otherwise)."""
        if self.shard.size == 1:
            return x
        if (
            x.dtype == torch.bfloat16 and x.device.type == "cpu"
        ):  # gloo sums fp32; so do GPUs' bf16 reductions
            y = x.float()
            all_sum(y, self.tp_group)
            return x.copy_(y)
        return all_sum(x, self.tp_group)

    def attention(
        self, layer: dict, i: int, x: Tensor, meta: BatchMeta, kv_cache: Tensor, rope: tuple
    ) -> Tensor:
        if self.config.mla:
            scales = None if self.kv_scales is None else self.kv_scales[i]
            o = mla.attention(self, layer, x, meta, kv_cache[i], rope, scales)
            return self.project_out(layer, i, o, meta)
        s, d = self.shard, self.config.head_dim
        qkv = self.linear(x, layer["qkv"]).view(x.shape[0], -1, d)  # [T, Hq + 2 Hkv, D]
        qk, v = qkv[:, : s.num_q_heads + s.num_kv_heads], qkv[:, s.num_q_heads + s.num_kv_heads :]
        if self.config.qk_norm:
            q, k = qk.split([s.num_q_heads, s.num_kv_heads], dim=1)
            qk = torch.cat([self.rms_norm(q, layer["q_norm"]), self.rms_norm(k, layer["k_norm"])], dim=1)
        q, k = self.rope(qk, *rope).split([s.num_q_heads, s.num_kv_heads], dim=1)
        cache = kv_cache[i]
        tables = (meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len)
        if cache.dtype == kv_quant.FP8:  # quantized as written, the batch's pages dequantized to be read
            scales = self.kv_scales[i]
            kv_quant.append_pages(
                k, v, meta.batch_indices, meta.positions, cache, scales, *tables[:2], self.kv_layout
            )
            cache, indices = kv_quant.gather_pages(cache, scales, meta.kv_indices, self.kv_layout, q.dtype)
            tables = (indices, *tables[1:])
        else:
            ops.kv_append(
                k, v, meta.batch_indices, meta.positions, cache, *tables, self.kv_layout, validate=False
            )
        if self.batch_invariant:
            if meta.token_tables is None:
                page_size = cache.shape[3]
                meta.token_tables = invariant.token_tables(
                    meta.batch_indices, meta.positions, meta.kv_indptr, meta.kv_indices, page_size
                )
            o = invariant.causal_attention(q, cache, *meta.token_tables)
        elif meta.all_decode:
            o = ops.decode_attention(
                q,
                cache,
                tables[1],
                tables[0],
                tables[2],
                kv_layout=self.kv_layout,
                max_seq_len=meta.max_kv_len,
                validate=False,
                split_len=meta.split_len,
                num_splits=meta.num_splits,
            )
        else:
            o = ops.extend_attention(
                q,
                meta.qo_indptr,
                cache,
                tables[1],
                tables[0],
                tables[2],
                kv_layout=self.kv_layout,
                max_q_len=meta.max_q_len,
                validate=False,
            )
        return self.project_out(layer, i, o.reshape(x.shape[0], -1), meta)

    def project_out(self, layer: dict, i: int, o: Tensor, meta: BatchMeta) -> Tensor:
        """The attention output [T, heads x dim] through o_proj, summed over TP ranks, counting layer i."""
        s = self.shard
        if self.batch_invariant:  # the CPU: the projection, then the bump (as out_proj_ref)
            y = self.all_reduce(self.linear(o, layer["o"]))
        elif s.size == 1:  # the projection's last tile bumps the layer counter (kernel-side, graph-safe)
            return ops.out_proj(o, layer["o"], counter=meta.counter, layer=i, validate=False)
        else:
            # With TP the lead may only count layer i once every rank has appended its KV shard: the
            # all-reduce returns after all ranks reached it, so the bump comes after it (stream-ordered
            # on GPU).
            y = self.all_reduce(ops.out_proj(o, layer["o"], validate=False))
        if s.rank == 0 and meta.counter is not None:
            meta.counter[0, i] += 1
        return y

    def forward(self, input_ids: Tensor, meta: BatchMeta, kv_cache: Tensor) -> Tensor:
        """input_ids [T] -> final hidden states [T, hidden]; kv_cache [layers, pages, 2, Hkv, P, D] (MLA:
        [layers, pages, 1, 1, P, latent row])."""
        x = self.embed[input_ids]  # the residual stream (a new tensor: updated in place below)
        rope = self.cos[meta.positions].unsqueeze(1), self.sin[meta.positions].unsqueeze(1)  # [T, 1, D/2]
        eps = self.config.rms_norm_eps
        h = ops.add_rms_norm(x, self.layers[0]["input_norm"], eps, validate=False)
        if (
            self.decoder is not None
            and self.kv_scales is None  # an e4m3 cache: the layers below quantize and dequantize it
            and kv_cache.is_contiguous()
            and (meta.all_decode or self.decoder_extends)
        ):
            tables = (
                meta.batch_indices,
                meta.positions,
                meta.kv_indices,
                meta.kv_indptr,
                meta.kv_last_page_len,
            )
            qo = None if meta.all_decode else meta.qo_indptr
            return self.decoder.run(x, h, *rope, *tables, kv_cache, meta.counter, qo)
        for i, layer in enumerate(self.layers):
            attn = self.attention(layer, i, h, meta, kv_cache, rope)
            h = ops.add_rms_norm(x, layer["post_norm"], eps, attn, validate=False)  # x += attn, then norm
            mlp = self.all_reduce(self.mlp(layer, h))
            last = i + 1 == len(self.layers)
            h = ops.add_rms_norm(x, self.norm if last else self.layers[i + 1]["input_norm"], eps, mlp, False)
        return h

    def idle(self) -> None:
        """Data-parallel attention, a step where this DP group has no tokens: take part in every MoE
        layer's all-to-all with none (the other groups' tokens may still reach this rank's experts)."""
        x = torch.empty((0, self.config.hidden_size), dtype=self.dtype, device=self.device)
        for layer in self.layers:
            if "router" in layer:
                moe.dispatch(layer, x, self.config.moe, self.shard)

    def mlp(self, layer: dict, x: Tensor) -> Tensor:
        """The dense SwiGLU MLP, or the routed experts on an MoE layer (this rank's partial sum under TP)."""
        if "router" in layer:
            return moe.forward(layer, x, self.config.moe, self.shard)
        return self.linear(ops.silu_mul(self.linear(x, layer["gate_up"])), layer["down"])

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [n, hidden] -> fp32 logits [n, vocab]."""
        if self.batch_invariant:
            return invariant.linear_rows(hidden, self.lm_head).float()
        if isinstance(self.lm_head, cpu.PackedWeight):
            return ops.linear(hidden, self.lm_head, validate=False).float()
        return F.linear(hidden, self.lm_head).float()  # on a GPU: cuBLAS, as before the CPU packing
