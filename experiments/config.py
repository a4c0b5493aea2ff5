"""The experiment config: the deployment runtime's (serving/config.py) plus the workload and
what the experiment reports, checked and turned into dataclasses in one place, before any process starts.

`from_cfg` takes the composed hydra config (conf/config.yaml) and returns a RunConfig; every wrong value
fails here with a ValueError naming the key, the value and what is allowed. Nothing below experiments/
imports hydra: workers get these dataclasses.
"""

from __future__ import annotations

from experiments.run_config import EndpointConfig, RunConfig
from experiments.workload_config import LengthDist, WorkloadConfig, sampling_of
from serving.config import (
    as_dict,
    of_dict,
    runtime_parts,
)


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


import experiments.schema  # noqa: E402, F401  (hydra gets the dataclasses' defaults: compose finds them)
