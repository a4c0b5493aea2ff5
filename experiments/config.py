"""The experiment config: the deployment runtime's (serving/config.py) plus the workload (`workload.*`:
arrivals, prompt and output lengths, datasets, multiturn conversations, how every request samples;
experiments/workload.py makes the requests of it), whether it plots, and deployments measured by URL
(EndpointConfig), checked and turned into dataclasses in one place, before any process starts.

`from_cfg` takes the composed hydra config (conf/config.yaml) and returns a RunConfig; every wrong value
fails here with a ValueError naming the key, the value and what is allowed. Nothing below experiments/
imports hydra: workers get these dataclasses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.sequence import SamplingParams
from serving.checks import check_count, check_positive, refuse
from serving.config import RuntimeConfig, as_dict, of_dict, runtime_parts

ARRIVALS = ("auto", "poisson", "concurrency", "trace")
DATASETS = ("random", "sharegpt", "mooncake", "multiturn")
LENGTH_KINDS = ("fixed", "uniform", "lognormal")


@dataclass(frozen=True)
class LengthDist:
    kind: str = "fixed"  # fixed: value | uniform: [low, high] | lognormal: mean (tokens), sigma
    value: int = 128  # fixed: every length
    low: int = 1  # uniform: the shortest
    high: int = 128  # uniform: the longest
    mean: float = 128.0  # lognormal: the mean length (tokens)
    sigma: float = 0.5  # lognormal: the sigma of the underlying normal

    def check(self, key: str) -> None:
        if self.kind not in LENGTH_KINDS:
            refuse(f"{key}.kind", self.kind, f"one of {LENGTH_KINDS}")
        if self.kind == "fixed":
            check_positive(f"{key}.value", self.value, integer=True)
        elif self.kind == "uniform":
            check_positive(f"{key}.low", self.low, integer=True)
            if not isinstance(self.high, int) or self.high < self.low:
                refuse(f"{key}.high", self.high, f"an integer >= {key}.low ({self.low})")
        else:
            check_positive(f"{key}.mean", self.mean)
            check_positive(f"{key}.sigma", self.sigma)

    @property
    def expected(self) -> float:
        """The mean length it draws (lognormal: its `mean` is the mean)."""
        return {"fixed": self.value, "uniform": (self.low + self.high) / 2}.get(self.kind, self.mean)


# workload.sampling is engine.SamplingParams, the one declaration of the sampling fields (the server's
# too), with these set by the workload instead: each request's max_tokens is its output length
# (workload.output_len), one completion each (n), no min_tokens (requests run to their length: ignore_eos,
# true here by default)
SET_BY_WORKLOAD = {
    "max_tokens": (16, "each request's is its output length, workload.output_len"),
    "n": (1, "one completion a request"),
    "min_tokens": (0, "requests run to their output length (ignore_eos)"),
}  # key -> (SamplingParams' default, why the workload sets it)


def sampling_of(values) -> SamplingParams:
    """workload.sampling (a mapping of SamplingParams' fields; a saved config's too) -> its SamplingParams,
    every wrong value a ValueError naming workload.sampling.<key>."""
    values = dict(values or {})
    fields = set(SamplingParams.__dataclass_fields__)
    unknown = sorted(set(values) - fields)
    if unknown:
        allowed = sorted(fields - {"max_tokens"})
        raise ValueError(f"workload.sampling has unknown key(s) {unknown}; allowed: {allowed}")
    for key, (default, why) in SET_BY_WORKLOAD.items():
        if key in values and values[key] != default:
            refuse(f"workload.sampling.{key}", values[key], f"the workload sets it: {why}")
    values.setdefault("ignore_eos", True)
    bias = values.get("logit_bias")
    if isinstance(bias, dict):  # a saved config's JSON keys are strings
        values["logit_bias"] = {
            int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in bias.items()
        }
    try:
        return SamplingParams(**values)
    except (ValueError, TypeError) as e:
        key = str(e).split(" ", 1)[0]
        raise ValueError(f"workload.sampling.{key}: {e}") from e


@dataclass(frozen=True)
class WorkloadConfig:
    # auto: the dataset's own clock when it has one (mooncake: trace), else poisson | poisson: `rate`
    # requests/s | concurrency: `concurrency` requests in flight | trace: a mooncake trace's timestamps
    arrival: str = "auto"
    rate: float = 1.0  # poisson: requests per second
    # poisson: the rate as this multiple of one worker's prefill capacity on this machine, measured in a
    # warm-up before the run (experiments.capacity): rate = load x its prompt tokens/s / the mean prompt
    load: float | None = None
    concurrency: int = 1  # concurrency: requests in flight at once (multiturn: conversations)
    num_requests: int = 20  # requests the run sends
    prompt_len: LengthDist = field(default_factory=LengthDist)
    output_len: LengthDist = field(default_factory=lambda: LengthDist(value=32, high=32, mean=32.0))
    prompts_file: str | None = None  # one prompt per line (text), replaces random prompt tokens
    seed: int = 0  # of the random prompts, lengths and arrivals
    dataset: str = "random"  # random | sharegpt (ShareGPT JSON) | mooncake (a Mooncake trace, JSONL)
    dataset_path: str | None = None  # the sharegpt or mooncake file
    trace_scale: float = 1.0  # arrival: trace replays timestamps x this (0.5: twice as fast)
    # mooncake: lengths x this (prompts, outputs and the 512-token blocks each hash id names, so equal ids
    # stay equal tokens): a trace of 12k-token prompts scaled to a small model on a CPU (1/16: 750)
    trace_length_scale: float = 1.0
    trace_offset: int = 0  # mooncake: skip the trace's first lines (a later slice; its clock starts at 0)
    # multiturn: conversations of `turns` turns over a shared system prompt; each turn adds a user message
    # of turn_len tokens to the history (earlier messages and the replies the server returned) and
    # arrives think_time_s after the previous reply ended (the first turns: on the arrival schedule);
    # with a ShareGPT file as dataset_path, the messages and reply lengths are its conversations' turns
    conversations: int = 8
    turns: int = 8  # multiturn: turns per conversation
    system_prompt_len: int = 256  # multiturn: tokens of the shared system prompt
    turn_len: int = 128  # multiturn: tokens of each new user message
    think_time_s: float = 1.0  # multiturn: seconds from a reply's end to the next turn
    # how every request samples: engine.SamplingParams' fields (the server takes the same), greedy and
    # ignore_eos by default so that each request runs to its output length; structured_outputs: one of
    # {json: <schema>, json_object: true, regex: ..., choice: [...], grammar: ...}
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(ignore_eos=True))

    def __post_init__(self):
        if self.arrival not in ARRIVALS:
            refuse("workload.arrival", self.arrival, f"one of {ARRIVALS}")
        if self.dataset not in DATASETS:
            refuse("workload.dataset", self.dataset, f"one of {DATASETS}")
        if self.dataset == "multiturn":
            for key in ("conversations", "turns", "turn_len"):
                check_positive(f"workload.{key}", getattr(self, key), integer=True)
            check_count("workload.system_prompt_len", self.system_prompt_len)
            if not isinstance(self.think_time_s, int | float) or not 0 <= self.think_time_s < float("inf"):
                refuse("workload.think_time_s", self.think_time_s, "a number of seconds >= 0")
            if self.dataset_path is not None and not os.path.isfile(self.dataset_path):
                refuse("workload.dataset_path", self.dataset_path, "null or an existing ShareGPT file")
        elif self.dataset != "random" and (
            self.dataset_path is None or not os.path.isfile(self.dataset_path)
        ):
            refuse("workload.dataset_path", self.dataset_path, f"an existing {self.dataset} file")
        if self.arrival == "auto":  # a dataset with a clock replays on it unless told otherwise
            object.__setattr__(self, "arrival", "trace" if self.dataset == "mooncake" else "poisson")
        check_positive("workload.trace_scale", self.trace_scale)
        if not (isinstance(self.trace_length_scale, int | float) and 0 < self.trace_length_scale <= 1):
            refuse("workload.trace_length_scale", self.trace_length_scale, "a number in (0, 1]")
        check_count("workload.trace_offset", self.trace_offset)
        if self.arrival == "trace" and self.dataset != "mooncake":
            refuse("workload.arrival", self.arrival, "trace needs workload.dataset=mooncake (its timestamps)")
        if self.arrival == "poisson":
            check_positive("workload.rate", self.rate)
        if self.load is not None:
            check_positive("workload.load", self.load)
            if self.arrival != "poisson" or self.dataset != "random":
                refuse("workload.load", self.load, "null unless workload.arrival=poisson on random prompts")
        elif self.arrival == "concurrency":
            check_positive("workload.concurrency", self.concurrency, integer=True)
        check_positive("workload.num_requests", self.num_requests, integer=True)
        self.prompt_len.check("workload.prompt_len")
        self.output_len.check("workload.output_len")
        if self.prompts_file is not None and not os.path.isfile(self.prompts_file):
            refuse("workload.prompts_file", self.prompts_file, "an existing file (one prompt per line)")


@dataclass(frozen=True)
class EndpointConfig:
    """A deployment of `kind: endpoint` in `deployments`: any running OpenAI-compatible server, measured
    by URL with the same workload by the load client (experiments.load), beside the runtime's own."""

    name: str
    kind: str = "endpoint"
    url: str | None = None  # the server's base URL (.../v1), ours or vLLM's or any
    api_key: str | None = None  # its key, if it wants one
    model: str | None = None  # the model id it serves (default: model.name)
    processes: int = 0  # nothing of it runs here (a parallel sweep's share of the cores)
    threads_per_worker: int = 1

    def __post_init__(self):
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            refuse(f"deployment.{self.name}.url", self.url, "an http:// or https:// base URL (.../v1)")


@dataclass(frozen=True)
class RunConfig(RuntimeConfig):
    """An experiment: the runtime's config, the workload it runs and whether it plots. Its deployments
    are the runtime's (DeploymentConfig) and endpoints (EndpointConfig), in the order they run."""

    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    plots: bool = True  # plot each run's figures into its folder


def run_job(fn, cfg) -> None:
    """Run fn(cfg, the hydra job's output folder); a bad config (ValueError) exits 2 with its message
    and no traceback. Every hydra entry point (experiments.run, sim.run, sim.search) goes through it."""
    import sys
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    try:
        _check_overrides(cfg, HydraConfig.get().overrides.task)
        fn(cfg, Path(HydraConfig.get().runtime.output_dir))
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)


def _check_overrides(cfg, overrides) -> None:
    """Refuse a `deployment` override that would be silently ignored: `deployments` (set by
    experiment=compare, say) lists what runs."""
    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
    if cfg.get("deployments") and any(k == "deployment" or k.startswith("deployment.") for k in keys):
        names = [d.get("name") for d in cfg.get("deployments")]
        raise ValueError(
            f"deployment is ignored here: `deployments` lists the deployments to run ({names}, set by the "
            "experiment); drop the experiment, or override `deployments` instead"
        )


def from_cfg(cfg) -> RunConfig:
    """The composed hydra config (a DictConfig or a plain dict) -> a checked RunConfig."""
    cfg = as_dict(cfg)
    plots = {"plots": cfg["plots"]} if "plots" in cfg else {}
    listed = list(cfg.get("deployments") or [cfg.get("deployment")])
    endpoints = {
        i: of_dict(EndpointConfig, "deployment", d)
        for i, d in enumerate(listed)
        if isinstance(d, dict) and d.get("kind") == "endpoint"
    }
    ours = [d for i, d in enumerate(listed) if i not in endpoints]
    # the runtime's parts, checked (with endpoints only, a placeholder deployment stands in for the check)
    parts = runtime_parts({**cfg, "deployments": ours or [{"name": "none"}], "deployment": None})
    runtime = iter(parts["deployments"])
    parts["deployments"] = tuple(endpoints.get(i) or next(runtime) for i in range(len(listed)))
    return RunConfig(**parts, workload=workload_of(cfg), **plots)


def workload_of(cfg: dict) -> WorkloadConfig:
    w = dict(cfg.get("workload") or {})
    for key in ("prompt_len", "output_len"):
        if key in w:
            w[key] = of_dict(LengthDist, f"workload.{key}", w[key])
    if "sampling" in w:
        w["sampling"] = sampling_of(w["sampling"])
    return of_dict(WorkloadConfig, "workload", w)
