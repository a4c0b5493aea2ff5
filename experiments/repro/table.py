"""`make repro`: every quantitative claim of the two seeds (the disaggregation blog and the PD survey), one
row each: the claim, its source, the seed's figure, ours, the error, how ours was obtained and under which
assumptions, and, where ours misses, why and which value of which assumption would reproduce it.

    python -m experiments.repro.table [--requests N] [--trace-requests N] [--no-measure] [--write PATH]

--write puts the table into PATH (docs/results/reproduction.md) between its markers, with the machine the
measured rows ran on. The rows' computations live beside their seed: experiments/repro/survey.py
(DistServe, its interference figure, OPT-175B), blog.py (DeepSeek-R1, Qwen3-Coder-480B), mooncake.py
(long context, the conversation trace); tests/experiments/repro/ asserts each row's value.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from experiments.bench.profile_cpu import machine
from experiments.repro import blog, mooncake, survey
from experiments.repro.claims import Claim, markdown

BEGIN, END = "<!-- repro table: begin -->", "<!-- repro table: end -->"
MEASURE_MODEL = "smollm2-135m"


def measured_claims(model: str = MEASURE_MODEL, threads: int = 1) -> list[Claim]:
    """The interference figure on the engine, on this machine."""
    m = machine()
    isa = (
        ", ".join(f for f in m["isa"] if f.startswith("amx") or f == "avx512_bf16")
        or "no AMX, no AVX-512 BF16"
    )
    ratios = survey.measure_interference(model, threads=threads)
    return [
        Claim(
            f"interference-{n}-cpu",
            f"the same, on the engine: a decode step with one {n:,}-token prompt batched in",
            survey.SOURCE + ", Fig. 2",
            survey.INTERFERENCE[n],
            "x",
            ratio,
            f"measured on this CPU ({m['cpu']}; {isa}), {threads} thread",
            f"{model} bf16, the engine's torch kernels, a decode batch of {survey.BATCH}; medians of 5 steps "
            f"each; the prompt's tokens as the figure's (not scaled: a 135M model on a CPU core is "
            f"compute-bound at far fewer tokens than a 13B model on an A100)",
        )
        for n, ratio in ratios.items()
    ]


def all_claims(n: int, trace_n: int, measure: bool) -> list[Claim]:
    sections = [
        ("survey", lambda: survey.claims(n)),
        ("measured", measured_claims if measure else list),
        ("blog", lambda: blog.claims(n)),
        ("mooncake", lambda: [mooncake.long_context_claim(min(n, 300)), mooncake.trace_claim(trace_n)]),
    ]
    out = []
    for name, make in sections:
        t = time.perf_counter()
        out += make()
        print(f"  {name}: {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return out


def write(path: Path, table: str, header: str) -> None:
    """Replace what lies between the markers in path with the header and the table."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: needs the lines {BEGIN!r} and {END!r} around the table")
    head, rest = text.split(BEGIN, 1)
    path.write_text(f"{head}{BEGIN}\n{header}\n\n{table}\n{END}{rest.split(END, 1)[1]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=1000, help="requests a simulated point (at least 100)")
    p.add_argument(
        "--trace-requests", type=int, default=1000, help="the conversation trace's first N (>= 100)"
    )
    p.add_argument("--no-measure", action="store_true", help="skip the rows measured on the engine here")
    p.add_argument("--write", type=Path, help="put the table into this markdown file, between its markers")
    args = p.parse_args(argv)
    if args.requests < 100 or args.trace_requests < 100:
        p.error(f"--requests and --trace-requests must be >= 100, got {args.requests}, {args.trace_requests}")
    try:
        mooncake.trace_path(args.trace_requests)
    except ValueError as e:
        p.error(str(e))
    if args.write is not None and not args.write.is_file():
        p.error(f"--write must be an existing markdown file, got {args.write}")
    t = time.perf_counter()
    claims = all_claims(args.requests, args.trace_requests, not args.no_measure)
    table = markdown(claims)
    done = sum(c.reproduced for c in claims if not c.fitted)
    checked = sum(not c.fitted for c in claims)
    took, cpu, day = time.perf_counter() - t, machine()["cpu"], time.strftime("%Y-%m-%d")
    header = (
        f"`python -m experiments.repro.table --requests {args.requests} --trace-requests "
        f"{args.trace_requests}` ({took:.0f} s on {cpu}, {day}): {done} of {checked} checked claims "
        f"reproduced within 20% or on the right side of a bound, {len(claims) - checked} rows fitted"
    )
    print(header + "\n\n" + table)
    if args.write is not None:
        write(args.write, table, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
