"""Greedy texts of runs of the main job against one deployment's: for each deployment in the runs'
results.json files, how many tokens each request keeps before its first difference from the reference
deployment's same request, how many of them match, and how many texts are identical (requests are the
workload's, by id: the runs must share the workload's settings and seed).

    python scripts/compare_outputs.py RUN_DIR [RUN_DIR ...] --against bf16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.bench.fp8_kv_error import _compare, agreement_table  # noqa: E402


def outputs(run_dirs: list[str]) -> dict[str, dict[str, list[int]]]:
    """Deployment (its run folder's name beside it where two runs share one) -> request id -> its tokens."""
    found = {}
    for folder in run_dirs:
        for run in json.loads((Path(folder) / "results.json").read_text())["runs"]:
            name = run["deployment"]
            name = f"{name} ({Path(folder).name})" if name in found else name
            found[name] = {r["request_id"]: r["output_ids"] for r in run["requests"] if not r.get("error")}
    return found


def compare(found: dict[str, dict[str, list[int]]], against: str) -> dict[str, dict]:
    if against not in found:
        raise SystemExit(f"--against {against!r}: no such deployment; the runs have {sorted(found)}")
    reference, rows = found[against], {}
    for name, got in found.items():
        ids = sorted(set(got) & set(reference))
        pairs = [(reference[i], got[i]) for i in ids if len(reference[i]) == len(got[i])]
        if len(pairs) < len(ids) or not ids:
            raise SystemExit(f"{name}: its requests' lengths differ from {against}'s (set ignore_eos)")
        rows[name] = _compare(*zip(*pairs, strict=True), len(pairs[0][0]))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (each with its results.json)")
    parser.add_argument("--against", required=True, help="the reference deployment's name")
    a = parser.parse_args(argv)
    rows = compare(outputs(a.runs), a.against)
    new_tokens = len(next(iter(outputs(a.runs)[a.against].values())))
    print(agreement_table(rows, new_tokens).replace("KV stored as", "deployment"))


if __name__ == "__main__":
    main()
