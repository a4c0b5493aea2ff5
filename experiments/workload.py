"""Requests of a workload: when each arrives, its prompt tokens and how many tokens it generates."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from experiments.config import LengthDist, WorkloadConfig


@dataclass(frozen=True)
class Request:
    request_id: str
    arrival_s: float  # offset from the start of the run (poisson); 0 under fixed concurrency
    prompt_ids: list[int] | range  # a range stands in for a simulated request's prompt
    max_tokens: int


def sample_lengths(dist: LengthDist, n: int, rng: np.random.Generator, cap: int) -> list[int]:
    if dist.kind == "fixed":
        out = np.full(n, dist.value)
    elif dist.kind == "uniform":
        out = rng.integers(dist.low, dist.high + 1, n)
    else:  # log-normal with the given mean (in tokens) and sigma of the underlying normal
        mu = np.log(dist.mean) - dist.sigma**2 / 2
        out = np.rint(rng.lognormal(mu, dist.sigma, n))
    return [int(x) for x in np.clip(out, 1, cap)]


def draw(workload: WorkloadConfig, max_position: int) -> tuple[np.ndarray, list[int], list[int]]:
    """Arrival offsets, prompt lengths and output lengths (the simulator's workload; random prompts):
    the same as make_requests gives for the config."""
    rng = np.random.default_rng(workload.seed)
    n = workload.num_requests
    outputs = sample_lengths(workload.output_len, n, rng, cap=max_position // 2)
    prompts = sample_lengths(workload.prompt_len, n, rng, cap=max_position // 2)
    prompts = [min(p, max_position - o - 1) for p, o in zip(prompts, outputs, strict=True)]
    return _arrivals(workload), prompts, outputs


def _arrivals(workload: WorkloadConfig) -> np.ndarray:
    """Arrival offsets from a stream of their own, so the simulator's draw and a real run's requests
    (which also draw prompt token ids) arrive at the same times."""
    n = workload.num_requests
    if workload.arrival != "poisson":
        return np.zeros(n)
    rng = np.random.default_rng([workload.seed, 1])
    arrivals = np.cumsum(rng.exponential(1.0 / workload.rate, n))
    return arrivals - arrivals[0]  # the first request arrives at once


def make_requests(workload: WorkloadConfig, tokenizer, vocab_size: int, max_position: int) -> list[Request]:
    """Seeded: the same config gives the same requests in every deployment."""
    rng = np.random.default_rng(workload.seed)
    n = workload.num_requests
    outputs = sample_lengths(workload.output_len, n, rng, cap=max_position // 2)
    if workload.prompts_file:
        with open(workload.prompts_file) as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        if not lines:
            raise ValueError(f"workload.prompts_file={workload.prompts_file!r} holds no prompts")
        prompts = [tokenizer.encode(lines[i % len(lines)]) for i in range(n)]
    else:  # random token ids, as vLLM's and SGLang's random datasets (ids 0-2 are usually special)
        lengths = sample_lengths(workload.prompt_len, n, rng, cap=max_position // 2)
        prompts = [rng.integers(3, vocab_size, k).tolist() for k in lengths]
    prompts = [p[: max_position - o - 1] for p, o in zip(prompts, outputs, strict=True)]
    arrivals = _arrivals(workload)
    return [Request(f"req-{i}", float(arrivals[i]), prompts[i], outputs[i]) for i in range(n)]
