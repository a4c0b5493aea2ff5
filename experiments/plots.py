"""The run folder's plots (matplotlib, no display): latency CDFs, latency against rate, a worker timeline."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _label(rec: dict) -> str:
    return rec["deployment"] + (f" @{rec['rate']:g}/s" if rec["rate"] is not None else "")


def latency_cdfs(records: list[dict], slo: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, name in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        for rec in records:
            vals = np.sort([r[key] for r in rec["requests"] if r[key] is not None])
            if len(vals):
                ax.step(1e3 * vals, np.arange(1, len(vals) + 1) / len(vals), where="post", label=_label(rec))
        ax.axvline(1e3 * slo[key], color="k", linestyle="--", linewidth=1, label="SLO")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF")
        ax.legend()
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


def timeline(record: dict, path: Path) -> None:
    """Forward passes over time of one worker per role: with prefill tokens red, decode only blue,
    decode steps that verified speculative drafts green."""
    picks, seen = [], set()
    for t in record["timelines"]:
        if t["role"] not in seen:
            picks.append(t)
            seen.add(t["role"])
    if not picks:
        return
    fig, ax = plt.subplots(figsize=(10, 1 + 0.6 * len(picks)))
    for row, t in enumerate(picks):
        steps = [(s, e, p, d, rest[0] if rest else 0) for s, e, p, d, *rest in t["steps"]]
        prefill = [(s, e - s) for s, e, p, d, v in steps if p > 0]
        decode = [(s, e - s) for s, e, p, d, v in steps if p == 0 and not v]
        verify = [(s, e - s) for s, e, p, d, v in steps if p == 0 and v]
        ax.broken_barh(
            prefill, (row - 0.35, 0.7), color="tab:red", label="prefill tokens" if row == 0 else None
        )
        ax.broken_barh(decode, (row - 0.35, 0.7), color="tab:blue", label="decode only" if row == 0 else None)
        if verify:
            first = not any(h.get_label() == "verify (speculation)" for h in ax.collections)
            label = "verify (speculation)" if first else None
            ax.broken_barh(verify, (row - 0.35, 0.7), color="tab:green", label=label)
    ax.set_yticks(range(len(picks)), [t["name"] for t in picks])
    ax.set_xlabel("seconds since the run started")
    ax.set_title(f"forward passes: {record['deployment']}")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def all_plots(records: list[dict], slo: dict, out_dir: Path) -> list[Path]:
    paths = [out_dir / "latency_cdf.png"]
    latency_cdfs(records, slo, paths[0])
    if len({r["rate"] for r in records if r["rate"] is not None}) > 1:
        paths.append(out_dir / "latency_vs_rate.png")
        latency_vs_rate(records, slo, paths[-1])
    for rec in records:
        if rec["timelines"]:
            p = out_dir / f"timeline-{_label(rec).replace(' @', '-').replace('/s', '')}.png"
            timeline(rec, p)
            paths.append(p)
    return paths
