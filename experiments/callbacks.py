"""Hydra callbacks: after a -m sweep, goodput across its jobs (the highest rate that met the SLO)."""

from __future__ import annotations

import json
from pathlib import Path

from hydra.experimental.callback import Callback


class GoodputCallback(Callback):
    def on_multirun_end(self, config, **kwargs) -> None:
        from experiments import metrics, plots

        sweep_dir = Path(config.hydra.sweep.dir)
        records = []
        for path in sorted(sweep_dir.glob("*/results.json")):
            records += json.loads(path.read_text())["runs"]
        if not records:
            return
        found = metrics.goodput(records)
        (sweep_dir / "goodput.json").write_text(
            json.dumps({"goodput_rps": found, "runs": len(records)}, indent=1)
        )
        print(f"\nsweep over {len(records)} runs; goodput (req/s): {json.dumps(found)}  -> {sweep_dir}")
        plots.latency_vs_rate(records, records[0]["summary"]["slo"], sweep_dir / "latency_vs_rate.png")
