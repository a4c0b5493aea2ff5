"""Where a decode step goes on this machine: step times at batch 1 and 20, and (--profile) the time per
part of the model under torch.profiler (which adds its own cost). What docs/results/engine-cpu.md quotes.

    python scripts/profile_decode.py [--threads N] [--dtype bfloat16|float32] [--profile]
    python scripts/profile_decode.py --long-prompt 1024 [--chunk 2048]    # also one long prompt's prefill
"""

import argparse
import functools
import time

import torch


def _steps(llm, prompts, params):
    for p in prompts:
        llm.add_request(p, params)
    times = []
    while llm.has_unfinished():
        start = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - start)
    return times


def _median_ms(xs):
    return sorted(xs)[len(xs) // 2] * 1e3


_LABELLED = []


def _label_parts():
    """Each op of pdkernels.ops and each part of engine.model.Model in its own profiler range (once)."""
    from torch.profiler import record_function

    import engine.model as em
    from pdkernels import ops

    if _LABELLED:
        return

    def label(owner, name):
        f = getattr(owner, name)

        @functools.wraps(f)
        def labelled(*a, **k):
            with record_function(f"## {name}"):
                return f(*a, **k)

        setattr(owner, name, labelled)

    for name in ("kv_append", "decode_attention", "extend_attention", "linear", "out_proj", "add_rms_norm"):
        label(ops, name)
    for name in ("forward", "attention", "mlp", "rope", "logits"):
        label(em.Model, name)
    _LABELLED.append(True)


def _print_parts(prof, runs: int, unit: str) -> None:
    rows = sorted(
        (e for e in prof.key_averages() if e.key.startswith("## ")), key=lambda e: -e.cpu_time_total
    )
    for e in rows:
        print(f"  {e.key[3:]:18s} {e.cpu_time_total / runs / 1e3:7.2f} ms/{unit}  ({e.count // runs} calls)")


def _parts(llm, prompts, params, steps=10):
    """ms per step in each op of pdkernels.ops and each part of engine.model.Model, batch len(prompts)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    _label_parts()
    for p in prompts:
        llm.add_request(p, params)
    while any(s.num_computed < len(s.prompt_ids) for s in llm.scheduler.running) or llm.scheduler.waiting:
        llm.step()  # prefill done: only decode steps are profiled
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("## step"):
                llm.step()
    _print_parts(prof, steps, "step")
    while llm.has_unfinished():
        llm.step()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--profile", action="store_true", help="also the time per part, under torch.profiler")
    ap.add_argument("--long-prompt", type=int, default=0, help="also time the prefill of a prompt this long")
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens for --long-prompt")
    args = ap.parse_args()
    if args.long_prompt < 0 or args.chunk < 1:
        ap.error(f"--long-prompt must be >= 0 and --chunk >= 1, got {args.long_prompt} and {args.chunk}")
    torch.set_num_threads(args.threads)
    from engine import LLM, SamplingParams

    llm = LLM("smollm2-135m", dtype=args.dtype, page_size=16, num_pages=512, max_num_seqs=64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (128,), generator=g).tolist() for _ in range(21)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    _steps(llm, prompts[20:], params)  # warm up on a prompt of its own: a repeated one hits the prefix cache
    one = _steps(llm, prompts[:1], params)
    twenty = _steps(llm, prompts, params)
    print(f"{args.dtype}, {args.threads} thread(s), 128-token prompts, 32 tokens each:")
    print(f"  batch 1: prefill step {one[0] * 1e3:.1f} ms, decode step median {_median_ms(one[1:]):.1f} ms")
    print(f"  batch 20: step median {_median_ms(twenty[2:]):.1f} ms over {len(twenty)} steps")
    if args.long_prompt:  # prefix caching off: every run computes the whole prompt
        long = LLM("smollm2-135m", dtype=args.dtype, num_pages=512, max_num_batched_tokens=args.chunk,
                   enable_prefix_caching=False)  # fmt: skip
        prompt, first = (
            list(range(1000, 1000 + args.long_prompt)),
            SamplingParams(max_tokens=1, ignore_eos=True),
        )
        times = []
        for _ in range(4):  # the first warms up
            start = time.perf_counter()
            long.generate([prompt], first)
            times.append(time.perf_counter() - start)
        each = ", ".join(f"{t * 1e3:.0f}" for t in times[1:])
        print(f"  a {args.long_prompt}-token prompt in chunks of {args.chunk}: prefill median "
              f"{_median_ms(times[1:]):.0f} ms ({each})")  # fmt: skip
    if args.profile and args.long_prompt:
        from torch.profiler import ProfilerActivity, profile, record_function

        _label_parts()
        print(f"the {args.long_prompt}-token prefill, under torch.profiler:")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("## prefill"):
                long.generate([prompt], first)
        _print_parts(prof, 1, "prefill")
    if args.profile:
        for batch in (1, 20):
            print(f"batch {batch}, under torch.profiler:")
            _parts(llm, prompts[:batch], params)


if __name__ == "__main__":
    main()
