"""What the main job's end-to-end tests share: the hydra config of a small tiny-random run."""

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

CONF = str(Path(__file__).resolve().parents[2] / "conf")
TINY = [
    "model=tiny-random",
    "workload.num_requests=6",
    "workload.arrival=concurrency",
    "workload.concurrency=3",
]
TINY += ["workload.prompt_len.kind=uniform", "workload.prompt_len.low=2", "workload.prompt_len.high=40"]
# bounds only a broken run reaches (beside busy loops on both cores three workers took over 120 s to start)
TINY += ["workload.output_len.value=8", "plots=false", "start_timeout_s=600", "run_timeout_s=600"]


def _cfg(overrides):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose("config", overrides=overrides)


def _outputs(record):
    return {r["request_id"]: r["output_ids"] for r in record["requests"]}


def _cli(args, cwd):
    env = dict(os.environ, PYTHONPATH=str(Path(CONF).parent))
    return subprocess.run(
        [sys.executable, "-m", "experiments.run", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=600,
    )


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has exited; init reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(pid: int) -> list[int]:
    """The pids of pid's children, theirs, and so on (as ps lists them now)."""
    rows = [
        line.split()
        for line in subprocess.run(
            ["ps", "-eo", "ppid,pid"], capture_output=True, text=True
        ).stdout.splitlines()[1:]
    ]
    out, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [int(p) for pp, p in rows if int(pp) == parent]
        out += kids
        frontier += kids
    return out


def skip_without_ebpf() -> None:
    """cluster.link.loss_pct needs eBPF traffic-control programs (bpf(2), cls_bpf, a bpf filesystem to
    mount): skipped, saying why, on a machine that refuses them."""
    import pytest

    from serving.fleet.netns import Hosts, Link

    try:
        Hosts(1, Link("100mbit", loss_pct=1), subnet=63).close()
    except RuntimeError as e:
        if "bpf" not in str(e).lower():
            raise
        pytest.skip(f"this machine runs no eBPF classifier: {e}")
