"""The main job: python -m experiments.run [overrides] (what `make run` calls with experiment=compare).

Composes conf/config.yaml, checks it (experiments.config), generates the workload once, runs every
deployment on it (each at every rate of goodput_search.rates, if any), and writes the run folder:
config.yaml (hydra's .hydra/), results.json (schema in experiments/metrics.py), one CSV of requests
per run, plots, and the side-by-side table on stdout.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from experiments.config import EndpointConfig, from_cfg, run_job
from experiments.layout import Steps
from serving.config import check_fits_model
from serving.fleet.launcher import start_fork_server


def run(cfg: DictConfig, out_dir: Path, progress: bool = True, hooks=None) -> list[dict]:
    from experiments import metrics, report
    from experiments.driver import run_deployment
    from experiments.load import run_endpoint
    from experiments.workload import Conversations, make_requests

    start_fork_server(cfg)  # beside the checks below: local workers fork from it
    config = from_cfg(cfg)
    loaded = check_fits_model(config)  # its config and tokenizer; the workers load the weights
    m = loaded.config
    tokenizer, vocab, max_position = loaded.tokenizer, m.vocab_size, m.max_position
    del loaded
    rates = list(cfg.get("goodput_search", {}).get("rates") or [])
    for r in rates:
        if not (isinstance(r, int | float) and r > 0):
            raise ValueError(f"goodput_search.rates holds {r!r}: every rate must be a number > 0")
    if rates and config.workload.arrival != "poisson":
        told = " (a mooncake trace replays its own clock unless told otherwise)" * (
            config.workload.dataset == "mooncake"
        )
        raise ValueError(
            f"goodput_search.rates needs workload.arrival=poisson, not {config.workload.arrival}{told}"
        )
    if rates and config.workload.load is not None:
        raise ValueError("goodput_search.rates and workload.load both set the rate: give one")
    if config.workload.load is not None:  # the rate this machine makes of it (measured now, printed)
        from experiments.capacity import rate_for_load

        config = replace(config, workload=replace(config.workload, rate=rate_for_load(config)))
    plans = []  # each rate's workload and requests, all made (and checked) before anything runs
    for rate in rates or [config.workload.rate if config.workload.arrival == "poisson" else None]:
        workload = replace(config.workload, rate=rate) if rate is not None else config.workload
        if workload.dataset == "multiturn":  # the first turns; the drivers ask turns for the rest
            turns = Conversations(workload, vocab, max_position, tokenizer)
            requests = turns.first()
        else:
            turns, requests = None, make_requests(workload, tokenizer, vocab, max_position)
        _check_span(config, workload, requests)
        plans.append((rate, workload, turns, requests))
    first_core = _sweep_cores(config)
    _check_auto(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    records, interrupted = [], False
    steps = Steps(config.model)  # num_workers: auto's measured steps (measured on first use, once a job)
    logging.getLogger().setLevel(config.log_level)  # the driver's log: hydra's <run folder>/run.log
    with _sigterm_interrupts():
        for rate, workload, turns, requests in plans:
            run_config = replace(config, workload=workload)
            for d in config.deployments:
                choice = None
                if isinstance(d, EndpointConfig):  # a running server, by URL: the load client measures it
                    result = run_endpoint(run_config, d, requests, progress, turns, tokenizer)
                else:
                    if d.num_workers == "auto":  # the cores' split that this machine's steps serve best
                        d, choice = _layout(run_config, d, requests, steps)
                    log_dir = out_dir / "logs" / d.name
                    result = run_deployment(
                        run_config, d, requests, progress, hooks, log_dir, first_core, turns
                    )
                records.append(metrics.run_record(result, run_config, rate))
                if choice is not None:
                    records[-1]["layout_choice"] = choice
                metrics.write_results(out_dir, config, records)  # an interrupted run keeps what it measured
                if interrupted := result.interrupted:
                    break
            if interrupted:
                break
    report.report(out_dir, config, records, sweep=bool(rates))
    if interrupted:
        print(f"interrupted: wrote the {len(records)} run(s) measured so far", file=sys.stderr)
        raise SystemExit(130)
    return records


def _auto(config) -> list[str]:
    """The deployments whose num_workers is auto (an endpoint has none)."""
    return [d.name for d in config.deployments if getattr(d, "num_workers", None) == "auto"]


def _check_auto(config) -> None:
    """num_workers: auto splits this machine's CPU cores: refused, before anything runs, where it cannot."""
    auto = _auto(config)
    if auto and config.launcher.name == "ray":
        raise ValueError(
            f"deployment {auto[0]}: num_workers: auto measures this machine's cores; with launcher=ray give "
            "num_workers and threads_per_worker as numbers"
        )
    if auto and config.model.device != "cpu":
        raise ValueError(
            f"deployment {auto[0]}: num_workers: auto splits CPU cores between workers; on "
            f"model.device={config.model.device} give num_workers as a number"
        )


def _layout(config, d, requests, steps):
    """num_workers: auto: d with its cores' split chosen (experiments/layout.py), and the table of splits."""
    from engine.role import Role
    from experiments import layout
    from serving.config import engine_config

    budget = engine_config(
        config.model, d, Role.COLOCATED, config.slo.tpot_s
    ).scheduler.max_num_batched_tokens
    return layout.choose(
        config, d, requests, steps, layout.prompt_lengths(requests, budget), layout.job_cores()
    )


def _check_span(config, workload, requests) -> None:
    """Refuse a workload whose last request would arrive after run_timeout_s: it would never be sent, and
    the run would wait out run_timeout_s for it."""
    last = max((r.arrival_s for r in requests), default=0.0)
    if last >= config.run_timeout_s:
        how = {
            "trace": "workload.trace_scale (0.5: twice as fast) or workload.num_requests",
            "poisson": "workload.rate or workload.num_requests",
        }.get(workload.arrival, "workload.num_requests")
        raise ValueError(
            f"the workload's last request arrives {last:.0f} s after the first ({workload.arrival}), past "
            f"run_timeout_s={config.run_timeout_s}: raise run_timeout_s, or change {how}"
        )


def _sweep_cores(config) -> int:
    """Where this job's worker cores start. Jobs of a parallel (joblib) sweep run side by side: each
    gets its own share of the cores, and a sweep whose jobs cannot each have their own is refused."""
    import os

    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return 0
    hc = HydraConfig.get()
    n_jobs = int(hc.launcher.get("n_jobs", 1) or 1) if "Joblib" in str(hc.launcher.get("_target_")) else 1
    ncpu = len(os.sched_getaffinity(0))
    n_jobs = ncpu if n_jobs < 0 else n_jobs  # joblib: -1 is one job per core
    if n_jobs <= 1:
        return 0
    if config.launcher.name == "ray":
        if config.launcher.ray.address is None:
            raise ValueError(
                f"a parallel sweep (hydra.launcher.n_jobs={n_jobs}) with launcher=ray needs one shared "
                "cluster: start it (ray start --head) and set ray.address, or sweep with the basic launcher"
            )
        return 0  # Ray gives each job's workers their own CPUs
    if _auto(config):
        raise ValueError(
            f"hydra.launcher.n_jobs={n_jobs} parallel jobs with num_workers: auto: auto splits all of a "
            "job's cores, so parallel jobs would measure each other. Give num_workers a number, or sweep "
            "with the basic launcher"
        )
    per_job = max((d.processes * d.threads_per_worker for d in config.deployments), default=0)
    if per_job * n_jobs > ncpu:
        raise ValueError(
            f"hydra.launcher.n_jobs={n_jobs} parallel jobs x {per_job} cores each need {per_job * n_jobs} "
            f"cores; this machine gives {ncpu}: parallel runs would measure each other. Lower n_jobs, "
            "or sweep with the basic launcher (drop experiment=rate_sweep)"
        )
    return (hc.job.num % n_jobs) * per_job


class _sigterm_interrupts:
    """Within the block, SIGTERM raises KeyboardInterrupt as Ctrl-C does (the main thread only)."""

    def __enter__(self):
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._raise)

    @staticmethod
    def _raise(signum, frame):
        raise KeyboardInterrupt

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_job(run, cfg)


if __name__ == "__main__":
    main()
