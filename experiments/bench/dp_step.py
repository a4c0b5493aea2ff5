"""The decode step of a DeepSeek-shaped model at data-parallel attention against tensor parallelism.

    python -m experiments.bench.dp_step [--model tiny-random-deepseek] [--ways 2] [--batches 1,4,16]
        [--kv 256] [--steps 10] [--dtype float32] [--one] [--out dp_step.json]

For each layout (TP `ways` x DP 1, TP 1 x DP `ways`, and with --one a single engine, TP 1 x DP 1: what
experiments.sim.dp_check calibrates on with the TP rows) and each batch size: one engine (engine.LLM) with
`batch` sequences of `kv`-token prompts (under DP spread evenly over the groups), then the median time of
`steps` decode steps (each ending when every group's sampled tokens are back), its tokens/s (batch / step
time), and the share of the step that the lead rank spent in the MoE layers' all-to-alls (DP; wall time
inside torch.distributed.all_to_all_single, waiting for slower ranks included). One process per rank,
one thread each (the lead's too): run it alone on a machine with a core per rank. Prints a Markdown
table and writes the rows as JSON, with this machine's measured peak, bandwidth and collective latencies
(the simulator's hardware: experiments.sim.hardware's measure on one thread and
measure_collectives between `ways` processes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


class A2ATimer:
    """Wall time inside torch.distributed.all_to_all_single in this process (engine/moe.py's calls)."""

    def __init__(self):
        from engine import moe

        self.total, self._dist = 0.0, moe.dist
        self._inner = moe.dist.all_to_all_single
        timer = self

        class Timed:  # moe.py reaches all_to_all_single through its module's `dist`
            def __getattr__(self, name):
                return getattr(timer._dist, name)

            @staticmethod
            def all_to_all_single(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return timer._inner(*args, **kwargs)
                finally:
                    timer.total += time.perf_counter() - start

        moe.dist = Timed()

    def close(self) -> None:
        from engine import moe

        moe.dist = self._dist


def measure(model: str, tp: int, dp: int, batch: int, kv: int, steps: int, dtype: str) -> dict:
    from engine import SamplingParams, make_llm

    page_size = 16
    per_group = -(-batch // dp)
    pages = per_group * -(-(kv + steps + 8) // page_size) + 8
    llm = make_llm(
        model,
        tp=tp,
        dp=dp,
        dtype=dtype,
        page_size=page_size,
        num_pages=pages,
        max_num_seqs=per_group,
        max_num_batched_tokens=max(kv, 512),
        reserved_tokens=None,
    )
    timer = A2ATimer() if dp > 1 else None
    try:
        params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
        ids = {llm.add_request([100 + (i + t) % 1000 for t in range(kv)], params) for i in range(batch)}
        started: set[str] = set()
        while started != ids:  # the prompts, until every sequence has its first token
            started |= {o.request_id for o in llm.step() if o.token_ids}
        llm.step()  # warm-up: one decode step
        times, a2a = [], []
        for _ in range(steps):
            before = timer.total if timer else 0.0
            start = time.perf_counter()
            llm.step()
            times.append(time.perf_counter() - start)
            a2a.append((timer.total - before) if timer else 0.0)
        step = statistics.median(times)
        return {
            "model": model,
            "dtype": dtype,
            "layout": f"TP {tp}" if dp == 1 else f"DP {dp}",
            "tp": tp,
            "dp": dp,
            "batch": batch,
            "kv": kv,
            "step_ms": round(1e3 * step, 2),
            "tokens_s": round(batch / step, 1),
            "a2a_share": round(statistics.median(a / t for a, t in zip(a2a, times, strict=True)), 3)
            if timer
            else None,
        }
    finally:
        if timer:
            timer.close()
        llm.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-random-deepseek")
    p.add_argument("--ways", type=int, default=2, help="ranks: TP ways x DP 1 against TP 1 x DP ways")
    p.add_argument("--batches", default="1,4,16", help="comma-separated batch sizes (all groups together)")
    p.add_argument("--kv", type=int, default=256, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--one", action="store_true", help="also one engine (TP 1 x DP 1)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches takes comma-separated integers, got {args.batches!r}")
    if min(args.ways, args.kv, args.steps, *batches) < 1:
        p.error("--ways, --kv, --steps and every batch must be >= 1")
    from dataclasses import asdict, replace

    import torch

    from engine.weights import load_model
    from experiments.sim.calibrate import measure_collectives
    from experiments.sim.hardware import measure

    hidden = load_model(args.model, weights=False).config.hidden_size
    allreduce_s, alltoall_s = measure_collectives(args.ways, hidden)
    hw = measure(1, dtype=args.dtype)  # sets one thread: one core per rank, the lead's too
    hardware = asdict(replace(hw, allreduce_s=allreduce_s, alltoall_s=alltoall_s))
    torch.set_num_threads(1)
    layouts = [(1, 1)] * args.one + [(args.ways, 1), (1, args.ways)]
    rows = []
    for batch in batches:
        for tp, dp in layouts:
            rows.append(measure(args.model, tp, dp, batch, args.kv, args.steps, args.dtype))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.model}, {args.dtype}, {args.kv}-token prompts, median of {args.steps} decode steps\n")
    print("| batch | layout | step ms | tokens/s | all-to-all share |\n| ---: | --- | ---: | ---: | ---: |")
    for r in rows:
        share = f"{100 * r['a2a_share']:.0f}%" if r["a2a_share"] is not None else "-"
        print(f"| {r['batch']} | {r['layout']} | {r['step_ms']:,} | {r['tokens_s']:,} | {share} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"hardware": hardware, "steps": args.steps, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
