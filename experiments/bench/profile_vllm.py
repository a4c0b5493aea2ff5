"""vLLM's CPU engine under the same profile as ours: run by profile_cpu under vLLM's own Python.

    <vllm venv>/bin/python experiments/bench/profile_vllm.py --model HF_DIR [--prompt 1024]
        [--batches 1,20] [--threads 1] [--steps 8] --out FILE

It imports only torch and vLLM (it runs in vLLM's virtual environment, not ours) and writes one JSON object
to FILE (vLLM logs to stdout): for each phase its wall seconds (profiled, and unprofiled: the median of
three more runs), how many steps it covers and each op's self CPU time and calls, which
`experiments.bench.profile_cpu --peer-python` sorts into the same kinds as ours. The phases are ours: one
prefill of a `prompt`-token prompt (prefix caching off: one engine step), then `steps` decode steps at
each batch size once every request of that batch is past its prompt. vLLM's engine core runs in this
process (VLLM_ENABLE_V1_MULTIPROCESSING=0, no async scheduling), so torch.profiler sees every op of its
step, its `_C::` kernels included. vLLM binds its OpenMP threads only in worker processes it spawns, so
here the thread count and the cores are set before torch loads.
"""

from __future__ import annotations

import argparse
import json
import os

from profile_cpu import measure  # this script's sibling (stdlib and torch only): the same measurement


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face folder (scripts/export_hf.py writes one)")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--batches", default="1,20")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", help="ours' dtype (fp32 on a CPU without bf16)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM binds its OpenMP threads only in the worker processes it spawns: in this one the threads are
    # set here, before torch starts (vLLM's worker refuses torch.set_num_threads), on the first cores
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.sched_setaffinity(0, range(args.threads))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch
    from vllm import EngineArgs, LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, dtype=args.dtype, max_model_len=max(2048, args.prompt + args.steps + 64),
        enable_prefix_caching=False, max_num_batched_tokens=max(args.prompt, 2048),
        max_num_seqs=max(batches), async_scheduling=False, gpu_memory_utilization=0.2,
    ))  # fmt: skip
    assert torch.get_num_threads() == args.threads, torch.get_num_threads()
    counter = iter(range(1 << 30))

    def add(tokens: list, max_tokens: int) -> str:
        rid = f"r{next(counter)}"
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        engine.add_request(rid, {"prompt_token_ids": tokens}, params)
        return rid

    def drain():
        while engine.has_unfinished_requests():
            engine.step()

    def timed(run, repeats: int) -> dict:
        return {**measure(run), "repeats": repeats}

    fresh = iter(range(1 << 30))

    def prefill():  # a prompt of its own each time (as ours: profile_cpu.prefill)
        i = next(fresh)
        add([100 + (i * 7 + t) % 1000 for t in range(args.prompt)], 1)
        drain()

    prefill()  # warm-up
    phases = {f"prefill {args.prompt}": timed(prefill, 1)}
    for batch in batches:
        for b in range(batch):
            add([200 + b + t for t in range(16)], 4 * args.steps + 16)
        engine.step()  # every 16-token prompt in one step (max_num_batched_tokens >= 16 x batch)
        for _ in range(2):
            engine.step()
        phases[f"decode batch {batch}"] = timed(
            lambda: [engine.step() for _ in range(args.steps)], args.steps
        )
        drain()
    import vllm

    with open(args.out, "w") as f:
        json.dump({"engine": f"vLLM {vllm.__version__}", "threads": args.threads, "phases": phases}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
