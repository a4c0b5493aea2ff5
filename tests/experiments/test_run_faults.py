"""The main job when workers die, restart, switch roles or the job is stopped: every request accounted
for, every page back, no process left behind."""

import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.config import from_cfg
from experiments.run import run
from tests import needs
from tests.experiments.runs import CONF, TINY, _cfg, _descendants, _outputs, _running

needs.nixl()


def test_killed_prefill_worker_ends_its_requests_with_errors_and_the_run_finishes(tmp_path):
    overrides = [*TINY, "deployment=1p1d", "workload.num_requests=10", "workload.prompt_len.kind=fixed"]
    overrides += ["workload.prompt_len.value=60", "deployment.chunk_size=8"]  # prefills take many passes
    killed = []

    def kill_prefill_after_first_result(run_state, runtime):
        procs = runtime.fleet.procs
        if run_state.results and not killed:
            procs["prefill-0"].kill()
            procs["prefill-0"].join()  # dead before the driver's next look: the decode worker, which
            killed.append(True)  # also sees its pid gone, may fail the rest within that turn

    (rec,) = run(_cfg(overrides), tmp_path, progress=False, hooks=kill_prefill_after_first_result)
    s = rec["summary"]
    assert killed and s["num_requests"] == 10 and s["errors"] > 0 and s["completed"] >= 1
    errors = [r["error"] for r in rec["requests"] if r["error"]]
    assert all("prefill-0" in e for e in errors), errors
    assert any("prefill-0 exited" in what for _, what in rec["events"])
    assert json.loads((tmp_path / "results.json").read_text())["runs"][0]["summary"]["errors"] == s["errors"]


def test_a_killed_decode_worker_s_requests_migrate_and_finish_with_the_same_text(tmp_path):
    """1 prefill + 2 decode workers; decode-0 is killed once some tokens have streamed: its requests go on
    on decode-1 (prompt + their tokens so far, prefilled again) with the greedy tokens of a run without
    the fault (the colocated reference beside it)."""
    overrides = [
        *TINY,
        "workload.num_requests=12",
        "workload.concurrency=12",
        "workload.output_len.value=120",
    ]
    overrides += [
        "deployments=[{name: colocated, kind: colocated, num_workers: 1},"
        "{name: 1p2d, kind: disaggregated, num_prefill: 1, num_decode: 2}]"
    ]
    killed = []

    def kill_decode_mid_stream(run_state, runtime):
        procs = runtime.fleet.procs
        """Once a request of decode-0's has streamed 2 of its 120 tokens (progress, not time)."""
        if run_state.deployment.name == "1p2d" and not killed:
            on_it = [
                n
                for rid, (w, n) in run_state.tokens.items()
                if w == "decode-0" and rid not in run_state.results
            ]
            if any(n >= 2 for n in on_it):
                procs["decode-0"].kill()
                procs["decode-0"].join()
                killed.append(True)

    reference, faulty = run(_cfg(overrides), tmp_path, progress=False, hooks=kill_decode_mid_stream)
    assert killed and any("decode-0 exited" in what for _, what in faulty["events"])
    s = faulty["summary"]
    assert s["completed"] == 12 and s["errors"] == 0 and s["migrations"] > 0, faulty["requests"]
    assert _outputs(faulty) == _outputs(reference)
    assert all(t["free_pages"] == t["num_pages"] for t in faulty["timelines"])  # the live workers: every page


def test_an_exception_mid_run_stops_every_worker_process(tmp_path):
    def fail_after_first_result(run_state, runtime):
        if run_state.results:
            raise RuntimeError("boom")

    overrides = [*TINY, "deployment=1p1d", "deployment.decode_tp=2"]  # the decode worker has a rank process
    with pytest.raises(RuntimeError, match="boom"):
        run(_cfg(overrides), tmp_path, progress=False, hooks=fail_after_first_result)
    assert not mp.active_children()
    rows = [
        line.split(None, 2)
        for line in subprocess.run(
            ["ps", "-ww", "-eo", "ppid,pid,args"], capture_output=True, text=True
        ).stdout.splitlines()[1:]
    ]
    me = str(os.getpid())  # workers fork from this process's fork server (serving/fleet/launcher.py)
    servers = {pid for ppid, pid, args in rows if ppid == me and "multiprocessing.forkserver" in args}
    assert servers  # (so the check below looks where the workers were)
    left = [args for ppid, pid, args in rows if ppid in servers or (ppid == me and "spawn_main" in args)]
    assert not left, left


def test_sigterm_stops_the_job_keeps_what_it_measured_and_leaves_nothing_behind(tmp_path, short_tmp):
    import signal
    import time

    private = short_tmp.resolve()  # the job's TMPDIR: its private run directories go here, and only its own
    deployments = (
        "deployments=[{name: colocated, kind: colocated, num_workers: 1},"
        "{name: 1p1d, kind: disaggregated, num_prefill: 1, num_decode: 1}]"
    )
    args = [*TINY, deployments, "workload.num_requests=20", "workload.output_len.value=64"]
    env = dict(os.environ, PYTHONPATH=str(Path(CONF).parent), TMPDIR=str(private))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "experiments.run", *args, f"hydra.run.dir={out}"]
    job = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    give_up = time.monotonic() + 300
    second = out / "logs" / "1p1d" / "decode-0.log"  # its workers say "up" once Ready: requests follow
    while not (second.exists() and " up: " in second.read_text()):  # the second deployment is under way
        assert job.poll() is None and time.monotonic() < give_up, job.communicate()[1][-3000:]
        time.sleep(0.2)
    workers = _descendants(job.pid)
    assert workers  # the 1p1d workers are running
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 130, stderr[-3000:]
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["deployment"] for r in runs] == ["colocated", "1p1d"]
    assert runs[0]["summary"]["completed"] == 20
    interrupted = [r for r in runs[1]["requests"] if r["error"] and "interrupted" in r["error"]]
    assert interrupted and len(runs[1]["requests"]) == 20  # every request accounted for
    left, give_up = workers, time.monotonic() + 15
    while left and time.monotonic() < give_up:  # the job has exited: its workers follow within seconds
        time.sleep(0.2)
        left = [pid for pid in workers if _running(pid)]
    assert not left, [Path(f"/proc/{pid}/cmdline").read_text() for pid in left if _running(pid)]
    assert not list(private.glob("pdk-*"))  # the run's private dirs are gone
    assert not list(out.glob(".*.tmp"))


def test_killed_workers_restart_under_the_local_launcher_and_take_requests_again(tmp_path):
    """1 prefill + 2 decode workers with launcher.max_restarts=1: decode-0, then prefill-0, are SIGKILLed
    mid-run; each comes back (the prefill worker connects afresh to the restarted decode worker), later
    requests are served by the restarted decode worker, and every output equals LLM.generate's (a
    transfer the prefill kill cuts is recomputed on its decode worker: on_transfer_failure=recompute)."""
    from engine import LLM, SamplingParams
    from experiments.workload import make_requests
    from serving.config import check_fits_model

    overrides = [*TINY, "workload.arrival=poisson", "workload.rate=4", "workload.num_requests=80"]
    overrides += ["workload.output_len.value=24", "launcher.max_restarts=1"]  # 20 s: a restart takes ~3
    overrides += ["transfer.on_transfer_failure=recompute"]  # a transfer cut by the prefill kill: recomputed
    overrides += ["deployments=[{name: 1p2d, kind: disaggregated, num_prefill: 1, num_decode: 2}]"]
    config = from_cfg(_cfg(overrides))
    m = check_fits_model(config)
    requests = make_requests(config.workload, m.tokenizer, m.config.vocab_size, m.config.max_position)
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    want = LLM("tiny-random").generate([list(r.prompt_ids) for r in requests], params)
    killed: dict[str, set] = {}  # worker -> the requests that had ended when it was killed

    def kill_then_kill_again(run_state, runtime):
        """decode-0 after 2 results; prefill-0 once the restarted decode-0 has served 3 (progress, not
        time)."""
        procs = runtime.fleet.procs
        if "decode-0" not in killed and len(run_state.results) >= 2:
            procs["decode-0"].kill()
            killed["decode-0"] = set(run_state.results)
        if "prefill-0" not in killed and "decode-0" in killed and len(since_back(run_state)) >= 3:
            procs["prefill-0"].kill()
            killed["prefill-0"] = set(run_state.results)

    def since_back(run_state):
        """What the restarted decode-0 served (a Result from a dead worker is never taken)."""
        return [
            r
            for rid, r in list(run_state.results.items())
            if r.worker == "decode-0" and r.error is None and rid not in killed["decode-0"]
        ]

    (faulty,) = run(_cfg(overrides), tmp_path, progress=False, hooks=kill_then_kill_again)
    assert set(killed) == {"decode-0", "prefill-0"}, faulty["events"]
    events = [what for _, what in faulty["events"]]
    for name in killed:
        assert f"{name} back after a restart" in events, events
    s = faulty["summary"]
    assert s["completed"] == 80 and s["errors"] == 0, [r["error"] for r in faulty["requests"] if r["error"]]
    assert _outputs(faulty) == {r.request_id: w.token_ids for r, w in zip(requests, want, strict=True)}
    # Between decode-0's return and prefill-0's death its only peer is up: every prompt it served came over
    # the reconnected channel (after the prefill kill it computes them itself, as it should)
    later = [
        r
        for r in faulty["requests"]
        if r["worker"] == "decode-0" and r["request_id"] in killed["prefill-0"] - killed["decode-0"]
    ]
    assert len(later) >= 3 and all(r["prefill"] == "remote" for r in later), later
    assert all(t["free_pages"] == t["num_pages"] for t in faulty["timelines"])


@pytest.mark.slow  # make test-all: role moves under streaming clients are make test's (test_serve_faults.py)
def test_workers_switch_roles_mid_run_when_asked_or_by_the_planner_and_no_request_fails(tmp_path):
    """Elastic roles on 1 prefill + 2 decode workers, beside a colocated run of the same requests.
    Asked (deployment.planner.manual, Runtime.move at points of progress): decode-1 turns prefill while
    requests stream on it (they go on on decode-0, after their tokens so far), then, once that move is
    done, prefill-0 turns decode once no decode worker has anything in flight there. By the planner
    (enabled, looking every 0.3 s of the run; a TTFT SLO no prompt meets, a TPOT SLO every step meets):
    one decode worker moves to prefill and no further (min_decode), the events saying why. Both: every
    request finishes with the colocated run's greedy tokens, each switch is an event and a move with its
    time, and every page is free on every worker after, whichever roles they ended in."""
    overrides = [
        *TINY,
        "workload.num_requests=24",
        "workload.concurrency=8",
        "workload.output_len.value=120",
        "slo.ttft_s=0.000001",
        "slo.tpot_s=10",
    ]
    overrides += [
        "deployments=[{name: colocated, kind: colocated, num_workers: 1},"
        "{name: asked, kind: disaggregated, num_prefill: 1, num_decode: 2, planner: {manual: true}},"
        "{name: planned, kind: disaggregated, num_prefill: 1, num_decode: 2,"
        " planner: {enabled: true, interval_s: 0.3, patience: 1, min_decode: 1}}]"
    ]
    asked_at: dict[str, int] = {}  # move -> results so far when it was asked for

    def move_at_progress(run_state, runtime):
        if run_state.deployment.name != "asked":
            return
        streaming = [
            n
            for rid, (w, n) in list(run_state.tokens.items())
            if w == "decode-1" and rid not in run_state.results
        ]
        if "decode-1" not in asked_at and any(n >= 2 for n in streaming):
            runtime.move("decode-1", "prefill")
            asked_at["decode-1"] = len(run_state.results)
        done = any(what.startswith("decode-1 serves prefill") for _, what in list(run_state.events))
        if done and "prefill-0" not in asked_at:
            runtime.move("prefill-0", "decode")
            asked_at["prefill-0"] = len(run_state.results)

    reference, asked, planned = run(_cfg(overrides), tmp_path, progress=False, hooks=move_at_progress)
    for elastic in (asked, planned):
        s = elastic["summary"]
        assert s["completed"] == 24 and s["errors"] == 0, elastic["requests"]
        assert _outputs(elastic) == _outputs(reference)
        assert all(t["free_pages"] == t["num_pages"] for t in elastic["timelines"])
    moves = asked["role_moves"]
    assert [(m["worker"], m["from"], m["to"], m["why"]) for m in moves] == [
        ("decode-1", "decode", "prefill", "asked"),
        ("prefill-0", "prefill", "decode", "asked"),
    ], asked["events"]
    assert all(m["seconds"] >= m["settle_s"] >= 0 for m in moves), moves  # measured, each
    assert asked["summary"]["migrations"] > 0  # decode-1 handed requests back mid-stream
    assert {t["name"]: t["role"] for t in asked["timelines"]} == {
        "prefill-0": "decode",
        "decode-0": "decode",
        "decode-1": "prefill",
    }
    assert "prefill-0" in {r["worker"] for r in asked["requests"]}  # it decoded after its switch
    log = (tmp_path / "logs" / "asked" / "decode-1.log").read_text()
    assert "switched from decode to prefill" in log
    moves = planned["role_moves"]
    assert len(moves) == 1 and moves[0]["from"] == "decode" and moves[0]["to"] == "prefill", moves
    assert moves[0]["why"].startswith("TTFT at ") and "x its SLO" in moves[0]["why"]
