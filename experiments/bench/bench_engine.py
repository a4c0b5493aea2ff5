"""Prefill and decode tokens/s of the engine against transformers' generate, same weights, same run.

Each request: a 128-token prompt, 32 greedy new tokens. The engine's token budget covers a whole batch,
so its first step is the prefill of every prompt and later steps are pure decode, as in generate().
Prefill time: start to the first new token; decode: first to last new token (31 steps). Both models are
loaded before anything is timed: on this VM a process's resident size alone moves decode speed by 30%.
Default dtype bfloat16 (the CPU's fast GEMM path, as in vLLM's CPU build); PDKERNELS_BENCH_DTYPE=float32
compares in fp32. test_main_job_workload adds the main job's own workload (experiments.run, a real worker
process) at concurrency 1 and 20: `-k main_job` runs it alone.
"""

import os
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.weights import smollm2_gguf_path

PROMPT_LEN, NEW_TOKENS, BATCHES = 128, 32, [1, 8, 32]
DTYPE = os.environ.get("PDKERNELS_BENCH_DTYPE", "bfloat16")  # both sides run in this dtype
ROUNDS = int(os.environ.get("PDKERNELS_BENCH_ROUNDS", "2"))
RESULTS: dict[tuple[str, int], dict] = {}


def _prompts(batch):
    g = torch.Generator().manual_seed(batch)
    return torch.randint(100, 49000, (batch, PROMPT_LEN), generator=g)


@pytest.fixture(scope="module")
def models():
    from pdkernels import ops

    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=getattr(torch, DTYPE)
    )
    ops.set_backend("torch")  # the CPU path the engine serves with (the interpreter is for kernel tests)
    yield {
        "pdkernels": LLM(
            "smollm2-135m",
            dtype=DTYPE,
            num_pages=(max(BATCHES) * (PROMPT_LEN + NEW_TOKENS)) // 16 + 8,
            max_num_batched_tokens=max(BATCHES) * PROMPT_LEN,
            max_num_seqs=max(BATCHES),
        ),
        "transformers": hf,
    }
    ops.set_backend("auto")


class StepClock:
    """A generate() streamer that timestamps each step (its first put() is the prompt)."""

    def __init__(self):
        self.times = []

    def put(self, _):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_engine(llm, prompts):
    start = time.perf_counter()
    outs = llm.generate([p.tolist() for p in prompts], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    first = max(o.token_times[0] for o in outs)
    return first - start, max(o.token_times[-1] for o in outs) - first


def run_hf(model, prompts):
    clock = StepClock()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            prompts,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            streamer=clock,
        )
    return clock.times[1] - start, clock.times[-1] - clock.times[1]


@pytest.mark.benchmark(group="engine")
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("provider", ["pdkernels", "transformers"])
def test_generate(benchmark, models, provider, batch):
    model = models[provider]
    fn = run_engine if provider == "pdkernels" else run_hf
    prompts = _prompts(batch)
    fn(model, prompts[:1, :16])  # warm up
    runs = []
    benchmark.pedantic(lambda: runs.append(fn(model, prompts)), rounds=ROUNDS, iterations=1)
    prefill_s, decode_s = min(r[0] for r in runs), min(r[1] for r in runs)  # best of the rounds: VM noise
    figures = {
        "prefill_tok_s": batch * PROMPT_LEN / prefill_s,
        "decode_tok_s": batch * (NEW_TOKENS - 1) / decode_s,
    }
    benchmark.extra_info.update(figures)
    RESULTS[(provider, batch)] = figures


@pytest.mark.benchmark(group="engine-main-job")
@pytest.mark.parametrize("concurrency", [1, 20])
def test_main_job_workload(benchmark, tmp_path, concurrency, capsys):
    """The main job's workload, the one vLLM's CPU build is compared on: experiments.run with one colocated
    worker process of one thread, 20 requests of 128 random prompt tokens and 32 greedy output tokens, at
    this concurrency. Reports TTFT and TPOT p50 and output tokens/s as the run folder's summary has them."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from experiments.run import run

    overrides = ["model=smollm2-135m", f"model.dtype={DTYPE}", "deployment=colocated", "plots=false"]
    overrides += ["deployment.num_workers=1", "deployment.threads_per_worker=1", "workload.num_requests=20"]
    overrides += ["workload.arrival=concurrency", f"workload.concurrency={concurrency}"]
    conf = str(Path(__file__).resolve().parents[2] / "conf")
    with initialize_config_dir(config_dir=conf, version_base=None):
        cfg = compose("config", overrides=overrides)
    records = []
    benchmark.pedantic(lambda: records.append(run(cfg, tmp_path, progress=False)[0]), rounds=1, iterations=1)
    s = records[-1]["summary"]
    assert s["completed"] == 20, s
    figures = {
        "ttft_p50_ms": s["ttft_s"]["p50"] * 1e3,
        "tpot_p50_ms": s["tpot_s"]["p50"] * 1e3,
        "output_tok_s": s["output_tokens_per_s"],
    }
    benchmark.extra_info.update(figures)
    with capsys.disabled():
        shown = ", ".join(f"{k} {v:.1f}" for k, v in figures.items())
        print(f"\nmain job, concurrency {concurrency}: {shown}")


def test_summary(capsys):
    """Print the side-by-side table (after the runs above)."""
    if not RESULTS:
        pytest.skip("no engine benchmark ran")
    lines = [
        "",
        f"SmolLM2-135M, {DTYPE}, {PROMPT_LEN}-token prompts, {NEW_TOKENS} new tokens",
        "batch | prefill tok/s: pdkernels / transformers | decode tok/s: pdkernels / transformers",
    ]
    for b in BATCHES:
        ours, theirs = RESULTS.get(("pdkernels", b)), RESULTS.get(("transformers", b))
        if ours and theirs:
            lines.append(
                f"{b:5d} | {ours['prefill_tok_s']:10.0f} / {theirs['prefill_tok_s']:10.0f}"
                f"             | {ours['decode_tok_s']:8.1f} / {theirs['decode_tok_s']:8.1f}"
            )
    with capsys.disabled():
        print("\n".join(lines))
