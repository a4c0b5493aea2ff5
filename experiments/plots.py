"""The run folder's plots (matplotlib, no display): latency CDFs, latency against rate, a worker timeline."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments.metrics import label  # noqa: E402


def latency_cdfs(records: list[dict], slo: dict, path: Path) -> None:
    """TTFT and TPOT CDFs, one line per run, its p50 and p90 marked (o, ^), the SLO dashed."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, name in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        for rec in records:
            vals = np.sort([r[key] for r in rec["requests"] if r[key] is not None])
            if not len(vals):
                continue
            line = ax.step(
                1e3 * vals, np.arange(1, len(vals) + 1) / len(vals), where="post", label=label(rec)
            )[0]
            for q, marker in ((0.5, "o"), (0.9, "^")):
                ax.plot(1e3 * np.percentile(vals, 100 * q), q, marker, color=line.get_color(), ms=6)
        ax.axvline(1e3 * slo[key], color="k", linestyle="--", linewidth=1, label="SLO")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF (o p50, ^ p90)")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def latency_vs_rate(records: list[dict], slo: dict, path: Path) -> None:
    """P90 TTFT and TPOT against the Poisson rate, one line per deployment, with the SLO lines."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for dep in sorted({r["deployment"] for r in records}):
        runs = sorted(
            (r for r in records if r["deployment"] == dep and r["rate"] is not None), key=lambda r: r["rate"]
        )
        for ax, key in ((axes[0], "ttft_s"), (axes[1], "tpot_s")):
            pts = [
                (r["rate"], r["summary"][key]["p90"]) for r in runs if r["summary"][key]["p90"] is not None
            ]
            if pts:
                ax.plot([p[0] for p in pts], [1e3 * p[1] for p in pts], marker="o", label=dep)
    for ax, key, name in ((axes[0], "ttft_s", "P90 TTFT"), (axes[1], "tpot_s", "P90 TPOT")):
        ax.axhline(1e3 * slo[key], color="k", linestyle="--", linewidth=1, label="SLO")
        ax.set_xlabel("rate (req/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def timeline(record: dict, path: Path, max_workers: int = 8) -> None:
    """Every worker's forward passes over time (the first max_workers), coloured by what each step
    computed: decode only blue, prefill only red, prefill and decode together orange (those decodes waited
    for the prompt's chunk: a colocated worker's interference), decode steps that verified speculative
    drafts green; KV loaded from below the device (kv_tiers) a thin bar under them, by tier; below, the
    prefill tokens of each step per worker, so a decode worker that recomputes
    prompts (thrashing) shows at a glance. Legends sit outside the bars."""
    picks = record["timelines"][:max_workers]
    if not picks:
        return
    fig, (ax, tokens) = plt.subplots(
        2, 1, figsize=(10, 2.5 + 0.6 * len(picks)), sharex=True, height_ratios=[0.6 * len(picks) + 0.4, 2]
    )
    labelled: set[str] = set()

    def once(name: str) -> str | None:
        new = name not in labelled
        labelled.add(name)
        return name if new else None

    for row, t in enumerate(picks):
        steps = [(s, e, p, d, rest[0] if rest else 0) for s, e, p, d, *rest in t["steps"]]
        kinds = (  # prefill last: drawn over the decode steps around it
            ("decode only", "tab:blue", [(s, e - s) for s, e, p, d, v in steps if p == 0 and not v]),
            ("verify (speculation)", "tab:green", [(s, e - s) for s, e, p, d, v in steps if p == 0 and v]),
            ("prefill only", "tab:red", [(s, e - s) for s, e, p, d, v in steps if p > 0 and not d]),
            ("prefill + decode", "tab:orange", [(s, e - s) for s, e, p, d, v in steps if p > 0 and d]),
        )
        for name, color, bars in kinds:
            if bars:
                ax.broken_barh(bars, (row - 0.35, 0.7), color=color, label=once(name))
        for tier, color in (("host", "tab:purple"), ("disk", "tab:brown"), ("pool", "tab:cyan")):
            loads = [(s, max(e - s, 1e-3)) for s, e, which, _ in t.get("loads", ()) if which == tier]
            if loads:  # KV loaded from below the device: a thin bar under the steps
                ax.broken_barh(loads, (row - 0.48, 0.12), color=color, label=once(f"load from {tier}"))
        prefill = [(s, p) for s, _, p, *_ in steps if p > 0]
        tokens.plot([s for s, _ in prefill], [p for _, p in prefill], ".", ms=4, label=t["name"])
    ax.set_yticks(range(len(picks)), [t["name"] for t in picks])
    ax.set_title(f"forward passes: {record['deployment']}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    tokens.set_ylabel("prefill tokens in a step")
    tokens.set_ylim(bottom=0)
    tokens.set_xlabel("seconds since the run started")
    tokens.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the legends outside
    plt.close(fig)


def all_plots(records: list[dict], slo: dict, out_dir: Path) -> dict[Path, str]:
    """Draw the run's plots; each path with what to look for in it."""
    paths = {out_dir / "latency_cdf.png": "TTFT and TPOT per request against the SLO (p50 o, p90 ^)"}
    latency_cdfs(records, slo, next(iter(paths)))
    if len({r["rate"] for r in records if r["rate"] is not None}) > 1:
        path = out_dir / "latency_vs_rate.png"
        latency_vs_rate(records, slo, path)
        paths[path] = "p90 TTFT and TPOT as the rate grows: where each deployment leaves the SLO"
    for rec in records:
        if any(t["steps"] for t in rec["timelines"]):  # a simulated run's have none
            p = out_dir / f"timeline-{label(rec).replace(' @', '-').replace('/s', '').replace(' ', '-')}.png"
            timeline(rec, p)
            paths[p] = "each worker's steps: orange ones are decodes that waited for a prompt's chunk"
    return paths
