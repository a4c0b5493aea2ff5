"""The MTP draft head: DeepSeek-V3's multi-token-prediction module (one depth) as a speculative proposer.

For a confirmed position p (its KV is in the target's cache and the token after it, t[p+1], is known) the
head's input is the target's final hidden state h[p] and the embedding of t[p+1]:

    x[p] = eh_proj([enorm(embed(t[p+1])); hnorm(h[p])])        one decoder layer over the head's own
    y[p] = layer(x[p]) at position p                          KV of the positions before p
    logits = lm_head(shared_head.norm(y[p]))                  the target's embedding / LM head, shared

and argmax(logits) drafts t[p+2]. The head's KV starts at the request's last prompt positions (p =
prompt_len - 2): that is where a disaggregated decode worker starts, and the hidden state h[prompt_len -
2] is the context the prefill worker writes beside the KV (transfer/prefill.py). So a decode worker drafts
at its very first step, (context, last prompt token) -> the first output token, and a colocated worker
reads the same inputs from its own prefill. Drafting k tokens runs the head over the confirmed positions
it has not yet seen (their KV kept), then k - 1 chained steps on its own output and its previous draft
(their KV dropped: the next step replaces them with confirmed positions). Drafts are deterministic (the
head's argmax), so verification treats them as point masses (engine.speculative.verify_sampled).

The layer is of the target's kind: a Llama/Qwen3 layer, or for DeepSeek latent attention (the head keeps
its own latent rows, decompressed per head) and routed experts. Weights, as
`speculative_config["model"]`: None reads them from the target's checkpoint under DeepSeek's names
(`model.layers.{num_layers}.enorm.weight`, ...); a `.safetensors` file holds them with or without that
prefix; "random" makes a seeded random head (tests and timing). This runs in plain torch on the lead
rank (the head is one layer; with TP the lead has the full hidden states and LM head).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from engine import mla, moe
from engine.config import ModelConfig
from engine.model import Model
from engine.sequence import Sequence
from engine.tensors import random_weights

BASE_SHAPES = ("enorm.weight", "hnorm.weight", "shared_head.norm.weight", "input_layernorm.weight")
QK_NORM_KEYS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def head_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The head's weights (bare names) and shapes: one decoder layer of the target's kind (GQA or latent
    attention; a dense MLP, or routed experts when the target has them, as DeepSeek-V3's MTP layer)."""
    h, f = config.hidden_size, config.intermediate_size
    shapes = {k: (h,) for k in BASE_SHAPES} | {"eh_proj.weight": (h, 2 * h)}
    shapes["post_attention_layernorm.weight"] = (h,)
    if config.mla:
        m, heads = config.mla, config.num_heads
        shapes |= {
            "self_attn.kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
            "self_attn.kv_a_layernorm.weight": (m.kv_lora_rank,),
            "self_attn.kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
            "self_attn.o_proj.weight": (h, heads * m.v_head_dim),
        }
        if m.q_lora_rank is None:
            shapes["self_attn.q_proj.weight"] = (config.q_size, h)
        else:
            shapes |= {
                "self_attn.q_a_proj.weight": (m.q_lora_rank, h),
                "self_attn.q_a_layernorm.weight": (m.q_lora_rank,),
                "self_attn.q_b_proj.weight": (config.q_size, m.q_lora_rank),
            }
    else:
        shapes |= {
            "self_attn.q_proj.weight": (config.q_size, h),
            "self_attn.k_proj.weight": (config.kv_size, h),
            "self_attn.v_proj.weight": (config.kv_size, h),
            "self_attn.o_proj.weight": (h, config.q_size),
        }
        if config.qk_norm:
            shapes |= {k: (config.head_dim,) for k in QK_NORM_KEYS}
    moe = config.moe
    if moe is None:
        return shapes | {
            "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f),
        }
    fe = moe.intermediate_size
    shapes["mlp.gate.weight"] = (moe.num_experts, h)
    if moe.topk_method == "noaux_tc":
        shapes["mlp.gate.e_score_correction_bias"] = (moe.num_experts,)
    for e in range(moe.num_experts):
        shapes |= {f"mlp.experts.{e}.{k}_proj.weight": (fe, h) for k in ("gate", "up")}
        shapes[f"mlp.experts.{e}.down_proj.weight"] = (h, fe)
    if moe.num_shared_experts:
        fs = moe.num_shared_experts * fe
        shapes |= {f"mlp.shared_experts.{k}_proj.weight": (fs, h) for k in ("gate", "up")}
        shapes["mlp.shared_experts.down_proj.weight"] = (h, fs)
    return shapes


def random_head_weights(config: ModelConfig, seed: int = 0) -> dict[str, Tensor]:
    """A seeded random head at config's geometry (its drafts are almost never accepted)."""
    moe = config.moe and replace(config.moe, layers=(0,))
    layer = random_weights(replace(config, num_layers=1, tie_embeddings=True, moe=moe), seed + 1)
    g = torch.Generator().manual_seed(seed)
    h = config.hidden_size
    weights = {k: layer["model.layers.0." + k] for k in head_shapes(config) if "model.layers.0." + k in layer}
    weights |= {k: 1 + 0.1 * torch.randn(h, generator=g) for k in ("enorm.weight", "hnorm.weight")}
    weights["eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * (2 * h) ** -0.5
    weights["shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    return weights


def load_head_weights(
    source: str | None, config: ModelConfig, checkpoint: dict[str, Tensor], seed: int = 0
) -> dict[str, Tensor]:
    """The head's weights by their bare names (head_shapes), shapes checked against the target's config."""
    prefix = f"model.layers.{config.num_layers}."
    if source is None:
        found = {k[len(prefix) :]: w for k, w in checkpoint.items() if k.startswith(prefix)}
        where = f"the target checkpoint ({prefix}*)"
    elif source == "random":
        return random_head_weights(config, seed)
    else:
        path = Path(source)
        if path.suffix != ".safetensors" or not path.is_file():
            raise ValueError(
                f"speculative_config.model must be None (the target checkpoint's MTP layer), 'random' or "
                f"an existing .safetensors file; got {source!r}"
            )
        from safetensors.torch import load_file

        found = {k.removeprefix(prefix): w.float() for k, w in load_file(str(path)).items()}
        where = str(path)
    shapes = head_shapes(config)
    missing = [k for k in shapes if k not in found]
    if missing:
        raise ValueError(
            f"speculative_config: no MTP head in {where}: missing {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''} (speculative_config.model: None, 'random' or a file)"
        )
    for key, shape in shapes.items():
        if tuple(found[key].shape) != shape:
            raise ValueError(
                f"MTP head weight {key} in {where} has shape {tuple(found[key].shape)}, not {shape}"
            )
    return {k: found[k] for k in shapes}


@dataclass
class HeadState:
    """One request's head: its KV for positions [start, start + len(k)), and the target hidden states
    observed at confirmed positions it has not read yet."""

    start: int
    k: list[Tensor] = field(default_factory=list)  # per position [Hkv, D]
    v: list[Tensor] = field(default_factory=list)
    hidden: dict[int, Tensor] = field(default_factory=dict)  # position -> [hidden] fp32

    @property
    def end(self) -> int:
        return self.start + len(self.k)


class MTPDrafter:
    def __init__(self, target: Model, weights: dict[str, Tensor], num_speculative_tokens: int):
        self.target, self.k = target, num_speculative_tokens
        c = target.config
        self.w = {name: w.to(target.device, target.dtype).contiguous() for name, w in weights.items()}
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        # DeepSeek's head: latent attention and routed experts, over the whole head count and width
        self.attn = c.mla and {
            k: t.contiguous() for k, t in mla.load_attention(self.w, "self_attn.", c, 0, c.num_heads).items()
        }
        self.moe = c.moe and {
            k: t.to(torch.float32 if k.startswith("router") and c.moe.fp32_router else t.dtype).contiguous()
            for k, t in moe.load_experts(self.w, "mlp.", c.moe, 0, c.moe.intermediate_size).items()
        }
        self.w = {k: t for k, t in self.w.items() if not k.startswith("mlp.experts.")}  # now stacked
        self._page = torch.zeros(1, dtype=torch.long, device=target.device)  # decompress's page table

    # ---- what the engine tells it ----------------------------------------------------------------

    def begin(self, seq: Sequence, context: Tensor | None = None) -> None:
        """A request enters the engine (or resumes with its outputs after a refetch); context: the hidden
        state at num_tokens - 2 that a prefill worker computed (a decode worker's admitted request)."""
        seq.draft = HeadState(start=max(0, seq.num_tokens - 2))
        if context is not None:
            self.observe(seq, seq.draft.start, context.reshape(1, -1))

    def observe(self, seq: Sequence, first: int, hidden: Tensor) -> None:
        """The target's final hidden states at confirmed positions first, first + 1, ... (a step's rows)."""
        state: HeadState | None = seq.draft
        if state is None:
            return
        lo = max(state.end, first)
        for p in range(lo, first + hidden.shape[0]):
            state.hidden[p] = hidden[p - first].float()

    # ---- drafting ---------------------------------------------------------------------------------

    def propose(self, seq: Sequence) -> list[int]:
        """Up to k drafts for the tokens after seq's last one (none when a hidden state is missing)."""
        state: HeadState | None = seq.draft
        last = seq.num_tokens - 2  # the newest confirmed position: the next step computes seq.num_tokens-1
        if state is None or last < state.end:
            return []
        if any(p not in state.hidden for p in range(state.end, last + 1)):
            return []
        ids = seq.all_ids
        positions = list(range(state.end, last + 1))
        hidden = torch.stack([state.hidden.pop(p) for p in positions]).to(self.target.dtype)
        x = self.combine(self._embed([ids[p + 1] for p in positions]), hidden)
        y, k, v = self._layer(x, positions, state)
        state.k += list(k)
        state.v += list(v)
        drafts, extra_k, extra_v = [self._draft(y[-1])], [], []
        for j in range(1, self.k):  # chained: the head's own output and its previous draft
            x = self.combine(self._embed(drafts[-1:]), y[-1:])
            y, k, v = self._layer(x, [last + j], state, extra_k, extra_v)
            extra_k.append(k[0])
            extra_v.append(v[0])
            drafts.append(self._draft(y[-1]))
        return drafts

    def combine(self, embedded: Tensor, hidden: Tensor) -> Tensor:
        """[n, hidden] embeddings of the next tokens and target hidden states -> the layer's input."""
        t, w = self.target, self.w
        both = torch.cat([t.rms_norm(embedded, w["enorm.weight"]), t.rms_norm(hidden, w["hnorm.weight"])], -1)
        return F.linear(both, w["eh_proj.weight"])

    def _embed(self, ids: list[int]) -> Tensor:
        return self.target.embed[torch.tensor(ids, device=self.target.device)]

    def _draft(self, y: Tensor) -> int:
        """y [hidden]: one output row -> its argmax token."""
        return int(
            self.target.logits(self.target.rms_norm(y[None], self.w["shared_head.norm.weight"])).argmax()
        )

    def _layer(
        self, x: Tensor, positions: list[int], state: HeadState, extra_k=(), extra_v=()
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One decoder layer for rows x at positions, attending causally over the head's KV (the state's,
        then extra_k/v) and each other; returns (output, the rows' k, v). For latent attention k is the
        rows' latent [c | k_pe] and v the same tensor."""
        t, w = self.target, self.w
        n = x.shape[0]
        h = t.rms_norm(x, w["input_layernorm.weight"])
        pos = torch.tensor(positions, device=x.device)
        cos, sin = t.cos[pos].unsqueeze(1), t.sin[pos].unsqueeze(1)
        mask = torch.ones(n, len(state.k) + len(extra_k) + n, dtype=torch.bool, device=x.device)
        mask = mask.tril(mask.shape[1] - n)  # row i: every position before it, and itself
        attend = self._latent_attention if self.attn else self._attention
        o, k, v = attend(h, cos, sin, mask, state, extra_k, extra_v)
        x = x + F.linear(o.to(x.dtype), w["self_attn.o_proj.weight"])
        h = t.rms_norm(x, w["post_attention_layernorm.weight"])
        if self.moe:
            return x + moe.forward(self.moe, h, t.config.moe), k, v
        gate, up = F.linear(h, w["mlp.gate_proj.weight"]), F.linear(h, w["mlp.up_proj.weight"])
        return x + F.linear(F.silu(gate) * up, w["mlp.down_proj.weight"]), k, v

    def _latent_attention(self, h, cos, sin, mask, state, extra_k, extra_v) -> tuple[Tensor, Tensor, Tensor]:
        """DeepSeek's latent attention over the head's own latent rows, decompressed per head as prefill
        does (engine.mla)."""
        m = self.target.config.mla
        n, nope = h.shape[0], m.qk_nope_head_dim
        q_nope, q_pe, ckv, kpe = mla.project(self.target, self.attn, h, (cos, sin))
        rows = torch.cat([ckv, kpe], dim=-1)
        every = torch.stack([*state.k, *extra_k, *rows])[None]  # one "page" of all positions: [1, m, row]
        kv = mla.decompress(
            self.attn, every[..., : m.kv_lora_rank], every[..., m.kv_lora_rank :], self._page, nope
        )
        keys, values = (
            kv[0, 0, ..., : m.qk_head_dim].float(),
            kv[0, 1, ..., : m.v_head_dim].float(),
        )  # [H, m, d]
        query = torch.cat([q_nope, q_pe], dim=-1).float().transpose(0, 1)  # [H, n, qk]
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=m.scale)
        return o.transpose(0, 1).reshape(n, -1), rows, rows

    def _attention(self, h, cos, sin, mask, state, extra_k, extra_v) -> tuple[Tensor, Tensor, Tensor]:
        """GQA over the head's own K/V rows."""
        t, w, d = self.target, self.w, self.head_dim
        n = h.shape[0]
        q = F.linear(h, w["self_attn.q_proj.weight"]).view(n, self.num_heads, d)
        k = F.linear(h, w["self_attn.k_proj.weight"]).view(n, self.num_kv_heads, d)
        v = F.linear(h, w["self_attn.v_proj.weight"]).view(n, self.num_kv_heads, d)
        if t.config.qk_norm:
            q, k = t.rms_norm(q, w["self_attn.q_norm.weight"]), t.rms_norm(k, w["self_attn.k_norm.weight"])
        q, k = t.rope(q, cos, sin), t.rope(k, cos, sin)
        keys = torch.stack([*state.k, *extra_k, *k]).float()  # [m, Hkv, D]; the rows' own come last
        values = torch.stack([*state.v, *extra_v, *v]).float()
        group = self.num_heads // self.num_kv_heads
        o = F.scaled_dot_product_attention(
            q.float().transpose(0, 1),  # [H, n, D]
            keys.repeat_interleave(group, 1).transpose(0, 1),
            values.repeat_interleave(group, 1).transpose(0, 1),
            attn_mask=mask,
        )
        return o.transpose(0, 1).reshape(n, -1), k, v


def drafting(speculative, model: Model, loaded, seed: int):
    """(the MTP drafter or None, what the scheduler proposes drafts with or None) for an engine's
    speculative decoding (engine.speculative.SpeculativeConfig, or None: none)."""
    from engine.speculative import ngram_drafts

    if speculative is None:
        return None, None
    s = speculative
    if s.method == "mtp":
        head = load_head_weights(s.model, loaded.config, loaded.weights, seed)
        drafter = MTPDrafter(model, head, s.num_speculative_tokens)
        return drafter, drafter.propose
    return None, lambda seq: ngram_drafts(
        seq.all_ids, s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max
    )
