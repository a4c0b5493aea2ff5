"""The main job: python -m experiments.run [overrides] (what `make run` calls with experiment=compare).

Composes conf/config.yaml, checks it (experiments.config), generates the workload once, runs every
deployment on it (each at every rate of goodput_search.rates, if any), and writes the run folder:
config.yaml (hydra's .hydra/), results.json (schema in experiments/metrics.py), one CSV of requests
per run, plots, and the side-by-side table on stdout.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from experiments.config import check_fits_model, from_cfg, run_job


def run(cfg: DictConfig, out_dir: Path, progress: bool = True, hooks=None) -> list[dict]:
    from experiments import metrics
    from experiments.driver import run_deployment
    from experiments.workload import make_requests

    config = from_cfg(cfg)
    loaded = check_fits_model(config)
    m = loaded.config
    tokenizer, vocab, max_position = loaded.tokenizer, m.vocab_size, m.max_position
    del loaded  # the workers load their own weights
    rates = list(cfg.get("goodput_search", {}).get("rates") or [])
    for r in rates:
        if not (isinstance(r, int | float) and r > 0):
            raise ValueError(f"goodput_search.rates holds {r!r}: every rate must be a number > 0")
    if rates and config.workload.arrival != "poisson":
        raise ValueError("goodput_search.rates needs workload.arrival=poisson")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    records = []
    for rate in rates or [config.workload.rate if config.workload.arrival == "poisson" else None]:
        workload = replace(config.workload, rate=rate) if rate is not None else config.workload
        requests = make_requests(workload, tokenizer, vocab, max_position)
        run_config = replace(config, workload=workload)
        for d in config.deployments:
            result = run_deployment(run_config, d, requests, progress=progress, hooks=hooks)
            records.append(metrics.run_record(result, run_config, rate))
    metrics.report(out_dir, config, records, sweep=bool(rates))
    return records


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_job(run, cfg)


if __name__ == "__main__":
    main()
