"""The engine's tensors for a model config, by Hugging Face name and shape: seeded random weights (the
built-in test models), and the check that a checkpoint's tensors are the ones its config describes."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from engine.config import ModelConfig


def _mlp_weights(prefix: str, h: int, f: int, normal, num_experts: int | None = None) -> dict[str, Tensor]:
    """A SwiGLU MLP's three projections; with num_experts, one per expert (prefix has a {} for its index)."""
    out = {}
    for e in range(num_experts or 1):
        p = prefix.format(e)
        out[p + "gate_proj.weight"] = normal(f, h, std=h**-0.5)
        out[p + "up_proj.weight"] = normal(f, h, std=h**-0.5)
        out[p + "down_proj.weight"] = normal(h, f, std=f**-0.5)
    return out


def _mla_weights(prefix: str, config: ModelConfig, normal) -> dict[str, Tensor]:
    """Latent attention's projections under DeepSeek's names."""
    m, h, heads = config.mla, config.hidden_size, config.num_heads
    out = {
        prefix + "kv_a_proj_with_mqa.weight": normal(m.kv_lora_rank + m.qk_rope_head_dim, h, std=h**-0.5),
        prefix + "kv_a_layernorm.weight": 1 + normal(m.kv_lora_rank, std=0.1),
        prefix + "kv_b_proj.weight": normal(
            heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, std=m.kv_lora_rank**-0.5
        ),
        prefix + "o_proj.weight": normal(h, heads * m.v_head_dim, std=(heads * m.v_head_dim) ** -0.5),
    }
    if m.q_lora_rank is None:
        out[prefix + "q_proj.weight"] = normal(config.q_size, h, std=h**-0.5)
    else:
        out[prefix + "q_a_proj.weight"] = normal(m.q_lora_rank, h, std=h**-0.5)
        out[prefix + "q_a_layernorm.weight"] = 1 + normal(m.q_lora_rank, std=0.1)
        out[prefix + "q_b_proj.weight"] = normal(config.q_size, m.q_lora_rank, std=m.q_lora_rank**-0.5)
    return out


class _Normal(NamedTuple):
    """A random tensor not drawn yet: normal(0, std) values plus offset."""

    shape: tuple[int, ...]
    std: float
    offset: float = 0.0

    def __radd__(self, offset: float) -> _Normal:  # _weights' `1 + normal(...)`
        return self._replace(offset=self.offset + offset)


# tensors drawn lately, kept by (seed, name, spec) up to DRAWN_BYTES a process, the least lately read
# dropped first: a test suite, a benchmark's engines and forked workers build the same small models again
# and again, and drawing a 49k-row embedding costs more than copying it
DRAWN_BYTES = 256 << 20
_drawn: OrderedDict[tuple, Tensor] = OrderedDict()
_drawn_lock = threading.Lock()


def _draw(seed: int, name: str, spec: _Normal) -> Tensor:
    key = hashlib.blake2b(f"{seed}|{name}".encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    return torch.randn(*spec.shape, generator=g).mul_(spec.std).add_(spec.offset)


class RandomWeights(Mapping):
    """Seeded random weights by name, each tensor drawn when it is read from a generator seeded by the
    model's seed and the tensor's name: the same values in every process and in any order of reading,
    and a rank that reads only its shard's experts never draws the others' (random-deepseek-v3's 2.58 B
    parameters are 10.3 GB in fp32: drawn whole by every DP rank, two ranks did not fit in 23 GiB)."""

    def __init__(self, config: ModelConfig, seed: int = 0):
        self.seed = seed
        self.specs: dict[str, _Normal] = _weights(config, lambda *shape, std=0.05: _Normal(shape, std))

    def __getitem__(self, name: str) -> Tensor:
        """The tensor, a copy of its own (its reader may change it in place)."""
        spec = self.specs[name]
        key = (self.seed, name, spec)
        with _drawn_lock:
            kept = _drawn.get(key)
            if kept is not None:
                _drawn.move_to_end(key)
                return kept.clone()
        t = _draw(self.seed, name, spec)
        nbytes = t.numel() * t.element_size()
        if nbytes <= DRAWN_BYTES // 4:
            with _drawn_lock:
                _drawn[key] = t.clone()
                held = sum(x.numel() * x.element_size() for x in _drawn.values())
                while held > DRAWN_BYTES:
                    _, old = _drawn.popitem(last=False)
                    held -= old.numel() * old.element_size()
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)


def random_weights(config: ModelConfig, seed: int = 0) -> RandomWeights:
    return RandomWeights(config, seed)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the engine reads for this config and its shape (nothing allocated: meta tensors)."""

    def normal(*shape, std=0.05):
        return torch.empty(*shape, device="meta")

    return {name: tuple(t.shape) for name, t in _weights(config, normal).items()}


def check_shapes(config: ModelConfig, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """ValueError unless every tensor the config sizes is in shapes (name -> shape, a checkpoint's) with
    the shape the config gives it: a config.json that disagrees with its tensors (a vocab of 1e10 over a
    49,152-row embedding) must not load and then size buffers, masks and token checks by the lie."""
    dims = (
        f"vocab_size={config.vocab_size}, hidden_size={config.hidden_size}, "
        f"intermediate_size={config.intermediate_size}, num_attention_heads={config.num_heads}, "
        f"num_key_value_heads={config.num_kv_heads}, head_dim={config.head_dim}"
    )
    for name, shape in expected_shapes(config).items():
        found = shapes.get(name)
        if found is None and name == "lm_head.weight":
            continue
        if found is None:
            raise ValueError(f"{where}: tensor {name} is missing; config.json ({dims}) needs it")
        if tuple(found) != shape:
            raise ValueError(
                f"{where}: tensor {name} has shape {list(found)} but config.json ({dims}) gives it "
                f"{list(shape)}: the config does not describe these weights"
            )


def _weights(config: ModelConfig, normal) -> dict[str, Tensor]:
    """The engine's tensors for config, each made by normal(*shape, std=...)."""
    h, d = config.hidden_size, config.head_dim
    weights = {
        "model.embed_tokens.weight": normal(config.vocab_size, h, std=0.5),
        "model.norm.weight": 1 + normal(h, std=0.1),
    }
    if not config.tie_embeddings:
        weights["lm_head.weight"] = normal(config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights.update(
            {
                p + "input_layernorm.weight": 1 + normal(h, std=0.1),
                p + "post_attention_layernorm.weight": 1 + normal(h, std=0.1),
            }
        )
        if config.mla:
            weights.update(_mla_weights(p + "self_attn.", config, normal))
        else:
            weights.update(
                {
                    p + "self_attn.q_proj.weight": normal(config.q_size, h, std=h**-0.5),
                    p + "self_attn.k_proj.weight": normal(config.kv_size, h, std=h**-0.5),
                    p + "self_attn.v_proj.weight": normal(config.kv_size, h, std=h**-0.5),
                    p + "self_attn.o_proj.weight": normal(h, config.q_size, std=config.q_size**-0.5),
                }
            )
        if config.is_moe_layer(i):
            moe = config.moe
            weights[p + "mlp.gate.weight"] = normal(moe.num_experts, h, std=h**-0.5)
            weights.update(
                _mlp_weights(f"{p}mlp.experts.{{}}.", h, moe.intermediate_size, normal, moe.num_experts)
            )
            if moe.topk_method == "noaux_tc":
                weights[p + "mlp.gate.e_score_correction_bias"] = normal(moe.num_experts, std=0.1)
            if moe.num_shared_experts:
                width = moe.num_shared_experts * moe.intermediate_size
                weights.update(_mlp_weights(p + "mlp.shared_experts.", h, width, normal))
        else:
            weights.update(_mlp_weights(p + "mlp.", h, config.intermediate_size, normal))
        if config.qk_norm:
            weights[p + "self_attn.q_norm.weight"] = 1 + normal(d, std=0.1)
            weights[p + "self_attn.k_norm.weight"] = 1 + normal(d, std=0.1)
    return weights
