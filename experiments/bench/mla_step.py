"""One engine decode step of a DeepSeek-shaped model (latent attention + routed experts), per backend.

    python -m experiments.bench.mla_step [--model random-deepseek-v3] [--device cuda] [--batch 32]
        [--kv 1024] [--steps 10] [--out step.json]

Builds the model once, fills `batch` sequences with `kv`-token prompts, then times decode steps (the
median of `steps`, each ending when its sampled tokens are back on the host) with the attention ops on
each backend in turn: on CUDA our Triton kernels (the absorbed MLA decode, the latent append) and
FlashInfer's (BatchMLAPagedAttentionWrapper, append_paged_mla_kv_cache), the GEMMs and experts the same
in both; on a CPU the torch paths (to try the script). Prints and writes {backend: ms}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def time_steps(llm, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.step()  # returns its outputs: the sampled tokens are on the host
        times.append(1e3 * (time.perf_counter() - start))
    return times


def main(argv: list[str] | None = None) -> int:
    import torch

    from engine import LLM, SamplingParams
    from pdkernels import flashinfer_ops, ops

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random-deepseek-v3" if cuda else "tiny-random-deepseek")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--kv", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", type=Path)
    p.add_argument("--without-flashinfer", action="store_true", help="time our kernels only")
    args = p.parse_args(argv)
    if min(args.batch, args.kv, args.steps) < 1:
        p.error(f"--batch, --kv and --steps must be >= 1, got {args.batch}, {args.kv}, {args.steps}")
    backends = ["torch"] if args.device == "cpu" else ["triton"]
    if args.device != "cpu" and flashinfer_ops.available() and not args.without_flashinfer:
        backends.append("flashinfer")
    page_size = 16
    # one prompt fills a step (max_num_batched_tokens = kv), so the first sequence decodes a token a step
    # while the others' prompts run: up to batch tokens before the timed steps, then theirs and warm-ups
    decoded = args.batch + len(backends) * (args.steps + 2) + 1
    pages = args.batch * -(-(args.kv + decoded + 8) // page_size) + 8
    llm = LLM(
        args.model,
        device=args.device,
        dtype="bfloat16" if args.device != "cpu" else "float32",
        page_size=page_size,
        num_pages=pages,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(args.kv, 512),
        reserved_tokens=None,
    )
    params = SamplingParams(max_tokens=decoded, ignore_eos=True)
    ids = [llm.add_request([100 + (i + t) % 1000 for t in range(args.kv)], params) for i in range(args.batch)]
    waiting = set(ids)
    while waiting:  # the prompts, until each has its first token
        for out in llm.step():
            if out.error or out.finished:  # a failed step ends its requests: say why, not a KeyError later
                why = out.error or out.finish_reason
                raise SystemExit(f"mla_step: {out.request_id} ended before decoding: {why}")
            if out.token_ids:
                waiting.discard(out.request_id)
    ms = {}
    for backend in backends:
        ops.set_backend(backend)
        time_steps(llm, 2)  # warm-up (compiles, plans)
        ms[backend] = statistics.median(time_steps(llm, args.steps))
    ops.set_backend("auto")
    result = {"model": args.model, "device": args.device, "batch": args.batch, "kv": args.kv, "ms": ms}
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
