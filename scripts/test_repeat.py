"""Run the test suite N times and count each test that failed, so that flakiness is measured, not guessed
(`make test-repeat N=3`, `BUSY=1` beside a busy loop on every core: the suite must not depend on being
alone on the machine either).

python scripts/test_repeat.py N [--busy] [--out DIR] [-- PYTEST_ARGS...]; each run writes DIR/run-<i>.xml
(JUnit) and DIR/run-<i>.log; the last lines printed are one per failing test with its count, then one line
per run (passed, failed, skipped, seconds). Exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

# what `make test` runs
DEFAULT_ARGS = ["-m", "not slow", "-q", "-n", "2", "--dist", "loadfile", "--max-worker-restart=0"]


def spin() -> None:
    """A busy loop: one core's worth of load until killed."""
    while True:
        pass


def outcomes(junit: Path) -> tuple[Counter, list[str]]:
    """(counts of passed, failed, skipped) and the failing tests' ids, from one run's JUnit XML."""
    counts, failing = Counter(), []
    if not junit.exists():
        return Counter(failed=1), ["(no report: pytest did not finish)"]
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            counts["failed"] += 1
            failing.append(name)
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, failing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("n", type=int, help="how many runs")
    parser.add_argument("--busy", action="store_true", help="a busy loop on every core beside each run")
    default_out = Path("bench_results") / time.strftime("repeat-%Y%m%d-%H%M%S")
    parser.add_argument("--out", type=Path, default=default_out, help="where each run's reports go")
    argv = sys.argv[1:] if argv is None else argv
    pytest_args = argv[argv.index("--") + 1 :] if "--" in argv else []  # default: make test's
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.n < 1:
        parser.error(f"N={args.n} is not allowed: an integer >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    pytest_args = pytest_args or DEFAULT_ARGS
    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(os.cpu_count() or 1)]
    for p in busy if args.busy else []:
        p.start()
    failures, runs = Counter(), []
    try:
        for i in range(1, args.n + 1):
            junit, log = args.out / f"run-{i}.xml", args.out / f"run-{i}.log"
            start = time.monotonic()
            with open(log, "w") as f:
                cmd = [sys.executable, "-m", "pytest", *pytest_args, f"--junitxml={junit}"]
                code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
            seconds = time.monotonic() - start
            counts, failing = outcomes(junit)
            if code != 0 and not failing:
                failing = [f"(pytest exited {code}: {log})"]
            failures.update(failing)
            runs.append((i, counts, len(failing), seconds))
            print(f"run {i}/{args.n}: {counts['passed']} passed, {len(failing)} failed, "
                  f"{counts['skipped']} skipped, {seconds:.0f} s", flush=True)  # fmt: skip
    finally:
        for p in busy:
            if p.is_alive():
                p.kill()
    from experiments.sim.hardware import cpu_model

    print(f"\n{cpu_model()}, {os.cpu_count()} cores{', a busy loop on each' if args.busy else ''}; "
          f"reports in {args.out}")  # fmt: skip
    for name, count in failures.most_common():
        print(f"failed {count} of {args.n}: {name}")
    if not failures:
        print(f"no test failed in {args.n} runs")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
