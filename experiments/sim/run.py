"""python -m experiments.sim.run: simulate deployments on a workload, write the real runs' results.json.

Composes conf/sim.yaml (deployment/, workload/, slo/ as the real runs; hardware/ presets; a sim model
preset; efficiency factors). Each deployment's instances get TP-sized GPUs: colocated workers, prefill
and decode workers alike. Simulated times become the same per-request rows, summaries and plots as
measured ones (experiments/metrics.py), so the two can be read side by side.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

from experiments.config import (
    DeploymentConfig,
    ModelSpec,
    RunConfig,
    WorkloadConfig,
    _dataclass,
    deployments_of,
    run_job,
    slo_of,
    workload_of,
)
from experiments.deploy.messages import DeploymentRun, Result, Timeline
from experiments.sim.cost import CostModel, Efficiency
from experiments.sim.hardware import hardware_of
from experiments.sim.models import sim_model
from experiments.sim.simulate import Instance, SimRequest, simulate_colocated, simulate_disaggregated
from experiments.workload import Request, draw
from transfer.config import TransferConfig

MAX_POSITION = 1 << 20


def simulate_deployment(
    d: DeploymentConfig,
    workload: WorkloadConfig,
    model,
    hw,
    eff: Efficiency,
    first_token_on: str = "prefill",
    layerwise: bool = True,
    chunked: bool = True,
    prefill_slowdown: float = 1.0,
    trace: tuple | None = None,
    router: str = "prefill",
    spec_acceptance: float = 0.0,
    decode_kv_tokens: float | None = None,
) -> DeploymentRun:
    """trace: (arrival offsets, prompt lengths, output lengths) to replay instead of drawing the
    workload's (a measured run's own requests). decode_kv_tokens: each decode instance's KV capacity in
    tokens (None: what HBM holds after the weights); its admission and preemption follow the deployment's
    decode_reserved_tokens and decode_preemption, as the real decode workers do."""
    arrivals, prompts, outputs = trace if trace is not None else draw(workload, MAX_POSITION)
    reqs = [SimRequest(i, float(arrivals[i]), prompts[i], outputs[i]) for i in range(len(prompts))]

    k = int((d.speculative or {}).get("num_speculative_tokens", 2)) if d.speculative else 0

    def inst(tp: int, chunk: bool, slowdown: float = 1.0, decodes: bool = True) -> Instance:
        return Instance(
            CostModel(model, hw, tp, eff),
            budget=d.chunk_size,
            chunked=chunk,
            slowdown=slowdown,
            spec_k=k if decodes else 0,
            spec_acceptance=spec_acceptance,
            rng=np.random.default_rng([workload.seed, 3]),
        )

    if d.kind == "colocated":
        simulate_colocated([inst(d.tp, chunked) for _ in range(d.num_workers)], reqs)
    else:
        prefill = [inst(d.prefill_tp, False, prefill_slowdown, decodes=False) for _ in range(d.num_prefill)]
        decode = [inst(d.decode_tp, True) for _ in range(d.num_decode)]
        for i in decode:
            i.kv_tokens, i.reserved_tokens = decode_kv_tokens, d.decode_reserved_tokens
            i.preemption = d.decode_preemption
        simulate_disaggregated(prefill, decode, reqs, layerwise, first_token_on, router)
        run_timelines = [
            Timeline(f"decode-{n}", "decode", [], i.preemptions, i.recomputed_tokens, i.refetched_tokens)
            for n, i in enumerate(decode)
        ]
    run = DeploymentRun(d, [Request(f"req-{r.rid}", r.arrival, range(r.prompt), r.output) for r in reqs])
    run.start, run.end = 0.0, max((r.done or r.arrival) for r in reqs)
    if d.kind != "colocated":
        run.timelines = run_timelines  # no steps: the decode instances' preemption counts
    for r in reqs:
        rid = f"req-{r.rid}"
        run.sent[rid] = r.arrival
        error = None if r.done is not None else "not finished in the simulation"
        remote = d.kind == "disaggregated"
        run.results[rid] = Result(
            rid, "sim", [0] * r.generated, r.arrival, None, r.token_times, "length" if not error else "error",
            error, prefill="remote" if remote else "local",
            transfer_bytes=r.prompt * model.kv_bytes_per_token() if remote else 0,
            drafted=r.drafted, accepted=r.accepted, verify_steps=r.verifies,
        )  # fmt: skip
    return run


def run_sim(cfg: DictConfig, out_dir: Path) -> list[dict]:
    from experiments import metrics

    c = OmegaConf.to_container(cfg, resolve=True)
    model, hw = sim_model(c["sim_model"]), hardware_of(c["hardware"])
    eff = _dataclass(Efficiency, "efficiency", c.get("efficiency"))
    slowdown = c.get("prefill_slowdown", 1.0)
    if not isinstance(slowdown, (int, float)) or slowdown < 1:
        raise ValueError(f"prefill_slowdown={slowdown!r} is not allowed: a number >= 1")
    if c.get("router", "prefill") not in ("prefill", "decode"):
        raise ValueError(f"router={c.get('router')!r} is not allowed: one of ('prefill', 'decode')")
    if c.get("first_token_on") not in ("prefill", "decode"):
        raise ValueError(
            f"first_token_on={c.get('first_token_on')!r} is not allowed: one of ('prefill', 'decode')"
        )
    kv_tokens = c.get("decode_kv_tokens")
    if kv_tokens is not None and (
        isinstance(kv_tokens, bool) or not isinstance(kv_tokens, int) or kv_tokens < 1
    ):
        raise ValueError(f"decode_kv_tokens={kv_tokens!r} is not allowed: null or an integer >= 1")
    acceptance = c.get("spec_acceptance", 0.7)
    if isinstance(acceptance, bool) or not isinstance(acceptance, (int, float)) or not 0 <= acceptance < 1:
        raise ValueError(f"spec_acceptance={acceptance!r} is not allowed: a number in [0, 1)")
    deployments, workload, slo = deployments_of(c), workload_of(c), slo_of(c)
    if workload.dataset == "multiturn":
        raise ValueError(
            "workload.dataset=multiturn is not simulated yet (its turns depend on replies): use random, "
            "sharegpt or mooncake"
        )
    if workload.arrival not in ("poisson", "trace") or workload.prompts_file:
        raise ValueError(
            "the simulator needs workload.arrival=poisson (or trace: a mooncake dataset's timestamps) "
            "and no prompts_file"
        )
    config = RunConfig(
        ModelSpec(model.name), deployments, workload, slo, TransferConfig(), plots=bool(c.get("plots"))
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    rates = list((c.get("goodput_search") or {}).get("rates") or []) or [workload.rate]
    records = []
    for rate in rates:
        run_config = replace(config, workload=replace(workload, rate=rate))
        for d in deployments:
            run = simulate_deployment(
                d, run_config.workload, model, hw, eff, c["first_token_on"], c.get("layerwise", True),
                c.get("chunked_prefill", True), slowdown, router=c.get("router", "prefill"),
                spec_acceptance=acceptance, decode_kv_tokens=kv_tokens,
            )  # fmt: skip
            records.append(metrics.run_record(run, run_config, rate))
    metrics.report(
        out_dir, config, records, heading=f"\nsimulated: {model.name} on {hw.name} ({hw.source} figures)\n"
    )
    return records


@hydra.main(version_base=None, config_path="../../conf", config_name="sim")
def main(cfg: DictConfig) -> None:
    run_job(run_sim, cfg)


if __name__ == "__main__":
    main()
