"""Nothing outlives what started it (serving/fleet/procs.py die_with, the fork server's preload, the
netns watcher): a process that dies with its owner takes what runs below it, and a SIGKILL of the main
job or of the server (launcher=local and netns) leaves none of their processes or namespaces behind."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from serving.fleet import netns
from serving.fleet.procs import descendants

ROOT = Path(__file__).resolve().parents[3]
GONE_WITHIN_S = 120  # a bound only a process that never ends reaches; the note gives the times measured


def _state(pid: int) -> str | None:
    """/proc's state letter of pid; None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _alive(procs: list[tuple[int, str]]) -> list[int]:
    """Those of (pid, start time) still running (a zombie is not: it waits only for init to reap it)."""
    out = []
    for pid, start in procs:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[19] == start and fields[0] != "Z":
            out.append(pid)
    return out


def _until_gone(procs: list[tuple[int, str]], names: list[str] = ()) -> float:
    """Seconds until none of procs runs and none of the namespaces names exists."""
    t0 = time.monotonic()
    while _alive(procs) or set(names) & set(netns.namespaces() if names else ()):
        if time.monotonic() - t0 > GONE_WITHIN_S:
            left = _alive(procs)
            for pid in left:  # this test's failure stays its own
                os.kill(pid, signal.SIGKILL)
            for name in set(names) & set(netns.namespaces()):
                netns.remove(name)
            raise AssertionError(f"still running {GONE_WITHIN_S} s after: {left}; namespaces: {names}")
        time.sleep(0.02)
    return time.monotonic() - t0


OWNED = textwrap.dedent(
    """
    import subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    from serving.fleet.procs import die_with
    die_with(int(sys.argv[2]), "the test's child")
    grandchild = subprocess.Popen(["sleep", "600"])  # its own child: goes with it
    print(grandchild.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_process_that_dies_with_its_owner_takes_its_children():
    owner = subprocess.Popen(["sleep", "600"])
    child = subprocess.Popen(
        [sys.executable, "-c", OWNED, str(ROOT), str(owner.pid)], stdout=subprocess.PIPE, text=True
    )
    grandchild = int(child.stdout.readline())
    both = descendants(os.getpid())
    assert {child.pid, grandchild} <= {pid for pid, _ in both}
    owner.kill()
    owner.wait()
    assert child.wait(timeout=GONE_WITHIN_S) == -signal.SIGKILL
    _until_gone([p for p in both if p[0] == grandchild])


def test_an_owner_already_gone_ends_it_at_once():
    owner = subprocess.Popen(["true"])
    owner.wait()  # gone (and reaped: its pid names nothing now)
    child = subprocess.Popen([sys.executable, "-c", OWNED, str(ROOT), str(owner.pid)], stdout=subprocess.PIPE)
    assert child.wait(timeout=GONE_WITHIN_S) == -signal.SIGKILL
    assert child.stdout.read() == b""  # it started nothing


def _job(tmp: Path, entry: str, launcher: str) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        f"experiments.{entry}",
        "model=tiny-random",
        "deployment=1p1d",
        "plots=false",
    ]
    args += [f"launcher={launcher}", f"hydra.run.dir={tmp}", "start_timeout_s=600"]
    if launcher == "netns":
        args += ["cluster.subnet=24" if entry == "run" else "cluster.subnet=25"]
    if entry == "serve":
        args += ["server.port=0"]
    else:  # a run still going when it is killed: its workers up, its requests far from done
        args += ["workload.num_requests=1000", "workload.output_len.value=1000", "run_timeout_s=3600"]
    env = dict(os.environ, TMPDIR=str(tmp))
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def _workers_up(job: subprocess.Popen, n: int) -> list[tuple[int, str]]:
    """Once the job's fork server has forked its n workers, and each has a child of its own or has had
    time to make one (the TP ranks' resource tracker is the first): every process below the job."""
    give_up = time.monotonic() + 600  # a bound only a broken start reaches
    while True:
        assert job.poll() is None, f"the job ended first ({job.returncode})"
        assert time.monotonic() < give_up, "its workers never started"
        below = descendants(job.pid)
        servers = [pid for pid, _ in below if "forkserver" in _cmdline(pid)]
        workers = [pid for pid, _ in below if _parent(pid) in servers]
        if len(workers) >= n and all(_listening(pid) for pid in workers):
            return descendants(job.pid)
        time.sleep(0.1)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def _listening(pid: int) -> bool:
    """The worker has bound a socket (its control sockets: it is past its start)."""
    try:
        return any(
            os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:") for fd in os.listdir(f"/proc/{pid}/fd")
        )
    except OSError:
        return False


@pytest.mark.parametrize(  # make test: both entries locally, the server on netns hosts
    "entry, launcher",
    [
        ("run", "local"),
        ("serve", "local"),
        ("serve", "netns"),
        pytest.param("run", "netns", marks=pytest.mark.slow),
    ],
)
def test_a_sigkilled_job_leaves_nothing_running(short_tmp, entry, launcher):
    """SIGKILL of `python -m experiments.run` (mid-run) or `experiments.serve`, with its workers up:
    the fork server, both workers, the resource tracker and (netns) the hosts' namespaces and what runs
    in them all go, with no cleanup of the job's own (before die_with and the watcher, all of them were
    still there 60 s later)."""
    if launcher == "netns" and os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    job = _job(short_tmp.resolve(), entry, launcher)
    try:
        below = _workers_up(job, 2)
        names = [n for n in netns.namespaces() if n.startswith(f"{netns.PREFIX}{job.pid}-")]
        assert (launcher == "netns") == bool(names)
    finally:
        job.kill()
        job.wait()
    took = _until_gone(below, names)
    print(f"{entry} {launcher}: {len(below)} processes, {len(names)} namespaces gone in {took:.2f} s")
