"""A load defined by the machine (workload.load): one worker's prefill capacity, measured in a warm-up.

`workload.load: 1.2` asks for Poisson arrivals at 1.2 times what one worker can prefill here: before the
run, an engine like a worker's (the model, its dtype and device, the first deployment's threads per
worker and prefill budget) prefills a prompt of the workload's mean length twice to warm up and three
times timed; its prompt tokens per second over that mean length is the capacity in requests per
second, and the rate is load times it. So `make run` puts a slow AVX2 machine and a fast AVX-512 or AMX
one under the same relative load: a single prefill worker (1P1D) falls behind, two colocated workers
keep up but put their prompts' chunks in their decodes' steps. The measurement is printed and logged.
"""

from __future__ import annotations

import logging
import statistics
import time

log = logging.getLogger(__name__)

WARMUP, TIMED = 2, 3


def prefill_tokens_s(config, prompt_tokens: int) -> float:
    """Prompt tokens per second one worker prefills (the median of TIMED whole prompts)."""
    import torch

    from engine import LLM, SamplingParams
    from engine.role import Role
    from serving.config import DeploymentConfig, engine_config

    m = config.model
    d = next((d for d in config.deployments if isinstance(d, DeploymentConfig)), None)
    threads = d.threads_per_worker if d is not None else 1
    engine = engine_config(m, d or DeploymentConfig("capacity"), Role.COLOCATED, config.slo.tpot_s)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    pages = -(-(prompt_tokens + 8) // m.page_size) + 1
    try:
        # one worker's engine, alone: no TP, DP, speculation or step target; pages for the prompt only
        alone = dict(tp=1, dp=1, speculative_config=None, step_target_s=None, enable_prefix_caching=False)
        with LLM(engine, num_pages=pages, **alone) as llm:
            times = []
            for i in range(WARMUP + TIMED):
                prompt = [100 + (i * 7 + t) % 1000 for t in range(prompt_tokens)]
                llm.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
                start = time.perf_counter()
                while llm.has_unfinished():
                    llm.step()
                times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return prompt_tokens / statistics.median(times[WARMUP:])


def rate_for_load(config) -> float:
    """workload.load x one worker's prefill capacity (requests/s at the workload's mean prompt)."""
    w = config.workload
    prompt = max(1, round(w.prompt_len.expected))
    tokens_s = prefill_tokens_s(config, prompt)
    rate = max(0.01, round(w.load * tokens_s / prompt, 2))
    m, ms = config.model, 1e3 * prompt / tokens_s
    say = (
        f"workload.load={w.load:g}: one worker prefills {tokens_s:,.0f} prompt tokens/s here ({m.name}, "
        f"{m.dtype}; a {prompt}-token prompt in {ms:,.0f} ms), so the rate is {rate:.2f} req/s"
    )
    log.info(say)  # on the console too (hydra's), and in the run's log
    return rate
