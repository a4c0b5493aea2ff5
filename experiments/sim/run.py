"""python -m experiments.sim.run: simulate deployments on a workload, write the real runs' results.json.

Composes conf/sim.yaml (deployment/, workload/, slo/ as the real runs; hardware/ presets; a sim model
preset; efficiency factors). Each deployment's instances get TP-sized GPUs: colocated workers, prefill
and decode workers alike. Simulated times become the same per-request rows, summaries and plots as
measured ones (experiments/metrics.py), so the two can be read side by side.

Prefix caching follows `deployment.prefix_caching` (each instance's cache holds `cache_pages` pages of
`page_size` tokens; experiments/sim/simulate.py says how it is modelled): a multiturn workload runs as
the real drivers run it, a closed loop whose next turn is due think_time_s after a reply ends, at most
`workload.concurrency` requests in flight under arrival=concurrency.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

from experiments.config import RunConfig, WorkloadConfig, run_job, workload_of
from experiments.record import DeploymentRun, Request
from experiments.sim.cost import CostModel, Efficiency
from experiments.sim.hardware import hardware_of
from experiments.sim.instance import TierSpec, check_fits
from experiments.sim.models import sim_model
from experiments.sim.operator_cost import OperatorCost
from experiments.sim.simulate import Instance, SimRequest, simulate_colocated, simulate_disaggregated
from experiments.workload import Conversations, draw, mooncake_block, mooncake_rows
from serving.config import (
    DeploymentConfig,
    ModelSpec,
    SloConfig,
    deployments_of,
    of_dict,
    prefill_budget,
    slo_of,
)
from serving.messages import Result, TierCounters, Timeline
from serving.router.policy import Router
from transfer.config import TransferConfig

MAX_POSITION = 1 << 20
# how a step is priced (sim.cost): the roofline on datasheet peaks x efficiency, or operator by operator by
# models fitted on published GPU profiles (dense models on A100 or H100)
COSTS = {"roofline": CostModel, "operators": OperatorCost}
# what one role switch takes of an elastic worker's time (the real one: docs/results/scheduling.md)
SWITCH_S = 0.1


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
    page_size: int = 16,
    cache_pages: int | None = None,
    slo: SloConfig | None = None,
    switch_s: float = SWITCH_S,
    tiers: TierSpec | None = None,
    colocated_kv_tokens: float | None = None,
    cost: str = "roofline",
    contention=None,
) -> DeploymentRun:
    """trace: (arrival offsets, prompt lengths, output lengths[, conversations, turns]) to replay instead
    of drawing the workload's (a measured run's own requests; a multiturn run's are replayed at the times
    they were sent, its pages named by conversation). decode_kv_tokens: each decode instance's KV
    capacity in tokens (None: what HBM holds after the weights); its admission and preemption follow the
    deployment's decode_reserved_tokens and decode_preemption, as the real decode workers do.
    cache_pages: each instance's prefix cache (None: its KV capacity; only with deployment.prefix_caching).
    slo: what deployment.admission=slo holds requests to (the policy's, as the real router's), and an
    elastic deployment's planner too; switch_s: what one role switch takes of an instance's time. tiers:
    KV below each instance's prefix cache (kv_tiers: host pool, files, the shared pool).
    colocated_kv_tokens: each colocated instance's KV capacity in tokens (a real run's num_pages x
    page_size: what its requests wait for room in; None: what HBM holds after the weights). contention
    (experiments.sim.contention.Contention): the instances share one machine, each step slowed by the
    others' beside it; None: each has its own."""
    multiturn = workload.dataset == "multiturn"
    shared = workload.system_prompt_len if multiturn else 0
    moves: list[dict] = []
    follow, concurrency, turns = None, None, {}
    if trace is not None:
        arrivals, prompts, outputs, *conv = trace
        convs, turn_of = conv if conv else ([-1] * len(prompts), [0] * len(prompts))
        reqs = [
            SimRequest(i, float(arrivals[i]), prompts[i], outputs[i], shared=shared if convs[i] >= 0 else 0,
                       stream=("conversation", convs[i]) if convs[i] >= 0 else None,
                       conversation=convs[i], turn=turn_of[i])
            for i in range(len(prompts))
        ]  # fmt: skip
        if multiturn:  # a later turn is sent when it was, but never before its simulated previous reply
            later = {(r.conversation, r.turn): r for r in reqs}  # ended and think_time_s passed

            def follow(r: SimRequest) -> SimRequest | None:
                nxt = later.get((r.conversation, r.turn + 1))
                if nxt is not None:
                    nxt.arrival = max(nxt.arrival, r.done + workload.think_time_s)
                return nxt

            first: dict[int, int] = {}  # conversation -> its first turn in the trace
            for r in reqs:
                first[r.conversation] = min(first.get(r.conversation, r.turn), r.turn)
            reqs = [r for r in reqs if r.turn == first[r.conversation]]
    elif multiturn:  # a closed loop: each reply's end makes its conversation's next turn due
        conversations = _conversations(workload)

        def sim_request(req: Request) -> SimRequest:
            r = SimRequest(len(turns), req.arrival_s, len(req.prompt_ids), req.max_tokens, shared=shared,
                           stream=("conversation", req.conversation), conversation=req.conversation,
                           turn=req.turn)  # fmt: skip
            turns[r.rid] = req
            return r

        def follow(r: SimRequest) -> SimRequest | None:
            nxt = conversations.next(turns[r.rid], [0] * r.generated, r.done)
            return sim_request(nxt) if nxt is not None else None

        reqs = [sim_request(req) for req in conversations.first()]
        concurrency = workload.concurrency if workload.arrival == "concurrency" else None
    else:
        arrivals, prompts, outputs = draw(workload, MAX_POSITION)
        reqs = [SimRequest(i, float(arrivals[i]), prompts[i], outputs[i]) for i in range(len(prompts))]
    if workload.dataset == "mooncake":  # its pages named by the trace's blocks, as the real prompts share
        for r, row in zip(reqs, mooncake_rows(workload), strict=True):  # (a replay's too: the same lines)
            r.blocks, r.block = tuple(row.get("hash_ids") or ()), mooncake_block(workload)

    k = int((d.speculative or {}).get("num_speculative_tokens", 2)) if d.speculative else 0
    # auto: the budget of the machine simulated (its ISA), not of the one the simulator runs on
    budget = prefill_budget(d.chunk_size, "cpu" if hw.name.startswith("cpu") else "cuda", "bfloat16", hw.bf16)

    target = d.step_target_s((slo or SloConfig()).tpot_s)  # chunk_size: slo (None: the fixed budget)

    def inst(tp: int, dp: int, chunk: bool, slowdown: float = 1.0, decodes: bool = True) -> Instance:
        if target is not None and decodes:
            from engine.budget import SloBudget  # here: the simulator imports without torch otherwise

            step_budget = SloBudget(target, budget)
        else:
            step_budget = None
        return Instance(
            COSTS[cost](model, hw, tp, eff, dp),  # dp: deployment.dp, prefill_dp or decode_dp
            budget=budget,
            step_budget=step_budget,
            chunked=chunk,
            slowdown=slowdown,
            contention=contention,
            spec_k=k if decodes else 0,
            spec_acceptance=spec_acceptance,
            rng=np.random.default_rng([workload.seed, 3]),
            page_size=page_size,
        )

    shared_pool = OrderedDict() if tiers is not None and tiers.pool_pages else None

    def caching(instances: list[Instance]) -> list[Instance]:
        if not d.prefix_caching:
            return instances
        return [i.enable_cache(cache_pages, tiers, shared_pool) for i in instances]

    def policy(pool: list[Instance], names) -> Router:
        """The deployment's routing over pool, believing each instance caches as much as it can."""
        pages = pool[0].cache.size if pool[0].cache is not None else 0
        return Router.of(d, names, pages, page_size, slo=slo)

    if d.colocated:
        colocated = [inst(d.tp, d.dp, chunked) for _ in range(d.num_workers)]
        for i in colocated:  # a real worker's pages per DP group
            i.kv_tokens = colocated_kv_tokens * d.dp if colocated_kv_tokens is not None else None
        check_fits(d, "colocated", colocated[0], max(r.prompt + r.output for r in reqs))
        colocated = caching(colocated)
        simulate_colocated(colocated, reqs, follow, concurrency, policy(colocated, range(len(colocated))))
        run_timelines = [_timeline(f"worker-{n}", "colocated", i) for n, i in enumerate(colocated)]
    else:
        prefill = [
            inst(d.prefill_tp, d.prefill_dp, False, prefill_slowdown, decodes=False)
            for _ in range(d.num_prefill)
        ]
        decode = [inst(d.decode_tp, d.decode_dp, True) for _ in range(d.num_decode)]
        roles = {  # an elastic instance takes its new role's settings (its TP stays)
            "prefill": dict(chunked=False, slowdown=prefill_slowdown, spec_k=0, kv_tokens=None),
            "decode": dict(chunked=True, slowdown=1.0, spec_k=k, kv_tokens=decode_kv_tokens),
        }
        for i in prefill + decode:
            i.kv_tokens = decode_kv_tokens if i in decode else None
            i.reserved_tokens, i.preemption = d.decode_reserved_tokens, d.decode_preemption
            i.local_prefill_max_tokens, i.role_settings = d.local_prefill_max_tokens, roles
        check_fits(d, "prefill", prefill[0], max(r.prompt for r in reqs))
        check_fits(d, "decode", decode[0], max(r.prompt + r.output for r in reqs))
        prefill, decode = caching(prefill), caching(decode)
        names = [f"decode-{n}" for n in range(len(decode))]
        bounds = (slo.ttft_s, slo.tpot_s) if slo is not None else (float("inf"), float("inf"))
        simulate_disaggregated(
            prefill, decode, reqs, layerwise, first_token_on, router, follow, concurrency,
            policy(decode, names), d.planner, bounds, switch_s, moves,
        )  # fmt: skip
        run_timelines = [_timeline(f"prefill-{n}", "prefill", i) for n, i in enumerate(prefill)]
        run_timelines += [_timeline(f"decode-{n}", "decode", i) for n, i in enumerate(decode)]
    run = DeploymentRun(
        d,
        [Request(f"req-{r.rid}", r.arrival, range(r.prompt), r.output, r.conversation, r.turn) for r in reqs],
    )
    run.start, run.end = 0.0, max((r.done or r.arrival) for r in reqs)
    run.moves = moves
    run.timelines = run_timelines  # no steps: the instances' preemption and prefix cache counts
    for r in reqs:
        rid = f"req-{r.rid}"
        run.sent[rid] = r.arrival
        error = None if r.done is not None else (r.rejected or "not finished in the simulation")
        reason = "length" if not error else ("rejected" if r.rejected else "error")
        remote = not d.colocated and not r.local
        run.results[rid] = Result(
            rid, "sim", [0] * r.generated, r.arrival, None, r.token_times, reason,
            error, prefill="remote" if remote else "local",
            transfer_bytes=r.sent_tokens * model.kv_bytes_per_token(),
            drafted=r.drafted, accepted=r.accepted, verify_steps=r.verifies, cached_tokens=r.cached,
        )  # fmt: skip
    return run


def _timeline(name: str, role: str, i: Instance) -> Timeline:
    """An instance's counts as a real worker's Timeline carries them (no steps)."""
    queries, hits = (i.cache.queries, i.cache.hits) if i.cache is not None else (0, 0)
    timeline = Timeline(name, role, [], i.preemptions, i.recomputed_tokens, i.refetched_tokens, queries, hits)
    if i.cache is not None and i.cache.tiers is not None:
        timeline.kv_tiers = {t: TierCounters(hit_tokens=n) for t, n in i.cache.tier_hits.items()}
    return timeline


def _conversations(workload: WorkloadConfig) -> Conversations:
    """The multiturn workload's conversations for the simulator (a ShareGPT file's counted with SmolLM2's
    tokenizer, as draw() counts a sharegpt workload's)."""
    tokenizer = None
    if workload.dataset_path is not None:
        from engine.weights import load_model

        tokenizer = load_model("tiny-random").tokenizer
    return Conversations(workload, 1 << 20, MAX_POSITION, tokenizer)


def run_sim(cfg: DictConfig, out_dir: Path) -> list[dict]:
    from experiments import metrics, report

    c = OmegaConf.to_container(cfg, resolve=True)
    model, hw = sim_model(c["sim_model"]), hardware_of(c["hardware"])
    eff = of_dict(Efficiency, "efficiency", c.get("efficiency"))
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
    if c.get("cost", "roofline") not in COSTS:
        raise ValueError(f"cost={c.get('cost')!r} is not allowed: one of {tuple(COSTS)}")
    acceptance = c.get("spec_acceptance", 0.7)
    if isinstance(acceptance, bool) or not isinstance(acceptance, (int, float)) or not 0 <= acceptance < 1:
        raise ValueError(f"spec_acceptance={acceptance!r} is not allowed: a number in [0, 1)")
    cache_pages = c.get("cache_pages")
    if cache_pages is not None and (
        isinstance(cache_pages, bool) or not isinstance(cache_pages, int) or cache_pages < 0
    ):
        raise ValueError(f"cache_pages={cache_pages!r} is not allowed: null or an integer >= 0")
    page_size = c.get("page_size", 16)
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r} is not allowed: an integer >= 1")
    deployments, workload, slo = deployments_of(c), workload_of(c), slo_of(c)
    for d in deployments:
        if d.num_workers == "auto":
            raise ValueError(
                f"deployment {d.name}: num_workers=auto is chosen by the main job from this machine's steps; "
                "the simulator takes a number (workers x threads_per_worker)"
            )
    arrivals = ("poisson", "concurrency") if workload.dataset == "multiturn" else ("poisson", "trace")
    if workload.arrival not in arrivals or workload.prompts_file:
        raise ValueError(
            f"workload.arrival={workload.arrival!r} is not simulated for workload.dataset="
            f"{workload.dataset!r}: one of {arrivals} (trace: a mooncake dataset's timestamps; concurrency:"
            " a multiturn workload's closed loop), and no prompts_file"
        )
    config = RunConfig(
        model=ModelSpec(model.name),
        deployments=deployments,
        workload=workload,
        slo=slo,
        transfer=TransferConfig(),
        plots=bool(c.get("plots")),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    rates = list((c.get("goodput_search") or {}).get("rates") or []) or [workload.rate]
    if workload.arrival in ("concurrency", "trace"):  # a closed loop, or a trace's own timestamps: no
        rates = [None]  # rate of ours, as the real runs record it (a replayed trace is not "@1/s")
    records = []
    for rate in rates:
        run_config = replace(config, workload=replace(workload, rate=rate or workload.rate))
        for d in deployments:
            run = simulate_deployment(
                d, run_config.workload, model, hw, eff, c["first_token_on"], c.get("layerwise", True),
                c.get("chunked_prefill", True), slowdown, router=c.get("router", "prefill"),
                spec_acceptance=acceptance, decode_kv_tokens=kv_tokens, page_size=page_size,
                cache_pages=cache_pages, slo=slo, cost=c.get("cost", "roofline"),
            )  # fmt: skip
            records.append(metrics.run_record(run, run_config, rate))
    report.report(
        out_dir, config, records, heading=f"\nsimulated: {model.name} on {hw.name} ({hw.source} figures)\n"
    )
    return records


@hydra.main(version_base=None, config_path="../../conf", config_name="sim")
def main(cfg: DictConfig) -> None:
    run_job(run_sim, cfg)


if __name__ == "__main__":
    main()
