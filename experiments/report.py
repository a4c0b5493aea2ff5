"""What a run prints at its end (measured or simulated): the deployments' side-by-side table, the goodput
over a rate sweep, and report(), which also writes results.json (experiments/metrics.py) and the plots.
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments.config import RunConfig
from experiments.metrics import SWEEP, goodput, label, swept_goodput, write_results


def _ms(stats: dict, key: str) -> str:
    v = stats.get(key)
    return "-" if v is None else f"{1e3 * v:.0f}"


def table(records: list[dict]) -> str:
    """The side-by-side summary printed at the end of a run (times in ms)."""
    cols = [label(r) for r in records]
    s = [r["summary"] for r in records]
    swept = swept_goodput(records)
    lines = [
        ("requests (ok/all)", [f"{x['completed']}/{x['num_requests']}" for x in s]),
        *(
            [("rejected (admission)", [str(x.get("rejected", 0)) for x in s])]
            if any(x.get("rejected") for x in s)
            else []
        ),
        (
            "TTFT p50 / p90 / p99 ms",
            [f"{_ms(x['ttft_s'], 'p50')} / {_ms(x['ttft_s'], 'p90')} / {_ms(x['ttft_s'], 'p99')}" for x in s],
        ),
        (
            "TPOT p50 / p90 / p99 ms",
            [f"{_ms(x['tpot_s'], 'p50')} / {_ms(x['tpot_s'], 'p90')} / {_ms(x['tpot_s'], 'p99')}" for x in s],
        ),
        ("ITL p50 / p99 ms", [f"{_ms(x['itl_s'], 'p50')} / {_ms(x['itl_s'], 'p99')}" for x in s]),
        ("E2E p50 / p90 ms", [f"{_ms(x['e2e_s'], 'p50')} / {_ms(x['e2e_s'], 'p90')}" for x in s]),
        ("queue p50 ms", [_ms(x["queue_s"], "p50") for x in s]),
        ("transfer p50 ms", [_ms(x["transfer_s"], "p50") for x in s]),
        (
            "KV landed after prefill p50 / p90 ms",
            [f"{_ms(x.get('kv_exposed_s', {}), 'p50')} / {_ms(x.get('kv_exposed_s', {}), 'p90')}" for x in s],
        ),
        ("KV moved MiB", [f"{x['transfer_bytes'] / 2**20:.1f}" for x in s]),
        *(
            [("prefilled on decode by load", [str(x.get("local_prefills_by_load", 0)) for x in s])]
            if any(x.get("local_prefills_by_load") for x in s)
            else []
        ),
        ("prefix cache hit %", [_pct(x.get("prefix_hit_rate")) for x in s]),
        *(
            [("tier hit tokens host/disk/pool", [_tier_hits(x.get("kv_tiers") or {}) for x in s])]
            if any(x.get("kv_tiers") for x in s)
            else []
        ),
        ("throughput req/s", [f"{x['throughput_rps']:.2f}" for x in s]),
        ("output tok/s", [f"{x['output_tokens_per_s']:.1f}" for x in s]),
        ("SLO attainment %", [f"{x['attainment_pct']:.0f}" for x in s]),
        ("request goodput (met SLO) req/s", [f"{x['slo_goodput_rps']:.2f}" for x in s]),
        (
            "goodput (top rate meeting SLO)",
            [f"{swept[r['deployment']]:g} req/s" if r["deployment"] in swept else SWEEP for r in records],
        ),
    ]
    w0 = max(len(k) for k, _ in lines)
    widths = [max(len(c), *(len(v[i]) for _, v in lines)) for i, c in enumerate(cols)]
    out = [" | ".join([" " * w0] + [c.rjust(w) for c, w in zip(cols, widths, strict=True)])]
    out.append("-+-".join(["-" * w0] + ["-" * w for w in widths]))
    out += [
        " | ".join([k.ljust(w0)] + [x.rjust(w) for x, w in zip(v, widths, strict=True)]) for k, v in lines
    ]
    return "\n".join(out)


def _tier_hits(tiers: dict) -> str:
    return "/".join(str(tiers[t]["hit_tokens"]) if t in tiers else "-" for t in ("host", "disk", "pool"))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}"


def report(
    out_dir: Path, config: RunConfig, records: list[dict], heading: str = "", sweep: bool = False
) -> Path:
    """The end of a run, measured or simulated: results.json and the CSVs, the side-by-side table after
    `heading` (and the goodput line over a rate sweep), the plots, where it all went."""
    path = write_results(out_dir, config, records)
    print(heading)
    print(table(records))
    if sweep:
        print("goodput (req/s):", json.dumps(goodput(records)))
    if config.plots:
        from experiments import plots  # matplotlib: over a second to import, only where it draws

        drawn = plots.all_plots(records, records[0]["summary"]["slo"], out_dir)
        print("\nplots:")
        for plot, what in drawn.items():
            print(f"  {plot.name}: {what}")
    print(f"\nrun folder: {out_dir} ({path.name}, CSVs, plots)")
    return path
