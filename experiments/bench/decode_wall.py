"""Paged decode attention at long context against this machine's memory wall: how much of a streaming read's
bandwidth the CPU extension's decode attention (pdkernels/csrc/decode_cpu.cpp) reaches when the KV, not the
weights, is what a decode step reads.

    python -m experiments.bench.decode_wall [--threads 1] [--cases 8x4096,32x4096,8x8192]
        [--dtypes float32,bfloat16] [--against REV] [--rounds 5]

SmolLM2's heads (9 query over 3 kv, 64 wide), pages of 16 tokens in shuffled order (as a pool hands them out
after a while). Each round measures the streaming read (experiments.sim.hardware's: a sum over 256 MB) and
then every case, best of several calls; the table gives each case's median over the rounds, its KV bytes
over that time, and that as a share of the median read. With --against REV, the extension as it was at git
revision REV is built beside this checkout's (its csrc files, from `git show`) and each case is timed with
both in the same round, one after the other: a before/after pair that this VM's drift (its read bandwidth
moved 11-18 GB/s within an hour) does not decide. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADS, KV_HEADS, DIM, PAGE = 9, 3, 64, 16


def build_at(rev: str):
    """The CPU extension as its sources were at git revision rev, built under a name of its own."""
    from torch.utils.cpp_extension import load

    from pdkernels.cpu import SOURCES

    folder = Path(tempfile.mkdtemp(prefix="pdk-csrc-"))
    csrc = (ROOT / "pdkernels" / "csrc").relative_to(ROOT)
    headers = [p.name for p in (ROOT / csrc).glob("*.h")]
    for name, needed in [(p.name, True) for p in SOURCES] + [(h, False) for h in headers]:
        shown = subprocess.run(
            ["git", "show", f"{rev}:{csrc / name}"], cwd=ROOT, capture_output=True, text=True
        )
        if shown.returncode == 0:
            (folder / name).write_text(shown.stdout)
        elif needed:  # a header the revision lacks: its sources did not include it
            raise SystemExit(
                f"--against {rev}: {csrc / name} is not in that revision ({shown.stderr.strip()})"
            )
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True)
    return load(
        name=f"pdk_decode_wall_{sha.stdout.strip() or 'rev'}",
        sources=[str(folder / p.name) for p in SOURCES],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )


def measure(cases: list[tuple[int, int]], dtypes: list[str], threads: int, rounds: int, against: str | None):
    """(read bytes/s median, rows): each row (dtype, batch, tokens, kv bytes, {build: median seconds})."""
    import torch

    from experiments.sim.hardware import best_time
    from pdkernels import cpu
    from pdkernels.testing import make_paged_cache

    torch.set_num_threads(threads)
    builds = {"now": cpu.module()}
    if builds["now"] is None:
        raise SystemExit("pdkernels' CPU extension could not be built here: nothing to measure")
    if against is not None:
        builds = {against: build_at(against), **builds}
    inputs = []
    for dtype in dtypes:
        for batch, tokens in cases:
            case = make_paged_cache([tokens] * batch, KV_HEADS, DIM, PAGE, "HND", dtype=getattr(torch, dtype))
            q = torch.randn(batch, HEADS, DIM)
            table = (case.kv_indptr, case.kv_indices, case.kv_last_page_len)
            nbytes = case.cache[0].numel() * case.cache.element_size() * int(case.kv_indices.numel())
            inputs.append(((dtype, batch, tokens, nbytes), (q, case.cache, *table, DIM**-0.5)))
    times = {(key, name): [] for key, _ in inputs for name in builds}
    reads = []
    z = torch.ones(64 << 20)
    for _ in range(rounds):
        reads.append(z.numel() * 4 / best_time(lambda: z.sum(), "cpu"))
        for key, args in inputs:
            for name, ext in builds.items():
                times[(key, name)].append(
                    best_time(lambda ext=ext, args=args: ext.decode_attention(*args), "cpu")
                )
    rows = [(*key, {name: statistics.median(times[(key, name)]) for name in builds}) for key, _ in inputs]
    return statistics.median(reads), min(reads), max(reads), rows


def table(read: float, rows: list, names: list[str]) -> str:
    head = (
        "| KV dtype | batch x tokens | " + " | ".join(f"{n} ms | {n} GB/s (% of read)" for n in names) + " |"
    )
    lines = [head, "| --- | --- |" + " ---: | ---: |" * len(names)]
    for dtype, batch, tokens, nbytes, t in rows:
        cells = " | ".join(
            f"{t[n] * 1e3:.2f} | {nbytes / t[n] / 1e9:.1f} ({nbytes / t[n] / read:.0%})" for n in names
        )
        lines.append(f"| {dtype} | {batch} x {tokens:,} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--cases", default="8x4096,32x4096,8x8192", help="batch x tokens of KV, comma-separated"
    )
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--against", default=None, help="a git revision to build and time beside this one")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    try:
        cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
        if any(len(c) != 2 or min(c) < 1 for c in cases):
            raise ValueError
    except ValueError:
        raise SystemExit(
            f"--cases must be BATCHxTOKENS pairs of positive integers, got {args.cases!r}"
        ) from None
    dtypes = args.dtypes.split(",")
    if not set(dtypes) <= {"float32", "bfloat16", "float16"} or args.threads < 1 or args.rounds < 1:
        raise SystemExit("--dtypes must be float32, bfloat16 or float16; --threads and --rounds at least 1")
    from experiments.sim.hardware import cpu_model
    from pdkernels.cpuinfo import isa

    read, low, high, rows = measure(cases, dtypes, args.threads, args.rounds, args.against)
    names = [args.against, "now"] if args.against else ["now"]
    print(f"{cpu_model()} ({isa()}), {args.threads} thread(s); streaming read {read / 1e9:.1f} GB/s "
          f"(median of {args.rounds} rounds; {low / 1e9:.1f}-{high / 1e9:.1f})")  # fmt: skip
    print(table(read, rows, names))


if __name__ == "__main__":
    main()
