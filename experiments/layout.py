"""A colocated deployment's cores as workers x threads, chosen by measurement (`num_workers: auto`).

Two cores can serve as two workers of one thread each (each step on one core, two batches) or as one
worker of two threads (each step on both cores: prefills finish sooner, one batch). Which meets the SLO
for more requests depends on the machine (how well a step scales over threads), the model and the load,
so it is measured, not guessed: for every split of the job's cores (workers x threads = cores), this
machine's engine is timed with that many threads (experiments.sim.calibrate.measure_engine: prefills at
the workload's prompt lengths, decode steps of several batch sizes), the cost model is fitted to those
steps (calibrate.fit), and the simulator replays the run's own requests (arrival times, prompt and output
lengths) through that many workers with the deployment's routing and step budget. The split whose
simulated run meets the SLO for the most requests is run (ties: the one with more headroom under the SLO);
the table of every candidate is logged and kept in the run's record ("layout_choice").

The measurement takes a few seconds a split, once per job (a rate sweep simulates each rate with it).
What it cannot see: the simulator replays the requests at their arrival times, so a workload at a fixed
concurrency (every arrival 0) is simulated as one burst; the isolated steps it times run faster than a
loaded worker's (docs/results/simulator.md), so its latencies read low for every split alike.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

log = logging.getLogger(__name__)

# decoding sequences in the measured step that also prefills the longest prompt: a colocated worker's
# step under load, which the cost model fitted to prefills and decodes alone read 8-17% fast (one and two
# threads on a Xeon with AMX, a 1,024-token prompt beside 8 decodes)
MIXED_DECODES = 8


def splits(cores: int) -> list[tuple[int, int]]:
    """Every (workers, threads per worker) whose product is cores, the most workers first."""
    if not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be an integer >= 1, got {cores!r}")
    return [(cores // t, t) for t in range(1, cores + 1) if cores % t == 0]


def job_cores() -> int:
    """The cores this process may run on (its affinity): what a job's workers are pinned to."""
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class Candidate:
    workers: int
    threads: int
    attainment_pct: float  # simulated: requests meeting the SLO
    ttft_p90_s: float
    tpot_p90_s: float
    fit_error_pct: float  # the cost model's rms relative error over this thread count's measured steps

    def headroom(self, slo) -> float:
        """How far under the SLO the p90s sit (larger is better; ties between equal attainments)."""
        return -(self.ttft_p90_s / slo.ttft_s + self.tpot_p90_s / slo.tpot_s)

    def row(self) -> dict:
        return {
            "num_workers": self.workers,
            "threads_per_worker": self.threads,
            "simulated_attainment_pct": round(self.attainment_pct, 1),
            "simulated_ttft_p90_s": round(self.ttft_p90_s, 3),
            "simulated_tpot_p90_s": round(self.tpot_p90_s, 4),
            "fit_error_pct": round(self.fit_error_pct, 1),
        }


class Steps:
    """This machine's fitted cost model per thread count, measured on first use and kept for the job."""

    def __init__(self, model_spec):
        self.spec, self.fits, self.core = model_spec, {}, None

    def fitted(self, threads: int, prompts: tuple[int, ...]):
        """(sim model, hardware, efficiency, rms relative error) for steps on `threads` threads, fitted to
        prefills of these prompt lengths and decode steps."""
        if (threads, prompts) not in self.fits:
            self.fits[threads, prompts] = self._measure(threads, prompts)
        return self.fits[threads, prompts]

    def _measure(self, threads: int, prompts: tuple[int, ...]):
        import torch

        from experiments.sim.calibrate import fit, measure_engine
        from experiments.sim.hardware import measure
        from experiments.sim.models import sim_model

        before = torch.get_num_threads()
        try:
            # the GEMM in the engine's dtype: a bf16 GEMM on a CPU without bf16 runs 80x below fp32's
            self.core = self.core or measure(1, dtype=self.spec.dtype)
            cores = self.core if threads == 1 else measure(threads, dtype=self.spec.dtype)
            # the cores' peak: one core's GEMM rate times the threads (oneDNN's own 1,024-square GEMM on 2
            # threads reached 1.16x one core's on a Xeon with AMX, where the engine's prefill reaches 1.8x)
            hw = replace(cores, name=f"cpu-{threads}t", flops=self.core.flops * threads)
            points = measure_engine(
                self.spec.name,
                threads,
                prompts=prompts,
                dtype=self.spec.dtype,
                device=self.spec.device,
                mixed=MIXED_DECODES,
            )
        finally:
            torch.set_num_threads(before)
        model = sim_model(self.spec.name)
        eff, err = fit(model, hw, points, allow_bound=True)  # the best description there is; its error kept
        return model, hw, eff, 100 * err**0.5


def prompt_lengths(requests, budget: int) -> tuple[int, ...]:
    """Prefill shapes to time: short ones for the fit's spread and the requests' median prompt, each at
    most one step's budget (a longer prompt is prefilled in chunks of it)."""
    lens = sorted(len(r.prompt_ids) for r in requests) or [128]
    median = min(budget, max(1, lens[len(lens) // 2]))
    return tuple(sorted({min(budget, 32), min(budget, 128), median}))


def choose(config, d, requests, steps: Steps, prompts: tuple[int, ...], cores: int):
    """d with num_workers and threads_per_worker set to the split of cores whose simulated run of these
    requests meets config.slo best, and the table of every split (Candidate rows, best first)."""
    from experiments.metrics import request_rows
    from experiments.sim.run import simulate_deployment

    w, slo = config.workload, config.slo
    trace = (
        [r.arrival_s for r in requests],
        [len(r.prompt_ids) for r in requests],
        [r.max_tokens for r in requests],
    )
    pages = config.model.num_pages * config.model.page_size if config.model.num_pages else None
    candidates = []
    for workers, threads in splits(cores):
        model, hw, eff, err = steps.fitted(threads, prompts)
        layout = replace(d, num_workers=workers, threads_per_worker=threads)
        run = simulate_deployment(
            layout, w, model, hw, eff, trace=trace if w.dataset != "multiturn" else None, slo=slo,
            colocated_kv_tokens=pages, page_size=config.model.page_size,
        )  # fmt: skip
        rows = request_rows(run, slo)
        met = 100.0 * sum(r["meets_slo"] for r in rows) / max(1, len(rows))
        candidates.append(Candidate(workers, threads, met, _p90(rows, "ttft_s"), _p90(rows, "tpot_s"), err))
    candidates.sort(key=lambda c: (c.attainment_pct, c.headroom(slo)), reverse=True)
    best = candidates[0]
    log.info(
        "deployment %s: num_workers: auto on %d cores -> %d worker(s) x %d thread(s); simulated from this "
        "machine's measured steps: %s",
        d.name, cores, best.workers, best.threads,
        "; ".join(
            f"{c.workers}x{c.threads}: {c.attainment_pct:.0f}% meet the SLO, TTFT p90 {c.ttft_p90_s:.2f} s, "
            f"TPOT p90 {1e3 * c.tpot_p90_s:.0f} ms (fit {c.fit_error_pct:.0f}%)"
            for c in candidates
        ),
    )  # fmt: skip
    return replace(d, num_workers=best.workers, threads_per_worker=best.threads), [
        c.row() for c in candidates
    ]


def _p90(rows: list[dict], key: str) -> float:
    values = sorted(r[key] for r in rows if r.get(key) is not None)
    return values[min(len(values) - 1, int(0.9 * len(values)))] if values else float("inf")
