"""The deployment runtime's configuration: the model, the deployments, the SLO their router and planner
hold requests to, the transfer, the kernels and the launcher, checked and turned into dataclasses before
any process starts. Every wrong value fails with a ValueError naming the key, the value and what is
allowed (`check_fits_model` adds the checks that need the model: TP against its heads). The experiment
tools build on this (experiments/config.py adds the workload); nothing here knows of them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from engine.config import KV_DTYPES, EngineConfig, KVTiersConfig, TierSettings, cuda_available
from engine.role import Role
from serving.checks import check_count, check_positive, refuse
from transfer.config import TransferConfig

DEPLOYMENT_KINDS = ("colocated", "disaggregated")
DECODE_PREEMPTIONS = ("refetch", "recompute_local")
ON_WORKER_DEATH = ("migrate", "fail")
DTYPES = ("float32", "bfloat16", "float16")
KV_LAYOUTS = ("HND", "NHD")
DEVICES = ("auto", "cpu", "cuda")
KERNEL_BACKENDS = ("auto", "triton", "flashinfer", "torch")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


CPU_BF16_CHUNK, CPU_FP32_CHUNK, DEFAULT_CHUNK = 2048, 1024, 512
# chunk_size: slo: a step with decodes aims at this share of slo.tpot_s (engine/budget.py); the rest is
# the worker's own time between steps and the step-time model's error
SLO_STEP_SHARE = 0.9


ROLES = ("colocated", "prefill", "decode")
LAUNCHERS = ("local", "ray", "netns")


@dataclass(frozen=True)
class RayConfig:
    """Where the `ray` launcher finds its cluster and how it places workers (conf/launcher/ray.yaml)."""

    address: str | None = None  # an existing cluster ("auto" or host:port); None: start a local one
    local_nodes: int = 2  # address None: nodes of the local cluster (127.0.0.1); node 0 takes prefill
    cpus_per_node: int = 1  # the local cluster's CPUs per node
    role_resources: dict = field(
        default_factory=lambda: {"prefill": "pdk_prefill", "decode": "pdk_decode", "colocated": None}
    )  # role -> the custom resource a node must have to take that role's workers (None: any node)
    node_ids: dict = field(default_factory=dict)  # worker name -> Ray node id (explicit placement)
    max_restarts: int = 0  # Ray restarts a dead worker this many times; it re-handshakes
    start_timeout_s: float = 120.0  # the cluster up and every worker's placement group placed

    def __post_init__(self):
        if self.address is not None and not (isinstance(self.address, str) and self.address):
            refuse("ray.address", self.address, 'null (a local cluster), "auto" or the head\'s host:port')
        if self.address is None:
            check_positive("ray.local_nodes", self.local_nodes, integer=True)
        check_positive("ray.cpus_per_node", self.cpus_per_node, integer=True)
        check_positive("ray.start_timeout_s", self.start_timeout_s)
        check_count("ray.max_restarts", self.max_restarts)
        unknown = sorted(set(self.role_resources) - set(ROLES))
        if unknown:
            refuse("ray.role_resources", dict(self.role_resources), f"keys among {ROLES}; got {unknown}")
        for role, resource in self.role_resources.items():
            if resource is not None and not (isinstance(resource, str) and resource):
                refuse(f"ray.role_resources.{role}", resource, "a custom resource name or null (any node)")


@dataclass(frozen=True)
class ClusterConfig:
    """The netns launcher's hosts on this machine (conf/launcher/netns.yaml; serving/fleet/netns.py)."""

    hosts: int = 2  # network namespaces; worker i runs on host i % hosts
    nics_per_host: int = 1  # veth NICs per host (a bridge per NIC index)
    # every NIC's link, both ways: a tc rate; one-way delay and jitter (us): netem, else netns_wire; loss (%)
    link: dict = field(
        default_factory=lambda: {"rate": "10gbit", "delay_us": 0, "jitter_us": 0, "loss_pct": 0}
    )
    subnet: int = 0  # 198.18.(subnet * 4 + nic).(host + 1): two runs at once need two subnets
    ray: bool = False  # a Ray node per host (the head, and the driver, on host 0): workers are Ray actors

    def __post_init__(self):
        from serving.fleet.netns import Link, check_cluster

        if not isinstance(self.ray, bool):
            refuse("cluster.ray", self.ray, "true or false")
        if hasattr(self.link, "keys"):  # a mapping from the YAML (OmegaConf's, too): a plain dict
            object.__setattr__(self, "link", {k: self.link[k] for k in self.link.keys()})
        check_cluster(self.hosts, self.nics_per_host, self.subnet)
        if not isinstance(self.link, dict) or set(self.link) - {"rate", "delay_us", "jitter_us", "loss_pct"}:
            refuse("cluster.link", self.link, "a mapping of rate, delay_us, jitter_us, loss_pct")
        Link(**self.link)  # checked: ValueError naming cluster.link.<key>


@dataclass(frozen=True)
class LauncherConfig:
    name: str = "local"  # local: processes on this host | ray: actors on a Ray cluster | netns: hosts here
    ray: RayConfig | None = None  # the ray launcher's settings
    cluster: ClusterConfig | None = None  # the netns launcher's hosts
    # local: a dead worker is started again this many times (decode workers too); ray: ray.max_restarts
    max_restarts: int = 0

    def __post_init__(self):
        if self.name not in LAUNCHERS:
            refuse("launcher", self.name, f"one of {LAUNCHERS}")
        check_count("launcher.max_restarts", self.max_restarts)
        if self.name == "ray" and self.ray is None:
            object.__setattr__(self, "ray", RayConfig())
        if self.name == "netns" and self.cluster is None:
            object.__setattr__(self, "cluster", ClusterConfig())


def prefill_budget(chunk_size: int | str, device: str, dtype: str, native: bool | None = None) -> int:
    """deployment.chunk_size with auto resolved by what computes the step: 2,048 tokens (vLLM's CPU
    budget) on a CPU that computes in bf16 (AVX-512 BF16 or AMX) running a bf16 model, 1,024 on a CPU in
    fp32, where each met the SLO more often under a stream of 1,024-token prompts and decoded a burst
    faster than smaller budgets (docs/results/engine-cpu.md); 512 elsewhere (bf16 converted by each GEMM,
    a GPU), where no budget was measured. slo: auto's budget, which steps with decodes shrink to keep
    within the TPOT SLO (step_target_s). native: whether the CPU computes in bf16, where it is not this one
    (a simulated machine's experiments.sim.hardware.Hardware.bf16); None asks this CPU."""
    if chunk_size not in ("auto", "slo"):
        return chunk_size
    if device == "cpu" and dtype == "float32":
        return CPU_FP32_CHUNK
    if native is None:
        from pdkernels.cpuinfo import native_bf16

        native = native_bf16()
    return CPU_BF16_CHUNK if device == "cpu" and dtype == "bfloat16" and native else DEFAULT_CHUNK


def engine_config(
    model: ModelSpec,
    d: DeploymentConfig,
    role: Role,
    tpot_s: float,
    seed: int = 0,
    kv_tiers: KVTiersConfig | None = None,
) -> EngineConfig:
    """The engine one worker of deployment d runs in role: the model's and the deployment's keys under
    the engine's names, with what they leave to derive resolved here, once, in the main process before any
    worker starts: chunk_size auto and slo (prefill_budget), slo's step target (tpot_s), the decode
    preemption, speculation only where a worker samples (or may come to: elastic)."""
    page_size, num_pages, kv_layout, kv_dtype = (
        model.page_size,
        model.num_pages,
        model.kv_layout,
        model.kv_dtype,
    )
    if role is Role.PREFILL and d.prefill_page_size is not None:  # the same tokens in pages of its size
        page_size = d.prefill_page_size
        num_pages = max(1, model.num_pages * model.page_size // page_size)
    if role is Role.PREFILL and d.prefill_kv_layout is not None:
        kv_layout = d.prefill_kv_layout
    if role is Role.PREFILL and d.prefill_kv_dtype is not None:
        kv_dtype = d.prefill_kv_dtype
    return EngineConfig.of(
        model.name,
        device=model.device,
        dtype=model.dtype,
        page_size=page_size,
        num_pages=num_pages,
        kv_layout=kv_layout,
        kv_dtype=kv_dtype,
        max_num_seqs=model.max_num_seqs,
        expert_parallel=model.expert_parallel,
        batch_invariant=model.batch_invariant,
        role=role,
        tp=d.tp_of(role),
        dp=d.dp_of(role),
        seed=seed,
        enable_prefix_caching=d.prefix_caching,
        max_num_batched_tokens=prefill_budget(d.chunk_size, model.device, model.dtype),
        step_target_s=d.step_target_s(tpot_s),
        speculative_config=d.speculative if role.samples or d.elastic else None,
        reserved_tokens=d.decode_reserved_tokens,
        fair_share=d.fair_share,
        preemption="refetch" if d.decode_preemption == "refetch" else "recompute",
        kv_tiers=kv_tiers,
    )


@dataclass(frozen=True)
class ModelSpec:
    name: str  # smollm2-135m | tiny-random[-kv4|-kv8] | random-llama-1b | a Hugging Face model directory
    dtype: str = "bfloat16"  # or auto: bfloat16 on CUDA and on CPUs with AVX-512 BF16 or AMX, else float32
    page_size: int = 16  # tokens per KV page
    kv_layout: str = "HND"  # a KV page's plane as [heads, tokens, head_dim] (HND) or [tokens, heads, ...]
    # auto: the model's dtype; fp8_e4m3: e4m3 pages with a scale per page, plane and head
    # (engine.config.CacheConfig.kv_dtype; a deployment's prefill workers may keep a wider one:
    # deployment.prefill_kv_dtype)
    kv_dtype: str = "auto"
    num_pages: int = 512  # per worker
    max_num_seqs: int = 64  # sequences a worker runs at once (its largest decode batch)
    device: str = "auto"  # auto: cuda when this machine has it, else cpu
    expert_parallel: bool = False  # an MoE model under TP: whole experts per rank (engine/moe.py)
    # a prompt's greedy tokens the same bits whatever its batch, chunking and deployment (at a cost:
    # docs/results/engine-cpu.md); the CPU, dense models (engine.config.EngineConfig.batch_invariant)
    batch_invariant: bool = False

    def __post_init__(self):
        for key in ("expert_parallel", "batch_invariant"):
            if not isinstance(getattr(self, key), bool):
                refuse(f"model.{key}", getattr(self, key), "true or false")
        if self.device not in DEVICES:
            refuse("model.device", self.device, f"one of {DEVICES}")
        if self.dtype not in DTYPES + ("auto",):
            refuse("model.dtype", self.dtype, f"one of {DTYPES + ('auto',)}")
        for key in ("page_size", "num_pages", "max_num_seqs"):
            check_positive(f"model.{key}", getattr(self, key), integer=True)
        if self.kv_layout not in KV_LAYOUTS:
            refuse("model.kv_layout", self.kv_layout, f"one of {KV_LAYOUTS}")
        if self.kv_dtype not in KV_DTYPES:
            refuse("model.kv_dtype", self.kv_dtype, f"one of {KV_DTYPES}")
        cuda = cuda_available()
        if self.device == "cuda" and not cuda:
            refuse(
                "model.device",
                self.device,
                "this machine has no CUDA device (torch.cuda.is_available() is False): use cpu or auto",
            )
        device = self.device if self.device != "auto" else ("cuda" if cuda else "cpu")
        object.__setattr__(self, "device", device)  # resolved once, in the main process: workers get the same
        if self.dtype == "auto":
            from pdkernels.cpuinfo import auto_dtype

            object.__setattr__(self, "dtype", "bfloat16" if device == "cuda" else auto_dtype())


@dataclass(frozen=True)
class KernelsConfig:
    backend: str = (
        "auto"  # auto: Triton on CUDA, the torch references on the CPU; or triton | flashinfer | torch
    )

    def __post_init__(self):
        if self.backend not in KERNEL_BACKENDS:
            refuse("kernels.backend", self.backend, f"one of {KERNEL_BACKENDS}")


@dataclass(frozen=True)
class DeploymentConfig:
    name: str  # the deployment's name in results, logs and tables
    kind: str = "colocated"  # colocated | disaggregated (the main job also measures URLs: EndpointConfig)
    # colocated engines, or auto: the job's cores split as workers x threads_per_worker by measurement (each
    # split's steps timed here, the run's requests simulated through it, the one meeting the SLO best run;
    # experiments/layout.py)
    num_workers: int | str = 1
    num_prefill: int = 0  # disaggregated: prefill workers
    num_decode: int = 0  # disaggregated: decode workers
    tp: int = 1  # colocated workers
    prefill_tp: int = 1  # TP ranks per prefill worker
    decode_tp: int = 1  # TP ranks per decode worker
    # data-parallel attention (engine/dp.py, MoE models): a colocated (dp), prefill (prefill_dp) or decode
    # (decode_dp) worker runs that many engines of tp ranks each, the routed experts spread over all of
    # them, behind one endpoint (each prefill group a messenger peer of its own: dp_peers)
    dp: int = 1
    prefill_dp: int = 1  # DP groups per prefill worker (each a messenger peer of its own)
    decode_dp: int = 1  # DP groups per decode worker (each request's KV goes to one, picked by its cache)
    threads_per_worker: int = 1  # torch threads per process (each TP rank gets one)
    # the prefill workers' KV page size (null: model.page_size): one of the two must divide the other (the
    # KV moves in units of the smaller, transfer/plan.py); a prefill worker's cache holds the tokens
    # model.num_pages of model.page_size hold
    prefill_page_size: int | None = None
    # ... and their pages' layout (null: model.kv_layout): what lands in the other layout is turned into the
    # decode workers' own in place; an NHD prefill worker needs decode_tp = prefill_tp (or one kv head)
    prefill_kv_layout: str | None = None
    # ... and their KV cache's dtype (null: model.kv_dtype): auto (the model's dtype) where model.kv_dtype is
    # fp8_e4m3 computes the prompt over a full-precision cache and quantizes each page as it is sent to the
    # decode workers' e4m3 one; an e4m3 prefill cache never feeds a wider decode cache
    prefill_kv_dtype: str | None = None
    # prefill tokens per forward pass (the chunked prefill budget), or auto (prefill_budget: 2,048 where
    # the CPU computes in bf16, 1,024 on a CPU in fp32, 512 elsewhere), or slo (auto's, but a step with
    # decodes takes only the prompt tokens that, at its measured step time, keep each decoding request's
    # mean interval within slo.tpot_s: docs/scheduling.md)
    chunk_size: int | str = "auto"
    # prompts at most this long, or whose KV the decode worker's prefix cache lacks for at most this many
    # tokens, are prefilled on the decode worker (no round trip)
    local_prefill_max_tokens: int = 0
    # conditional disaggregation by load: a decode worker also prefills a prompt itself when the router
    # predicts that the prefill workers' queue would break slo.ttft_s, its own queue would be sooner and
    # its decode step has room under slo.tpot_s (pair with chunk_size: slo, which keeps its decodes on time)
    local_prefill_by_load: bool = False
    prefix_caching: bool = True  # every worker shares cached KV pages between requests (engine/kv/cache.py)
    # a worker that was idle keeps reading requests for this many ms before its first step, so that a burst
    # reaching it spread out (over HTTP) shares that step; a lone request's TTFT pays it. 0: step at once
    gather_ms: float = 0.0
    # speculative decoding on the decode / colocated workers, vLLM's names:
    # {method: ngram, num_speculative_tokens: k, prompt_lookup_min: a, prompt_lookup_max: b}
    speculative: dict | None = None
    # Admission with room to finish (engine.scheduler): a decode worker reserves pages for incoming KV,
    # and any worker starts a prefill, only when the free pages still cover every admitted request's
    # growth to min(max_tokens, this many tokens). null: to max_tokens.
    decode_reserved_tokens: int | None = 512
    # ... but no more than its share of the worker's cache (its pages over the requests it holds or
    # queues), so a new request does not wait for others' long outputs; past it, preempted if need be
    fair_share: bool = True
    # A decode worker's request preempted anyway (past that horizon): refetch (its KV computed again by a
    # prefill worker, prompt + outputs) | recompute_local (computed again on the decode worker)
    decode_preemption: str = "refetch"
    # A decode (or colocated) worker that dies: migrate (its requests go on on another live one: prompt +
    # the tokens streamed so far, recomputed there) | fail (they end with an error)
    on_worker_death: str = "migrate"
    # Which decode (or colocated) worker takes a request (serving/router/policy.py): cache_aware (the
    # fewest pages to compute there, x routing_overlap_weight, + the pages it has in flight) |
    # least_loaded (the fewest requests in flight) | round_robin
    routing: str = "cache_aware"
    routing_overlap_weight: float = 1.0  # cache_aware: a page to compute against one in flight there
    # none (take every request) | slo (refuse at once one the router predicts will miss the SLO: its
    # TTFT from the prompt tokens ahead of it over the measured prefill speed, its TPOT from the decode
    # batch it would join; a refused request is `rejected` in results, an HTTP 503 with Retry-After)
    admission: str = "none"
    # elastic roles (disaggregated): {enabled, interval_s, min_prefill, min_decode, patience, headroom,
    # window_s, switches: [[at_s, worker, role], ...]} (serving.router.policy.PlannerConfig)
    planner: dict | None = None

    def __post_init__(self):
        from serving.router.planner import PlannerConfig

        if not isinstance(self.planner, PlannerConfig):
            object.__setattr__(self, "planner", of_dict(PlannerConfig, "deployment.planner", self.planner))
        if self.kind not in DEPLOYMENT_KINDS:
            refuse(f"deployment.{self.name}.kind", self.kind, f"one of {DEPLOYMENT_KINDS}")
        if self.speculative is not None:
            from engine.speculative import SpeculativeConfig

            try:
                SpeculativeConfig.of(dict(self.speculative))
            except (ValueError, TypeError) as e:
                raise ValueError(f"deployment.{self.name}.speculative: {e}") from e
        if self.num_workers == "auto":
            if not self.colocated or self.tp != 1 or self.dp != 1 or self.threads_per_worker != 1:
                refuse(
                    f"deployment.{self.name}.num_workers", "auto",
                    "auto only for kind=colocated with tp=1, dp=1 and threads_per_worker left at 1 (auto "
                    "sets it), or an integer >= 1",
                )  # fmt: skip
        counts = ("num_workers",) if self.colocated and self.num_workers != "auto" else ()
        counts += ("num_prefill", "num_decode") if not self.colocated else ()
        keys = ("tp", "prefill_tp", "decode_tp", "dp", "prefill_dp", "decode_dp", "threads_per_worker")
        for key in counts + keys:
            name = "num_workers (or auto)" if key == "num_workers" else key
            check_positive(f"deployment.{name}", getattr(self, key), integer=True)
        p, layout, kv_dtype = self.prefill_page_size, self.prefill_kv_layout, self.prefill_kv_dtype
        if p is not None:
            check_positive("deployment.prefill_page_size (or null)", p, integer=True)
        if layout is not None and layout not in KV_LAYOUTS:
            refuse("deployment.prefill_kv_layout", layout, f"null or one of {KV_LAYOUTS}")
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            refuse("deployment.prefill_kv_dtype", kv_dtype, f"null or one of {KV_DTYPES}")
        if kv_dtype is not None and self.prefill_dp > 1:
            refuse(
                "deployment.prefill_kv_dtype",
                kv_dtype,
                "null where prefill_dp > 1 (a DP group sends its cache as it is)",
            )
        for key, value in (
            ("prefill_page_size", p),
            ("prefill_kv_layout", layout),
            ("prefill_kv_dtype", kv_dtype),
        ):
            if value is not None and self.colocated:
                refuse(f"deployment.{key}", value, "null for kind=colocated (no prefill workers)")
            if value is not None and self.planner.elastic:
                refuse(f"deployment.{key}", value, "null where elastic workers switch roles")
        g = self.gather_ms
        if isinstance(g, bool) or not isinstance(g, int | float) or not 0 <= g <= 1000:
            refuse(f"deployment.{self.name}.gather_ms", g, "a number of milliseconds from 0 to 1000")
        if self.chunk_size not in ("auto", "slo"):
            check_positive("deployment.chunk_size (or auto, or slo)", self.chunk_size, integer=True)
        r = self.decode_reserved_tokens
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
            refuse("deployment.decode_reserved_tokens", r, "null or an integer >= 0")
        if not isinstance(self.fair_share, bool):
            refuse("deployment.fair_share", self.fair_share, "true or false")
        if not isinstance(self.local_prefill_by_load, bool):
            refuse("deployment.local_prefill_by_load", self.local_prefill_by_load, "true or false")
        if self.on_worker_death not in ON_WORKER_DEATH:
            refuse("deployment.on_worker_death", self.on_worker_death, f"one of {ON_WORKER_DEATH}")
        from serving.router.policy import ADMISSIONS, POLICIES

        if self.routing not in POLICIES:
            refuse("deployment.routing", self.routing, f"one of {POLICIES}")
        if self.admission not in ADMISSIONS:
            refuse("deployment.admission", self.admission, f"one of {ADMISSIONS}")
        w = self.routing_overlap_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < float("inf"):
            refuse("deployment.routing_overlap_weight", w, "a finite number >= 0")
        if self.decode_preemption not in DECODE_PREEMPTIONS:
            refuse("deployment.decode_preemption", self.decode_preemption, f"one of {DECODE_PREEMPTIONS}")
        if not isinstance(self.prefix_caching, bool):
            refuse("deployment.prefix_caching", self.prefix_caching, "true or false")
        if not isinstance(self.local_prefill_max_tokens, int) or self.local_prefill_max_tokens < 0:
            refuse("deployment.local_prefill_max_tokens", self.local_prefill_max_tokens, "an integer >= 0")
        if self.planner.elastic and self.colocated:
            refuse("deployment.planner", "enabled or switches", "elastic roles need kind=disaggregated")
        if self.planner.elastic:
            names = [f"prefill-{i}" for i in range(self.num_prefill)]
            names += [f"decode-{i}" for i in range(self.num_decode)]
            for _, worker, _ in self.planner.switches:
                if worker not in names:
                    refuse("deployment.planner.switches", worker, f"a worker of this deployment: {names}")

    @property
    def elastic(self) -> bool:
        """Workers may switch between prefill and decode (deployment.planner)."""
        return self.planner.elastic

    def step_target_s(self, tpot_s: float) -> float | None:
        """chunk_size: slo: the seconds a worker's step with decodes aims at (engine/budget.py)."""
        return SLO_STEP_SHARE * tpot_s if self.chunk_size == "slo" else None

    @property
    def processes(self) -> int:
        """Worker processes including TP ranks and DP groups (what the cores are shared by)."""
        if self.colocated:
            if self.num_workers == "auto":
                raise ValueError(
                    f"deployment {self.name}: num_workers: auto has no count until the job measures it"
                )
            return self.num_workers * self.tp * self.dp
        prefill = self.num_prefill * self.prefill_tp * self.prefill_dp
        return prefill + self.num_decode * self.decode_tp * self.decode_dp

    @property
    def colocated(self) -> bool:
        """Its workers each prefill and decode (kind colocated), or split into the two roles."""
        return self.kind == "colocated"

    @property
    def roles(self) -> tuple[Role, ...]:
        """Its workers' roles; the last is the one requests are routed to."""
        return (Role.COLOCATED,) if self.colocated else (Role.PREFILL, Role.DECODE)

    def tp_of(self, role: Role) -> int:
        """The TP degree of this deployment's workers of role."""
        return {Role.COLOCATED: self.tp, Role.PREFILL: self.prefill_tp, Role.DECODE: self.decode_tp}[role]

    def dp_of(self, role: Role) -> int:
        """The DP groups of this deployment's workers of role."""
        return {Role.COLOCATED: self.dp, Role.PREFILL: self.prefill_dp, Role.DECODE: self.decode_dp}[role]


def dp_peers(worker: str, dp: int) -> list[str]:
    """A prefill worker's messenger peers as its decode workers see them: itself (DP group 0) and, with
    DP groups, one per other group, whose messenger runs in that group's engine process."""
    return [worker] + [f"{worker}-dp{rank}" for rank in range(1, dp)]


def worker_of(peer: str) -> str:
    """The worker a messenger peer belongs to (dp_peers' inverse)."""
    head, _, rank = peer.rpartition("-dp")
    return head if head and rank.isdigit() else peer


@dataclass(frozen=True)
class SloConfig:
    ttft_s: float = 1.0  # time to first token a request must meet (seconds)
    tpot_s: float = 0.1  # time per output token after the first (seconds)
    attainment: float = 90.0  # percent of requests that must meet both

    def __post_init__(self):
        check_positive("slo.ttft_s", self.ttft_s)
        check_positive("slo.tpot_s", self.tpot_s)
        if not (isinstance(self.attainment, int | float) and 0 < self.attainment <= 100):
            refuse("slo.attainment", self.attainment, "a percentage in (0, 100]")


STORE_MIN_BYTES = 16 << 20
# What a fleet on this machine may ask of it (check_fits_machine). A worker process's own memory before
# its KV and weights: 172-182 MB PSS for each tiny-random worker of `experiments.serve deployment=1p1d`
# (2 cores of an Intel Xeon with AMX, forked from the fork server: torch's pages shared)
PROCESS_BYTES = 180 << 20
PROCESSES_PER_CORE = 4  # processes (x threads each) time-sharing a core: past it, refused
UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def byte_count(key: str, value) -> int:
    """A size in bytes: an integer, or a string with a binary unit ("512MiB", "4 GiB")."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        number = value.rstrip("BKMGTi ")
        unit = value[len(number) :].strip()
        if unit in UNITS and number.strip().isdigit():
            return int(number) * UNITS[unit]
    refuse(key, value, f"a size in bytes: an integer >= 0 or a number with a unit of {list(UNITS)[2:]}")


@dataclass(frozen=True)
class KVTiersSpec(TierSettings):
    """`kv_tiers`: KV below every worker's device pages (off by default): a host pool and files per worker,
    and the pool every worker shares (Mooncake Store). The engine's settings (engine.config.TierSettings)
    and where the deployment keeps its files and its pool; sizes also as strings (64MiB)."""

    # where each worker's files go (<disk_dir>/<deployment>/<worker>, kept after the run); null: in the
    # run's private directory, removed when the deployment stops
    disk_dir: str | None = None
    store_bytes: int | str = "1GiB"  # the pool's memory (held by the store's own process)
    store_host: str = "127.0.0.1"  # where its master and memory listen

    def __post_init__(self):
        for key in ("host_bytes", "disk_bytes", "store_bytes"):
            object.__setattr__(self, key, byte_count(f"kv_tiers.{key}", getattr(self, key)))
        super().__post_init__()
        if self.store == "mooncake" and self.store_bytes < STORE_MIN_BYTES:
            refuse(
                "kv_tiers.store_bytes", self.store_bytes, "at least 16MiB (Mooncake Store's smallest segment)"
            )

    def serves(self, d: DeploymentConfig) -> bool:
        """Whether d's workers get tiers: they keep prefix-cache pages, so only with prefix caching."""
        return self.host_bytes > 0 and d.prefix_caching

    def engine(self, disk_dir: str | None = None, secret: str = "", **store):
        """This worker's engine.config.KVTiersConfig (disk_dir resolved, the store's addresses)."""
        from engine.config import KVTiersConfig

        disk_dir = disk_dir if self.disk_bytes else None
        return KVTiersConfig(**self.settings(), disk_dir=disk_dir, secret=secret, **store)


@dataclass(frozen=True)
class RuntimeConfig:
    """What the deployment runtime needs to start and serve deployments, for the main job and the HTTP
    server alike: experiments.config.RunConfig adds the workload and what the experiment reports."""

    model: ModelSpec
    deployments: tuple[DeploymentConfig, ...]
    slo: SloConfig = field(default_factory=SloConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    kv_tiers: KVTiersSpec = field(default_factory=KVTiersSpec)
    run_timeout_s: float = 600.0  # the whole run; requests not finished by then are recorded as errors
    start_timeout_s: float = 300.0  # every worker up and connected
    log_level: str = "INFO"  # of the run's log (run.log in the run folder) and logs/ (one file per worker)

    def __post_init__(self):
        if self.log_level not in LOG_LEVELS:
            refuse("log_level", self.log_level, f"one of {LOG_LEVELS}")

    def to_dict(self) -> dict:
        return asdict(self)


RUNTIME_KEYS = ("run_timeout_s", "start_timeout_s", "log_level")


def as_dict(cfg) -> dict:
    """A composed hydra config (a DictConfig) as plain containers, resolved; a dict as it is."""
    if isinstance(cfg, dict):
        return cfg
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


def runtime_of(cfg) -> RuntimeConfig:
    """The composed config (a DictConfig or a plain dict) -> the runtime's checked config (the HTTP
    server's: what else it holds, a workload, is not the runtime's)."""
    return RuntimeConfig(**runtime_parts(as_dict(cfg)))


def runtime_parts(cfg: dict) -> dict:
    """RuntimeConfig's fields from a composed config (a plain dict), each checked."""
    model = of_dict(ModelSpec, "model", cfg.get("model"))
    transfer = of_dict(TransferConfig, "transfer", cfg.get("transfer"))
    kernels = of_dict(KernelsConfig, "kernels", cfg.get("kernels"))
    launcher = launcher_of(cfg)
    if launcher.name == "ray" and transfer.control_transport == "ipc":
        # workers on other nodes: the control plane is tcp (CURVE), each worker binding its node's address
        transfer = replace(transfer, control_transport="tcp")
    run = {k: cfg[k] for k in RUNTIME_KEYS if k in cfg}
    return dict(
        model=model,
        deployments=deployments_of(cfg),
        slo=slo_of(cfg),
        transfer=transfer,
        kernels=kernels,
        launcher=launcher,
        kv_tiers=of_dict(KVTiersSpec, "kv_tiers", cfg.get("kv_tiers")),
        **run,
    )


def of_dict(cls, key: str, values) -> object:
    values = dict(values or {})
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{key} has unknown key(s) {unknown}; allowed: {sorted(known)}")
    return cls(**values)


def launcher_of(cfg: dict) -> LauncherConfig:
    """`launcher` (a group: {name}, or just its name) and, for ray, the `ray` settings."""
    launcher = cfg.get("launcher") or {"name": "local"}
    launcher = {"name": launcher} if isinstance(launcher, str) else dict(launcher)
    # the top-level `ray` and `cluster` groups; a saved config (results.json) holds them inside launcher
    if launcher.get("name") == "ray":
        launcher["ray"] = of_dict(RayConfig, "ray", cfg.get("ray") or launcher.get("ray"))
    if launcher.get("name") == "netns":
        launcher["cluster"] = of_dict(ClusterConfig, "cluster", cfg.get("cluster") or launcher.get("cluster"))
    return of_dict(LauncherConfig, "launcher", launcher)


def deployments_of(cfg: dict) -> tuple[DeploymentConfig, ...]:
    """`deployments` (a list), else the one `deployment`, checked. Also the simulator's."""
    return tuple(
        of_dict(DeploymentConfig, "deployment", d)
        for d in (cfg.get("deployments") or [cfg.get("deployment")])
    )


def slo_of(cfg: dict) -> SloConfig:
    return of_dict(SloConfig, "slo", cfg.get("slo"))


def check_fits_machine(config: RuntimeConfig, loaded) -> None:
    """Refuse a deployment whose workers cannot fit this machine (local, netns, or a Ray cluster started
    here): more processes (TP ranks and DP groups each, x threads_per_worker) than PROCESSES_PER_CORE times
    the cores this job may use, or more memory than the machine has available, counting for each process
    PROCESS_BYTES and its KV pages, and for each worker its host tier (the weights come on top: this is
    the least they need). The message names both."""
    import os

    from engine.config import DTYPES

    if config.launcher.name == "ray" and config.launcher.ray.address is not None:
        return  # another cluster's nodes: Ray places the workers there and says what does not fit
    cores = len(os.sched_getaffinity(0))
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        available = None
    page = config.model.page_size * loaded.config.kv_bytes_per_token(DTYPES[config.model.dtype])
    for d in config.deployments:
        if not isinstance(d, DeploymentConfig) or d.num_workers == "auto":
            continue  # an endpoint; auto splits the cores it has
        counts = _role_counts(d)
        workers = sum(n for _, n in counts)
        groups = sum(d.dp_of(role) * n for role, n in counts)
        tiers = config.kv_tiers.host_bytes if config.kv_tiers.serves(d) else 0
        need = d.processes * PROCESS_BYTES + groups * config.model.num_pages * page + workers * tiers
        threads = d.processes * d.threads_per_worker
        if threads > PROCESSES_PER_CORE * cores or (available is not None and need > available):
            have = f"{available / 2**30:.1f} GiB available" if available is not None else "unknown memory"
            raise ValueError(
                f"deployment {d.name} does not fit this machine: {d.processes} worker processes of "
                f"{d.threads_per_worker} thread(s) on {cores} cores (at most {PROCESSES_PER_CORE} a core), "
                f"and at least {need / 2**30:.1f} GiB of memory (a process {PROCESS_BYTES >> 20} MiB, "
                f"{config.model.num_pages} KV pages of {page} bytes per engine, the host tier) against "
                f"{have}. Lower the deployment's worker counts, tp, dp or threads_per_worker, or "
                "model.num_pages"
            )


def _role_counts(d: DeploymentConfig) -> list[tuple[Role, int]]:
    """(role, workers of it) of deployment d."""
    if d.colocated:
        return [(Role.COLOCATED, d.num_workers)]
    return [(Role.PREFILL, d.num_prefill), (Role.DECODE, d.num_decode)]


def check_fits_model(config: RuntimeConfig):
    """Read the model's config and tokenizer (what the runtime tokenizes with; not its weights, which only
    workers load) and check every TP degree against it, through the engine's own EngineConfig checks, and
    the deployments against this machine (check_fits_machine)."""
    from engine.weights import load_model

    try:
        loaded = load_model(config.model.name, weights=False)
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"model.name={config.model.name!r}: {e}") from e
    for d in config.deployments:
        if not isinstance(d, DeploymentConfig):
            continue  # an endpoint (experiments.config.EndpointConfig): its server checks its own
        dp = max(d.dp_of(role) for role in d.roles)
        if dp > 1 and d.elastic:
            refuse("deployment.prefill_dp and decode_dp", dp, f"1 for {d.name}: elastic workers switch roles")
        if not d.colocated and d.decode_dp > 1 and config.model.device != "cpu":
            refuse("deployment.decode_dp", d.decode_dp, f"1 for {d.name}: DP decode workers run on the CPU")
        nics, ranks = config.transfer.nics_per_rank, max(d.tp_of(r) * d.dp_of(r) for r in d.roles)
        if nics and len(nics) < ranks:
            refuse(
                "transfer.nics_per_rank", list(nics), f"one device name per rank (tp x dp: {ranks}), or none"
            )
        specs = {}
        for role in d.roles:
            try:
                engine = engine_config(config.model, d, role, config.slo.tpot_s)
            except ValueError as e:
                raise ValueError(f"deployment {d.name}, its {role} workers: {e}") from e
            try:
                specs[role] = replace(engine, arch=loaded.config).shard_spec()
            except ValueError as e:
                key = f"{role}_tp" if role.sends_kv or role.receives_kv else "tp"
                raise ValueError(
                    f"deployment {d.name}: {key}={d.tp_of(role)} does not fit {loaded.config.name}: {e}"
                ) from e
        if not d.colocated:
            from transfer.plan import check_compatible, wire_spec

            try:
                check_compatible(wire_spec(specs[Role.PREFILL], config.model.kv_dtype), specs[Role.DECODE])
            except ValueError as e:
                raise ValueError(
                    f"deployment {d.name}: its prefill workers' KV cannot go to its decode workers "
                    f"(prefill_page_size, prefill_kv_layout, prefill_kv_dtype, prefill_tp, decode_tp): {e}"
                ) from e
    check_fits_machine(config, loaded)
    return loaded
