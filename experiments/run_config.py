"""The experiment's config as the main job runs it: the runtime's (serving/config.py) with the
workload and whether it plots (RunConfig), and deployments measured by URL (EndpointConfig).
experiments/config.py builds it from the composed hydra config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from experiments.workload_config import WorkloadConfig
from serving.checks import refuse
from serving.config import RuntimeConfig


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
