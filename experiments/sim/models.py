"""Model presets for the cost model: shapes from each model's published config (config.json)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SimModel:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int  # GQA; for MLA the latent is one shared "head" (see kv_lora_rank)
    head_dim: int
    intermediate: int  # dense MLP width (gate/up/down)
    vocab: int
    experts: int = 0  # MoE: routed experts per layer (0: dense)
    active_experts: int = 0
    shared_experts: int = 0
    expert_intermediate: int = 0
    dense_layers: int = 0  # MoE models whose first layers are dense
    kv_lora_rank: int = 0  # MLA: latent width cached per token (plus rope_dim)
    rope_dim: int = 0
    q_lora_rank: int = 0
    gated_mlp: bool = True  # SwiGLU: 3 matrices; OPT: 2
    rotary: bool = True  # rope on q and k (OPT learns its positions instead)
    tied_embeddings: bool = False  # the LM head is the embedding matrix
    bytes_per_param: int = 2  # weights
    kv_bytes_per_elem: int | None = None  # the KV cache's dtype (None: as the weights)
    # a KV cache quantized below the activations (e4m3 with a float32 scale per page, plane and head:
    # 1 + 4 / (page size x head dim) bytes an element): what a token's KV takes and moves; None: as above
    kv_cache_bytes: float | None = None

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        """Layers with experts (0 for a dense model)."""
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def activation_bytes(self) -> int:
        """Activations (collectives' payload) share the KV cache's dtype."""
        return self.kv_bytes_per_elem or self.bytes_per_param

    def kv_bytes_per_token(self) -> float:
        """Bytes of KV cache one token adds, over all layers."""
        per_layer = (self.kv_lora_rank + self.rope_dim) if self.mla else 2 * self.kv_heads * self.head_dim
        return self.layers * per_layer * (self.kv_cache_bytes or self.activation_bytes)

    def attn_params(self) -> int:
        """Attention projection weights of one layer."""
        h, d = self.hidden, self.head_dim
        if self.mla:
            q_out = self.heads * (d + self.rope_dim)
            q = h * self.q_lora_rank + self.q_lora_rank * q_out if self.q_lora_rank else h * q_out
            kv = h * (self.kv_lora_rank + self.rope_dim) + self.kv_lora_rank * self.heads * 2 * d
            return q + kv + self.heads * d * h
        return h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h

    def mlp_params(self, width: int) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden * width

    def layer_params(self, layer: int, active: bool) -> int:
        """Weights of one layer; active=True counts only the experts a token uses."""
        if not self.experts or layer < self.dense_layers:
            return self.attn_params() + self.mlp_params(self.intermediate)
        experts = (self.active_experts if active else self.experts) + self.shared_experts
        return self.attn_params() + experts * self.mlp_params(self.expert_intermediate)

    def params(self, active: bool = False) -> int:
        embeddings = (1 if self.tied_embeddings else 2) * self.vocab * self.hidden
        return sum(self.layer_params(i, active) for i in range(self.layers)) + embeddings


MODELS = {
    # facebook/opt-13b: 40 layers, 5120 wide, 40 heads (MHA), ReLU MLP 20480, vocab 50272
    "opt-13b": SimModel(
        "opt-13b", 40, 5120, 40, 40, 128, 20480, 50272, gated_mlp=False, rotary=False, tied_embeddings=True
    ),
    # facebook/opt-175b (the OPT paper's 175B shape): 96 layers, 12288 wide, 96 heads (MHA), MLP 49152
    "opt-175b": SimModel(
        "opt-175b", 96, 12288, 96, 96, 128, 49152, 50272, gated_mlp=False, rotary=False, tied_embeddings=True
    ),
    # meta-llama/Meta-Llama-3-8B
    "llama-3-8b": SimModel("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    # meta-llama/Meta-Llama-3-70B
    "llama-3-70b": SimModel("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    # Qwen/Qwen3-Coder-480B-A35B-Instruct: 62 layers, 96 q heads, 8 kv heads, 160 experts, 8 active
    "qwen3-coder-480b-a35b": SimModel(
        "qwen3-coder-480b-a35b", 62, 6144, 96, 8, 128, 8192, 151936,
        experts=160, active_experts=8, expert_intermediate=2560,
    ),
    # deepseek-ai/DeepSeek-R1: 61 layers (3 dense), MLA (kv_lora 512 + rope 64, q_lora 1536),
    # 256 routed experts (8 active) + 1 shared, expert width 2048, dense width 18432; weights in FP8 as
    # released (block-scaled e4m3), KV cache in bf16
    "deepseek-r1": SimModel(
        "deepseek-r1", 61, 7168, 128, 1, 128, 18432, 129280,
        experts=256, active_experts=8, shared_experts=1, expert_intermediate=2048, dense_layers=3,
        kv_lora_rank=512, rope_dim=64, q_lora_rank=1536, bytes_per_param=1, kv_bytes_per_elem=2,
    ),
    # HuggingFaceTB/SmolLM2-135M: 30 layers, 576 wide, 9 heads, 3 kv heads, tied embeddings
    "smollm2-135m": SimModel("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tied_embeddings=True),
}  # fmt: skip


def from_engine(config) -> SimModel:
    """The cost model's view of an engine model (engine.config.ModelConfig): the same weights and KV rows,
    so that the simulator can be fitted to the engine's own steps on MoE and MLA shapes."""
    m, moe = config.mla, config.moe
    if m is not None and not m.qk_nope_head_dim == m.v_head_dim:
        raise ValueError(f"the cost model's MLA needs qk_nope_head_dim == v_head_dim, got {m}")
    dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    if moe is not None and dense != list(range(len(dense))):
        raise ValueError(f"the cost model puts dense layers first; {config.name} routes layers {moe.layers}")
    return SimModel(
        config.name,
        config.num_layers,
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        m.v_head_dim if m else config.head_dim,
        config.intermediate_size,
        config.vocab_size,
        experts=moe.num_experts if moe else 0,
        active_experts=moe.top_k if moe else 0,
        shared_experts=moe.num_shared_experts if moe else 0,
        expert_intermediate=moe.intermediate_size if moe else 0,
        dense_layers=len(dense) if moe else 0,
        kv_lora_rank=m.kv_lora_rank if m else 0,
        rope_dim=m.qk_rope_head_dim if m else 0,
        q_lora_rank=(m.q_lora_rank or 0) if m else 0,
        tied_embeddings=config.tie_embeddings,
    )


def sim_model(name: str) -> SimModel:
    """A preset above, or any model the engine loads (a registered name, a .gguf file, a Hugging Face
    folder), read without its weights."""
    if name in MODELS:
        return MODELS[name]
    from engine.weights import load_model

    try:
        return from_engine(load_model(name, weights=False).config)
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"sim model must be one of {sorted(MODELS)} or a model the engine loads: {e}") from e
