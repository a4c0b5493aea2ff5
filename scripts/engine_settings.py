"""The engine settings every worker of every conf/ composition gets, as one JSON file: run it at two commits
and compare, to show that a change to how settings reach the engine changed none of them.

python scripts/engine_settings.py OUT.json

Compositions: each model preset x each deployment preset x no experiment or each experiment preset x a
few overrides that reach the engine (chunk_size, the KV tiers, speculation, preemption, dtype, prefix
caching). A composition the config refuses is recorded as refused, with its message.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from experiments.config import from_cfg
from serving.fleet.fleet import worker_names, worker_specs
from transfer.auth import keyring

CONF = Path(__file__).resolve().parents[1] / "conf"
MODELS = ["smollm2-135m", "tiny-random", "tiny-random-moe", "tiny-random-deepseek", "random-llama-1b"]
DEPLOYMENTS = ["1p1d", "1p1d-dp2", "1p3d", "2p1d", "colocated"]
EXPERIMENTS = [None, "compare", "compare_concurrency1", "rate_sweep"]
OVERRIDES = [
    [],
    ["deployment.chunk_size=slo"],
    ["deployment.chunk_size=300"],
    ["kv_tiers.host_bytes=64MiB"],
    ["+deployment.speculative={method: ngram, num_speculative_tokens: 2}"],
    ["deployment.decode_preemption=recompute_local"],
    ["model.dtype=float32"],
    ["deployment.prefix_caching=false"],
]
PER_HOST = ("disk_dir", "secret", "store_master", "store_metadata")  # each run's own, not a setting


def settings(spec) -> dict:
    """A worker's engine settings by the names LLM takes (engine.config.settings)."""
    from engine.config import settings as named
    from engine.speculative import SpeculativeConfig

    out = named(spec.engine)
    out.pop("dp_rank"), out.pop("cuda_graphs")  # neither is the deployment's to set
    tiers = out["kv_tiers"]
    out["kv_tiers"] = (
        {k: v for k, v in dataclasses.asdict(tiers).items() if k not in PER_HOST} if tiers.enabled else None
    )
    spec_cfg = SpeculativeConfig.of(out["speculative_config"])
    out["speculative_config"] = dataclasses.asdict(spec_cfg) if spec_cfg else None
    out["role"] = str(out["role"])
    return out


def main(out_path: str) -> None:
    out = {}
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        for model, dep, exp, extra in itertools.product(MODELS, DEPLOYMENTS, EXPERIMENTS, OVERRIDES):
            overrides = [
                f"model={model}",
                f"deployment={dep}",
                *([f"experiment={exp}"] if exp else []),
                *extra,
            ]
            key = " ".join(overrides)
            try:
                config = from_cfg(compose("config", overrides=overrides))
            except ValueError as e:
                out[key] = f"refused: {e}"
                continue
            workers = {}
            for d in config.deployments:
                try:
                    for spec in worker_specs(config, d, "ipc:///unused", "/unused", keyring(worker_names(d))):
                        workers[f"{d.name}/{spec.name}"] = settings(spec)
                except ValueError as e:
                    workers[d.name] = f"refused: {e}"
            out[key] = workers
    Path(out_path).write_text(json.dumps(out, indent=1, sort_keys=True, default=str))
    print(f"{len(out)} compositions -> {out_path}")


if __name__ == "__main__":
    main(sys.argv[1])
