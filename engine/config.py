"""Engine configuration: dataclasses that check their invariants on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

from engine.role import Role
from engine.speculative import SpeculativeConfig

if TYPE_CHECKING:  # torch where an engine is built: the server's front checks these settings without it
    import torch

PREEMPTIONS = ("recompute", "refetch")
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}  # torch's dtypes of these names: bytes an element
KV_DTYPES = ("auto", "fp8_e4m3")  # the KV cache's: the model's dtype, or e4m3 with scales


def cuda_available() -> bool:
    """torch.cuda.is_available(), asked only where the machine has a GPU's device files (NVIDIA's, AMD's for
    ROCm, or WSL's GPU bridge): elsewhere it is False, and a process that never runs a model (a server's
    front, the simulator) need not import torch (2.5 s of CPU) to learn it."""
    import glob
    import os

    if not glob.glob("/dev/nvidia[0-9]*") and not any(os.path.exists(p) for p in ("/dev/kfd", "/dev/dxg")):
        return False
    import torch

    return torch.cuda.is_available()


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context stretched by factor (1 unstretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


SCORINGS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
ROPE_SCALINGS = (None, "default", "llama3", "yarn")


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts in place of the dense MLP on some layers. Each token goes to the top_k experts by the
    router's score and sums their SwiGLU outputs weighted by the scores (renormalised when norm_topk_prob,
    times routed_scaling_factor), plus the shared experts' output when there are any.
    Qwen3-MoE: softmax scores, greedy top-k. DeepSeek-V2: softmax, optionally group_limited_greedy (the
    top topk_group of num_groups expert groups by their best score, then top-k within them). DeepSeek-V3:
    sigmoid scores, noaux_tc (groups ranked by the sum of their two best scores, experts chosen by score +
    the checkpoint's e_score_correction_bias, weighted by the unbiased score)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's MLP width
    layers: tuple[int, ...]  # the layers whose MLP is routed; the others stay dense
    norm_topk_prob: bool = True  # renormalise the top-k scores to sum to 1
    scoring: str = "softmax"
    topk_method: str = "greedy"
    num_groups: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0  # a dense MLP of num_shared_experts x intermediate_size beside the experts
    fp32_router: bool = False  # DeepSeek scores in fp32 whatever the model's dtype

    def __post_init__(self):
        _check(self.num_experts >= 1, f"moe.num_experts must be >= 1, got {self.num_experts}")
        _check(
            1 <= self.top_k <= self.num_experts,
            f"moe.top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}",
        )
        _check(
            self.intermediate_size >= 1, f"moe.intermediate_size must be >= 1, got {self.intermediate_size}"
        )
        _check(self.scoring in SCORINGS, f"moe.scoring must be one of {SCORINGS}, got {self.scoring!r}")
        _check(
            self.topk_method in TOPK_METHODS,
            f"moe.topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}",
        )
        _check(
            self.num_groups >= 1 and self.num_experts % self.num_groups == 0,
            f"moe.num_groups must divide num_experts={self.num_experts}, got {self.num_groups}",
        )
        _check(
            1 <= self.topk_group <= self.num_groups,
            f"moe.topk_group must be in [1, num_groups={self.num_groups}], got {self.topk_group}",
        )
        _check(
            self.topk_method != "noaux_tc" or self.num_experts // self.num_groups >= 2,
            "moe.topk_method 'noaux_tc' ranks groups by their two best experts: each group needs >= 2",
        )
        _check(
            self.num_shared_experts >= 0,
            f"moe.num_shared_experts must be >= 0, got {self.num_shared_experts}",
        )


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention. Each token's KV is one latent row: kv_lora_rank compressed
    values (RMS-normed) and a qk_rope_head_dim key shared by all heads (RoPE'd), so the paged cache holds
    one "head" of kv_lora_rank + qk_rope_head_dim per token (ModelConfig.head_dim) in one plane, the same on
    every TP rank. A head's key is [latent @ W_UK, rope key], its value latent @ W_UV (kv_b_proj)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: q_proj; else q_a_proj -> RMSNorm -> q_b_proj
    softmax_scale: float | None = None  # None: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _check(getattr(self, name) >= 1, f"mla.{name} must be >= 1, got {getattr(self, name)}")
        _check(
            self.qk_rope_head_dim % 2 == 0, f"mla.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}"
        )
        _check(
            self.q_lora_rank is None or self.q_lora_rank >= 1,
            f"mla.q_lora_rank must be None or >= 1, got {self.q_lora_rank}",
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else self.qk_head_dim**-0.5


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder: RMSNorm, RoPE, GQA, SwiGLU; Qwen3 adds RMSNorm on q and k per head;
    Qwen3-MoE routes the MLP of some layers to experts (moe); DeepSeek-V2/V3 attend with latent attention
    (mla: then num_kv_heads is 1 and head_dim the latent row, kv_lora_rank + qk_rope_head_dim)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    tie_embeddings: bool = False
    qk_norm: bool = False
    rope_scaling: dict | None = None  # "llama3" or "yarn" frequency scaling, as in config.json
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    rope_interleave: bool = False  # the checkpoint's RoPE rotates adjacent pairs (DeepSeek), not halves

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position",
        ):
            _check(getattr(self, name) >= 1, f"model.{name} must be >= 1, got {getattr(self, name)}")
        _check(
            self.num_heads % self.num_kv_heads == 0,
            f"model.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})",
        )
        _check(self.head_dim % 2 == 0, f"model.head_dim must be even for RoPE, got {self.head_dim}")
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type"))
        _check(
            kind in ROPE_SCALINGS,
            f"model.rope_scaling type must be one of {ROPE_SCALINGS}, got {kind!r}",
        )
        if self.mla is not None:
            row = self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
            _check(
                self.num_kv_heads == 1 and self.head_dim == row,
                f"an MLA model's cache holds one latent row per token: num_kv_heads must be 1 and head_dim "
                f"kv_lora_rank + qk_rope_head_dim = {row}, got {self.num_kv_heads} and {self.head_dim}",
            )
        bad = [i for i in (self.moe.layers if self.moe else ()) if not 0 <= i < self.num_layers]
        _check(not bad, f"moe.layers must be in [0, {self.num_layers}), got {bad}")

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and i in self.moe.layers

    @property
    def q_size(self) -> int:
        return self.num_heads * (self.mla.qk_head_dim if self.mla else self.head_dim)

    @property
    def rope_dim(self) -> int:
        """The dimensions each head rotates (all of head_dim, or MLA's qk_rope_head_dim)."""
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def kv_planes(self) -> int:
        """Rows per token and head in the paged cache: K and V, or MLA's one latent row."""
        return 1 if self.mla else 2

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """The KV one token adds to the cache over all layers (whole model, before TP)."""
        return self.num_layers * self.kv_planes * self.num_kv_heads * self.head_dim * itemsize

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    num_pages: int = 1024
    kv_layout: str = "HND"
    # share the KV of full pages with the same leading tokens (engine/kv/cache.py; vLLM's name)
    enable_prefix_caching: bool = True
    # auto: the model's dtype; fp8_e4m3: e4m3 pages, a float32 scale per page, plane and head beside them
    # (pdkernels/kv_quant.py), dequantized as attention reads them
    kv_dtype: str = "auto"

    def __post_init__(self):
        _check(
            isinstance(self.enable_prefix_caching, bool),
            f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}",
        )
        _check(self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}")
        _check(self.num_pages >= 1, f"num_pages must be >= 1, got {self.num_pages}")
        _check(
            self.kv_layout in ("HND", "NHD"),
            f"kv_layout must be one of ('HND', 'NHD'), got {self.kv_layout!r}",
        )
        _check(self.kv_dtype in KV_DTYPES, f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")

    @property
    def fp8(self) -> bool:
        return self.kv_dtype == "fp8_e4m3"


TIER_POLICIES = ("on_evict", "write_through")
STORES = ("none", "mooncake")
DECODE_LOADS = ("cost", "always", "never")


@dataclass(frozen=True)
class TierSettings:
    """kv_tiers' settings that every worker's engine takes as they are (declared once: the deployment's
    `kv_tiers`, serving.config.KVTiersSpec, and each engine's KVTiersConfig extend this).

    Full prefix pages leave device memory into the host pool (LRU) and from it into files (LRU): when a
    device page is evicted ("on_evict") or as soon as it is named ("write_through", which also keeps the
    files warm for a restarted worker). The disk tier and the shared pool stage through the host pool."""

    host_bytes: int = 0  # per worker; 0: no host tier
    disk_bytes: int = 0  # per worker; 0: no disk tier
    policy: str = "on_evict"  # on_evict | write_through: when a page goes below device memory
    store: str = "none"  # none | mooncake: a pool every worker of the deployment shares (Mooncake Store)
    store_deadline_s: float = 2.0  # every store call's deadline; past it the pool is a miss
    # an existence check's deadline (the engine's step waits on it; the shorter of the two serves)
    store_lookup_s: float = 0.5
    # decode role: a disaggregated request's leading pages found below device memory are loaded here
    # instead of sent by the prefill worker: "cost" when their load is expected to end before the
    # transfer would land (each tier's measured load time per page against the prefill workers'
    # measured time per prompt token), "always", or "never" (every page not on the device is sent)
    decode_loads: str = "cost"

    def __post_init__(self):
        for key in ("host_bytes", "disk_bytes"):
            value = getattr(self, key)
            _check(
                isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                f"kv_tiers.{key} must be an integer >= 0 (bytes), got {value!r}",
            )
        _check(
            self.policy in TIER_POLICIES,
            f"kv_tiers.policy must be one of {TIER_POLICIES}, got {self.policy!r}",
        )
        _check(self.store in STORES, f"kv_tiers.store must be one of {STORES}, got {self.store!r}")
        _check(
            self.decode_loads in DECODE_LOADS,
            f"kv_tiers.decode_loads must be one of {DECODE_LOADS}, got {self.decode_loads!r}",
        )
        _check(
            (self.disk_bytes == 0 and self.store == "none") or self.host_bytes > 0,
            "kv_tiers.disk_bytes and kv_tiers.store stage pages through the host pool: set "
            f"kv_tiers.host_bytes too (got host_bytes={self.host_bytes}, disk_bytes={self.disk_bytes}, "
            f"store={self.store!r})",
        )
        for key in ("store_deadline_s", "store_lookup_s"):
            value = getattr(self, key)
            _check(
                isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 60,
                f"kv_tiers.{key} must be in (0, 60] seconds, got {value!r}",
            )

    def settings(self) -> dict:
        """TierSettings' fields and their values (what a KVTiersConfig takes from a deployment's)."""
        return {f.name: getattr(self, f.name) for f in fields(TierSettings)}

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0


@dataclass(frozen=True)
class KVTiersConfig(TierSettings):
    """One engine's KV below device memory (engine/kv/tiers.py): the tiers' settings, and where this
    engine's files and the deployment's pool are."""

    disk_dir: str | None = None  # this engine's own folder for the disk tier (locked while in use)
    store_master: str = "127.0.0.1:50051"  # the pool's master's RPC address
    store_metadata: str = ""  # its metadata server's URL (http://127.0.0.1:port/metadata)
    secret: str = ""  # keys each page's MAC in files and the pool (a deployment's secret)

    def __post_init__(self):
        super().__post_init__()
        _check(
            self.disk_bytes == 0 or bool(self.disk_dir),
            f"kv_tiers.disk_bytes={self.disk_bytes} needs kv_tiers.disk_dir (a folder of this engine's own)",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    role: Role = Role.COLOCATED  # (a role's name is taken too)
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 512  # per-step token budget; prompts longer than it are chunked
    # Admission with room to finish: a request starts (a new prefill, or pages reserved for incoming KV)
    # only if the free pages then still cover every admitted request's growth to min(max_tokens, this
    # many tokens past its prompt). None: to max_tokens. A request that runs past it may be preempted.
    reserved_tokens: int | None = 512
    # What a preempted decode-role sequence does: "refetch" (its pages freed; the worker asks a prefill
    # worker again for prompt + outputs) or "recompute" (computed again here). Other roles recompute.
    preemption: str = "recompute"
    # Fair share: an admitted request is owed growth only up to its share of the cache (the cache's
    # tokens over the requests admitted or waiting), so a new request does not wait for others' long
    # outputs; one that grows past its share when the pages run out is preempted instead.
    fair_share: bool = True
    # An SLO-driven step budget (engine/budget.py): a step with sequences decoding takes only as many
    # prompt tokens as its measured step-time model says keep each decoding request's mean time per output
    # token within this many seconds (a TPOT target); None: every step may take max_num_batched_tokens
    step_target_s: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "role", Role.parse(self.role))
        _check(
            self.step_target_s is None
            or (
                isinstance(self.step_target_s, int | float)
                and not isinstance(self.step_target_s, bool)
                and 0 < self.step_target_s <= 60
            ),
            f"step_target_s must be None or seconds in (0, 60], got {self.step_target_s!r}",
        )
        _check(
            isinstance(self.fair_share, bool), f"fair_share must be true or false, got {self.fair_share!r}"
        )
        _check(
            self.reserved_tokens is None
            or (isinstance(self.reserved_tokens, int) and self.reserved_tokens >= 0),
            f"reserved_tokens must be None or an integer >= 0, got {self.reserved_tokens!r}",
        )
        _check(
            self.preemption in PREEMPTIONS,
            f"preemption must be one of {PREEMPTIONS}, got {self.preemption!r}",
        )
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )


# EngineConfig's parts whose fields LLM(**overrides) takes by their own names (page_size, role, ...)
PARTS = {"cache": CacheConfig, "scheduler": SchedulerConfig}


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine is built from: `LLM(config)`, or `LLM(model, **overrides)` whose keywords are
    these fields' names and the cache's and scheduler's (EngineConfig.of routes each to its part). Checked
    on construction; the checks that need the model's architecture run once the engine has read it
    (`arch`). A deployment's workers get theirs from serving.config.engine_config, resolved before any
    starts."""

    model: str = "smollm2-135m"  # a built-in name (engine/weights.py), a model directory or a .gguf file
    device: str = "cpu"  # cpu | cuda[:N]
    dtype: str = "float32"
    tp: int = 1
    # data-parallel attention (engine/dp.py): dp engines of tp ranks each, the routed experts spread over
    # all tp x dp ranks; dp_rank: which of them this one is (set by engine/dp.py for the engines it starts)
    dp: int = 1
    dp_rank: int = 0
    seed: int = 0
    expert_parallel: bool = False  # MoE under TP: whole experts per rank instead of a slice of each
    # replay decode steps as CUDA graphs (engine/graphs.py); None: on CUDA with tp 1 outside the prefill role
    cuda_graphs: bool | None = None
    # every token's result the same bits whatever its step holds (other sequences, its prompt's chunking,
    # prefill or decode), as vLLM's VLLM_BATCH_INVARIANT: pdkernels.invariant, on the CPU, dense models
    batch_invariant: bool = False
    # speculative decoding, vLLM's names ({"method": "ngram" | "mtp", "num_speculative_tokens": k, ...});
    # a dict is taken as engine.speculative.SpeculativeConfig's fields
    speculative_config: SpeculativeConfig | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # KV below device memory under the prefix cache (engine/kv/tiers.py); a dict is taken as its fields
    kv_tiers: KVTiersConfig = field(default_factory=KVTiersConfig)
    arch: ModelConfig | None = None  # the model's architecture: set by the engine as it reads the model

    @classmethod
    def of(cls, config: EngineConfig | str | None = None, **overrides) -> EngineConfig:
        """config (an EngineConfig, or a model's name) with overrides by their names: EngineConfig's own
        fields, CacheConfig's and SchedulerConfig's (page_size=32 changes cache.page_size). An unknown name
        is refused with the allowed ones."""
        base = (
            config
            if isinstance(config, EngineConfig)
            else cls(**({} if config is None else {"model": config}))
        )
        top, nested = {}, {part: {} for part in PARTS}
        for key, value in overrides.items():
            part = next((p for p, c in PARTS.items() if key in c.__dataclass_fields__), None)
            if part is not None:
                nested[part][key] = value
            elif key in cls.__dataclass_fields__ and key != "arch":
                top[key] = value
            else:
                raise ValueError(f"the engine has no setting {key!r}; allowed: {sorted(settings())}")
        for part, values in nested.items():
            if values:
                top[part] = replace(top.get(part, getattr(base, part)), **values)
        if "model" in top:
            top["arch"] = None  # another model's: read again
        return replace(base, **top)

    def __post_init__(self):
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))
        tiers = self.kv_tiers
        if not isinstance(tiers, KVTiersConfig):
            object.__setattr__(self, "kv_tiers", KVTiersConfig(**(tiers or {})))
        _check(
            isinstance(self.model, str) and bool(self.model),
            f"model must be a model's name or path, got {self.model!r}",
        )
        _check(self.dtype in DTYPES, f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        _check(
            self.device == "cpu" or self.device.startswith("cuda"),
            f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}",
        )
        _check(
            not self.device.startswith("cuda") or cuda_available(),
            f"device={self.device!r} but this machine has no CUDA device (torch.cuda.is_available() is "
            "False): use device='cpu'",
        )
        _check(isinstance(self.tp, int) and self.tp >= 1, f"tp must be an integer >= 1, got {self.tp!r}")
        _check(
            isinstance(self.expert_parallel, bool),
            f"expert_parallel must be true or false, got {self.expert_parallel!r}",
        )
        _check(
            isinstance(self.dp, int) and self.dp >= 1 and 0 <= self.dp_rank < self.dp,
            f"dp must be an integer >= 1 (and dp_rank in [0, dp)), got dp={self.dp!r}, "
            f"dp_rank={self.dp_rank!r}",
        )
        _check(
            self.dp == 1 or not (self.speculative_config or self.kv_tiers.enabled or self.cuda_graphs),
            f"dp={self.dp} (data-parallel attention) runs without speculative_config, kv_tiers or "
            f"cuda_graphs so far; got speculative_config={self.speculative_config!r}, "
            f"kv_tiers.host_bytes={self.kv_tiers.host_bytes}, cuda_graphs={self.cuda_graphs!r}",
        )
        _check(
            self.dp == 1 or not self.scheduler.role.receives_kv or self.device == "cpu",
            f"dp={self.dp} in the decode role maps each DP group's KV into the front's NIXL agents, on the "
            f"CPU so far; got device={self.device!r}",
        )
        _check(
            isinstance(self.batch_invariant, bool),
            f"batch_invariant must be true or false, got {self.batch_invariant!r}",
        )
        _check(
            not self.batch_invariant or (self.device == "cpu" and self.cache.kv_layout == "HND"),
            "batch_invariant runs on the CPU over an HND cache (pdkernels.invariant) so far; got "
            f"device={self.device!r}, kv_layout={self.cache.kv_layout!r}",
        )
        _check(
            not self.kv_tiers.enabled or self.cache.enable_prefix_caching,
            "kv_tiers keep prefix-cache pages: they need enable_prefix_caching=True",
        )
        fp8_with = {
            "speculative_config": self.speculative_config is not None,
            "batch_invariant": self.batch_invariant, "cuda_graphs": bool(self.cuda_graphs),
        }  # fmt: skip
        _check(
            not self.cache.fp8 or not any(fp8_with.values()),
            "kv_dtype='fp8_e4m3' leaves out, so far: batch_invariant (a page's rounding depends on how it "
            "was filled), speculative decoding (drafts would move its scales) and CUDA graphs; got "
            + ", ".join(k for k, v in fp8_with.items() if v),
        )
        if self.arch is not None:
            self._check_arch(self.arch)

    def _check_arch(self, m: ModelConfig) -> None:
        """What the model's shape asks of the parallelism."""
        _check(m.num_heads % self.tp == 0, f"tp={self.tp} must divide the {m.num_heads} attention heads")
        _check(
            m.num_kv_heads % self.tp == 0 or self.tp % m.num_kv_heads == 0,
            f"tp={self.tp} must divide the {m.num_kv_heads} kv heads or be a multiple of them (replication)",
        )
        _check(
            m.intermediate_size % self.tp == 0,
            f"tp={self.tp} must divide the MLP width {m.intermediate_size}",
        )
        _check(
            m.moe is None or m.moe.intermediate_size % self.tp == 0,
            f"tp={self.tp} must divide the experts' MLP width {m.moe and m.moe.intermediate_size}",
        )
        _check(
            not self.expert_parallel or (m.moe is not None and m.moe.num_experts % self.tp == 0),
            f"expert_parallel needs an MoE model whose experts tp={self.tp} divides; got "
            f"{m.moe.num_experts if m.moe else 'no'} experts",
        )
        _check(
            not self.batch_invariant or not (m.moe or m.mla or m.qk_norm),
            f"batch_invariant covers dense models without MoE, MLA or q/k norms so far; {m.name} has "
            + ", ".join(k for k, v in (("MoE", m.moe), ("MLA", m.mla), ("q/k norms", m.qk_norm)) if v),
        )
        world = self.tp * self.dp
        _check(
            self.dp == 1 or (m.moe is not None and m.moe.num_experts % world == 0),
            f"dp={self.dp} needs an MoE model whose experts tp x dp = {world} ranks divide; got "
            f"{m.moe.num_experts if m.moe else 'no'} experts",
        )

    @property
    def world(self) -> int:
        """The ranks of one engine's forward passes together: tp x dp."""
        return self.tp * self.dp

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    def shard_spec(self, itemsize: int | None = None, identity: tuple[str, str, str] = ("", "", "")):
        """The geometry of this engine's KV cache as the transfer plan sees it (transfer.plan.ShardSpec;
        the arch must be read): itemsize, the allocated element's bytes (the dtype's where not given);
        identity, the model's digests (engine.LLM.identity: model, weights, tokenizer). What a worker
        announces, and what the runtime checks a deployment's two sides with before any starts."""
        from transfer.plan import ShardSpec

        m, c = self.arch, self.cache
        return ShardSpec(
            tp=self.tp, num_kv_heads=m.num_kv_heads, num_layers=m.num_layers, num_pages=c.num_pages,
            page_size=c.page_size, head_dim=m.head_dim,
            itemsize=1 if c.fp8 else itemsize or DTYPES[self.dtype],
            dtype=c.kv_dtype if c.fp8 else self.dtype, kv_layout=c.kv_layout, planes=m.kv_planes,
            scale_bytes=4 if c.fp8 else 0, model=identity[0], weights=identity[1], tokenizer=identity[2],
        )  # fmt: skip


def settings(config: EngineConfig | None = None) -> dict:
    """Every setting by the name LLM(**overrides) takes, and its value in config (the defaults' without
    one): the cache's and scheduler's fields beside the engine's own (not arch, which the model sets)."""
    config = config or EngineConfig()
    out = {f.name: getattr(config, f.name) for f in fields(EngineConfig) if f.name not in (*PARTS, "arch")}
    for part in PARTS:
        out.update((f.name, getattr(getattr(config, part), f.name)) for f in fields(PARTS[part]))
    return out
