"""The main job end to end: real worker processes, NIXL between prefill and decode, hydra configs."""

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.config import from_cfg
from experiments.run import run
from tests.heads import echo_head

CONF = str(Path(__file__).resolve().parents[2] / "conf")
TINY = [
    "model=tiny-random",
    "workload.num_requests=6",
    "workload.arrival=concurrency",
    "workload.concurrency=3",
]
TINY += ["workload.prompt_len.kind=uniform", "workload.prompt_len.low=2", "workload.prompt_len.high=40"]
TINY += ["workload.output_len.value=8", "plots=false", "start_timeout_s=120", "run_timeout_s=180"]

pytest.importorskip("nixl_cu12")


def _cfg(overrides):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose("config", overrides=overrides)


def _outputs(record):
    return {r["request_id"]: r["output_ids"] for r in record["requests"]}


def test_greedy_outputs_are_identical_colocated_1p1d_and_tp_1_to_2(tmp_path):
    deployments = (
        "deployments=[{name: colocated, kind: colocated, num_workers: 1},"
        "{name: 1p1d, kind: disaggregated, num_prefill: 1, num_decode: 1},"
        "{name: 1p1d-tp1-2, kind: disaggregated, num_prefill: 1, num_decode: 1, decode_tp: 2}]"
    )
    records = run(_cfg([*TINY, deployments]), tmp_path, progress=False)
    assert [r["deployment"] for r in records] == ["colocated", "1p1d", "1p1d-tp1-2"]
    for rec in records:
        s = rec["summary"]
        assert s["completed"] == 6 and s["errors"] == 0, rec["requests"]
        assert all(len(ids) == 8 for ids in _outputs(rec).values())
    assert _outputs(records[0]) == _outputs(records[1]) == _outputs(records[2])
    remote = records[1]["requests"]
    assert all(r["prefill"] == "remote" and r["transfer_bytes"] > 0 and r["transfer_s"] > 0 for r in remote)
    assert records[0]["summary"]["transfer_bytes"] == 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["schema"] == "pdkernels.results/1" and len(saved["runs"]) == 3
    header = (tmp_path / "requests-1p1d.csv").read_text().splitlines()[0]
    assert header.startswith("request_id,worker,prefill,prefill_worker,prompt_tokens")
    assert not mp.active_children()  # every worker process is gone


def test_control_plane_over_tcp_with_curve(tmp_path):
    """control_transport=tcp: every control socket binds to control_host behind CURVE (what a deployment
    across machines needs); the run gives the same greedy tokens as over ipc."""
    runs = {
        transport: run(
            _cfg([*TINY, "deployment=1p1d", f"transfer.control_transport={transport}"]),
            tmp_path / transport,
            progress=False,
        )[0]
        for transport in ("ipc", "tcp")
    }
    assert runs["tcp"]["summary"]["completed"] == 6 and _outputs(runs["tcp"]) == _outputs(runs["ipc"])
    for name in ("prefill-0", "decode-0"):  # and each worker logs to its own file in the run folder
        text = (tmp_path / "tcp" / "logs" / "1p1d" / f"{name}.log").read_text()
        assert f"{name} up: {name.split('-')[0]} worker" in text and f"{name} stopped by the driver" in text
    assert "prefill worker prefill-0 connected" in (tmp_path / "tcp/logs/1p1d/decode-0.log").read_text()


def test_conditional_disaggregation_prefills_short_prompts_on_the_decode_worker(tmp_path):
    overrides = [*TINY, "deployment=1p1d", "deployment.local_prefill_max_tokens=20"]
    (rec,) = run(_cfg(overrides), tmp_path, progress=False)
    for r in rec["requests"]:
        assert r["error"] is None
        assert r["prefill"] == ("local" if r["prompt_tokens"] <= 20 else "remote"), r


def test_killed_prefill_worker_ends_its_requests_with_errors_and_the_run_finishes(tmp_path):
    overrides = [*TINY, "deployment=1p1d", "workload.num_requests=10", "workload.prompt_len.kind=fixed"]
    overrides += ["workload.prompt_len.value=60", "deployment.chunk_size=8"]  # prefills take many passes
    killed = []

    def kill_prefill_after_first_result(run_state, procs):
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

    def kill_decode_mid_stream(run_state, procs):
        if run_state.deployment.name == "1p2d" and not killed:
            if time.perf_counter() - run_state.start > 0.3:  # requests are streaming by now
                procs["decode-0"].kill()
                procs["decode-0"].join()
                killed.append(True)

    reference, faulty = run(_cfg(overrides), tmp_path, progress=False, hooks=kill_decode_mid_stream)
    assert killed and any("decode-0 exited" in what for _, what in faulty["events"])
    s = faulty["summary"]
    assert s["completed"] == 12 and s["errors"] == 0 and s["migrations"] > 0, faulty["requests"]
    assert _outputs(faulty) == _outputs(reference)
    assert all(t["free_pages"] == t["num_pages"] for t in faulty["timelines"])  # the live workers: every page


@pytest.mark.parametrize(
    "override, message",
    [
        ("deployment.decode_tp=3", "decode_tp=3 does not fit tiny-random"),
        ("+model.expert_parallel=true", "does not fit tiny-random: expert_parallel needs an MoE model"),
        ("slo.ttft_s=0", "slo.ttft_s=0 is not allowed: must be a number > 0"),
        ("workload.rate=-1", "workload.rate=-1 is not allowed: must be a number > 0"),
        (
            "workload.prompts_file=/nonexistent/prompts.txt",
            "workload.prompts_file='/nonexistent/prompts.txt'",
        ),
        ("transfer.on_transfer_failure=retry", "on_transfer_failure must be one of ('fail', 'recompute')"),
        (
            "workload.arrival=burst",
            "workload.arrival='burst' is not allowed: one of ('poisson', 'concurrency', 'trace')",
        ),
        (
            "deployment.decode_preemption=drop",
            "decode_preemption='drop' is not allowed: one of ('refetch', 'recompute_local')",
        ),
        ("deployment.decode_reserved_tokens=-1", "decode_reserved_tokens=-1 is not allowed: null or an"),
        (
            "deployment.chunk_size=big",
            "deployment.chunk_size (or auto)='big' is not allowed: must be an integer",
        ),
        (
            "deployment.chunk_size=0",
            "deployment.chunk_size (or auto)=0 is not allowed: must be an integer > 0",
        ),
        ("deployment.gather_ms=-1", "gather_ms=-1 is not allowed: a number of milliseconds from 0 to 1000"),
        (
            "deployment.gather_ms=5000",
            "gather_ms=5000 is not allowed: a number of milliseconds from 0 to 1000",
        ),
        (
            "deployment.gather_ms=true",
            "gather_ms=True is not allowed: a number of milliseconds from 0 to 1000",
        ),
        ("log_level=LOUD", "log_level='LOUD' is not allowed: one of ('DEBUG', 'INFO', 'WARNING', 'ERROR')"),
        ("transfer.control_transport=udp", "control_transport must be one of ('ipc', 'tcp')"),
        ("kernels.backend=cutlass", "kernels.backend='cutlass' is not allowed: one of ('auto', 'triton'"),
        ("model.device=tpu", "model.device='tpu' is not allowed: one of ('auto', 'cpu', 'cuda')"),
    ]
    + (
        []
        if torch.cuda.is_available()
        else [("model.device=cuda", "model.device='cuda' is not allowed: this machine has no CUDA device")]
    ),
)
def test_bad_configs_fail_before_any_process_starts(tmp_path, override, message):
    with pytest.raises(ValueError) as err:
        run(_cfg(["model=tiny-random", "deployment=1p1d", override]), tmp_path, progress=False)
    assert message in str(err.value)
    assert not mp.active_children()


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


def test_a_deployment_that_an_experiment_would_ignore_is_refused(tmp_path):
    out = _cli(["experiment=compare", "deployment=2p1d", f"hydra.run.dir={tmp_path}"], tmp_path)
    assert out.returncode == 2 and "deployment is ignored here" in out.stderr, out.stderr[-2000:]
    assert "['colocated', '1p1d']" in out.stderr


def test_unknown_deployment_is_refused_by_the_cli(tmp_path):
    out = _cli(["deployment=3p9d", f"hydra.run.dir={tmp_path}"], tmp_path)
    assert out.returncode != 0
    assert "deployment/3p9d" in out.stderr and "1p1d" in out.stderr  # hydra lists the options


@pytest.mark.parametrize(
    "launcher",
    [pytest.param([], marks=pytest.mark.slow), ["experiment=rate_sweep"]],  # make test: the parallel one
    ids=["basic", "joblib"],
)
def test_a_sweep_over_two_rates_gives_two_run_folders_and_a_goodput(tmp_path, launcher):
    args = ["-m", *TINY, *launcher, "deployment=colocated", "deployment.num_workers=1"]  # a core per job
    args += ["workload.arrival=poisson", "workload.rate=2,4"]
    args += ["slo.ttft_s=5", "slo.tpot_s=1", f"hydra.sweep.dir={tmp_path}"]
    out = _cli(args, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    folders = sorted(p.parent.name for p in tmp_path.glob("*/results.json"))
    assert folders == ["0", "1"]
    rates = sorted(
        json.loads((tmp_path / f / "results.json").read_text())["runs"][0]["rate"] for f in folders
    )
    assert rates == [2.0, 4.0]
    goodput = json.loads((tmp_path / "goodput.json").read_text())["goodput_rps"]
    assert goodput["colocated"] == 4.0  # a tiny model meets a loose SLO at both rates
    assert "goodput (req/s)" in out.stdout


@pytest.mark.slow  # make test-all: 13 s of joblib workers starting before each refuses
def test_a_parallel_sweep_whose_jobs_cannot_each_have_their_own_cores_is_refused(tmp_path):
    n_jobs = len(os.sched_getaffinity(0)) + 1  # one core each: one job too many
    rates = ",".join(str(r + 1) for r in range(n_jobs))
    args = ["-m", *TINY, "experiment=rate_sweep", f"hydra.launcher.n_jobs={n_jobs}", "deployment=colocated"]
    args += ["workload.arrival=poisson", f"workload.rate={rates}", f"hydra.sweep.dir={tmp_path}"]
    out = _cli(args, tmp_path)
    assert out.returncode != 0 and f"hydra.launcher.n_jobs={n_jobs} parallel jobs" in out.stderr, out.stderr
    assert "would measure each other" in out.stderr


def test_a_sharegpt_sample_drives_a_real_run(tmp_path):
    data = Path(__file__).resolve().parents[1] / "data" / "sharegpt_sample.json"
    overrides = [*TINY, "deployment=colocated", "workload.dataset=sharegpt", f"workload.dataset_path={data}"]
    (record,) = run(_cfg(overrides), tmp_path, progress=False)
    assert record["summary"]["completed"] == 6
    assert len({r["prompt_tokens"] for r in record["requests"]}) > 3  # the conversations' own lengths


@pytest.mark.parametrize(  # make test: MTP (ngram's drafts are checked lossless in tests/engine too)
    "method", [pytest.param("ngram", marks=pytest.mark.slow), "mtp"]
)
def test_speculation_through_the_main_job_is_lossless_and_reported(method, tmp_path):
    spec = "speculative: {method: ngram, num_speculative_tokens: 3}"
    if method == "mtp":  # drafting from the hand-off's context on the decode side, TP 1 -> 2 too
        head = echo_head(tmp_path / "echo.safetensors")
        spec = f"speculative: {{method: mtp, num_speculative_tokens: 2, model: '{head}'}}"
    deployments = (
        "deployments=[{name: plain, kind: colocated, num_workers: 1},"
        f"{{name: spec, kind: colocated, num_workers: 1, {spec}}},"
        f"{{name: spec-1p1d, kind: disaggregated, num_prefill: 1, num_decode: 1, {spec}}},"
        f"{{name: spec-tp1-2, kind: disaggregated, num_prefill: 1, num_decode: 1, decode_tp: 2, {spec}}}]"
    )
    records = run(_cfg([*TINY, "workload.output_len.value=24", deployments]), tmp_path, progress=False)
    plain, spec_colocated, spec_1p1d, spec_tp = (_outputs(r) for r in records)
    assert spec_colocated == plain == spec_1p1d == spec_tp  # TP 1 -> 2 drafting on the decode side too
    s = records[1]["summary"]
    assert records[0]["summary"]["spec_acceptance_rate"] is None and s["spec_drafted"] > 0
    assert 0 < s["spec_acceptance_rate"] <= 1 and s["spec_mean_accepted_length"] > 1
    verify_steps = [step[4] for t in records[1]["timelines"] for step in t["steps"]]
    assert sum(verify_steps) > 0  # the timeline marks the steps that verified drafts
    from experiments.plots import timeline

    timeline(records[1], tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_config_maps_to_dataclasses():
    from pdkernels.cpu import native_bf16

    config = from_cfg(_cfg(["experiment=compare"]))
    assert [d.name for d in config.deployments] == ["colocated", "1p1d"]
    assert config.workload.arrival == "poisson" and config.workload.num_requests == 14
    assert config.transfer.backend == "nixl" and config.model.name == "smollm2-135m"
    assert config.kernels.backend == "auto"
    cpu = not torch.cuda.is_available()
    assert config.model.device == ("cpu" if cpu else "cuda")  # auto, resolved once in the driver
    bf16 = "bfloat16" if not cpu or native_bf16() else "float32"  # auto: by the CPU's ISA
    assert config.model.dtype == bf16
    one_at_a_time = from_cfg(_cfg(["experiment=compare_concurrency1"]))
    assert one_at_a_time.workload.arrival == "concurrency" and one_at_a_time.workload.num_requests == 20
    assert one_at_a_time.model.dtype == "bfloat16"
    assert from_cfg(_cfg(["model=random-llama-1b"])).model.dtype == bf16
    assert from_cfg(_cfg([])).model.dtype == bf16  # the default, smollm2-135m: fp32 where bf16 only converts
    assert from_cfg(_cfg(["model=tiny-random-deepseek", "model.expert_parallel=true"])).model.expert_parallel


@pytest.mark.slow
def test_smollm2_greedy_outputs_are_identical_colocated_and_1p1d(tmp_path):
    overrides = ["model=smollm2-135m", "model.dtype=float32", "plots=false", "workload.num_requests=4"]
    overrides += ["workload.arrival=concurrency", "workload.concurrency=2", "workload.output_len.value=8"]
    overrides += ["workload.prompt_len.value=64", "transfer.peer_timeout_s=60"]
    overrides += [
        "deployments=[{name: colocated, kind: colocated, num_workers: 1},"
        "{name: 1p1d, kind: disaggregated, num_prefill: 1, num_decode: 1},"
        "{name: 1p1d-tp1-3, kind: disaggregated, num_prefill: 1, num_decode: 1, decode_tp: 3}]"
    ]
    records = run(_cfg(overrides), tmp_path, progress=False)
    assert all(r["summary"]["completed"] == 4 for r in records)
    assert _outputs(records[0]) == _outputs(records[1]) == _outputs(records[2])


def test_an_exception_mid_run_stops_every_worker_process(tmp_path):
    def fail_after_first_result(run_state, procs):
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
    me = str(os.getpid())  # workers fork from this process's fork server (experiments/deploy/launcher.py)
    servers = {pid for ppid, pid, args in rows if ppid == me and "multiprocessing.forkserver" in args}
    assert servers  # (so the check below looks where the workers were)
    left = [args for ppid, pid, args in rows if ppid in servers or (ppid == me and "spawn_main" in args)]
    assert not left, left


def test_goodput_search_runs_each_rate_and_reports_the_highest_that_meets_the_slo(tmp_path):
    overrides = [*TINY, "deployment=colocated", "workload.arrival=poisson", "goodput_search.rates=[2,4]"]
    overrides += ["slo.ttft_s=5", "slo.tpot_s=1", "workload.num_requests=4"]
    records = run(_cfg(overrides), tmp_path, progress=False)
    assert [r["rate"] for r in records] == [2, 4]
    from experiments.metrics import goodput

    assert goodput(records) == {"colocated": 4}
    assert all(r["summary"]["goodput_rps"] == r["rate"] for r in records)


def test_sigterm_stops_the_job_keeps_what_it_measured_and_leaves_nothing_behind(tmp_path):
    import signal
    import time

    private = tmp_path / "tmp"  # the job's TMPDIR: its private run directories go here, and only its own
    private.mkdir()
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
    while not (out / "results.json").exists():  # written once the first deployment is done
        assert job.poll() is None and time.monotonic() < give_up, job.communicate()[1][-3000:]
        time.sleep(0.2)
    time.sleep(3)  # the second deployment is under way
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


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has exited; init reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(pid: int) -> list[int]:
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


def _prefill_tokens(record, role):
    return [step[2] for t in record["timelines"] if t["role"] == role for step in t["steps"] if step[2]]


def test_an_idle_worker_with_gather_ms_lets_a_spread_out_burst_share_its_first_step(tmp_path):
    """Four prompts arriving about 100 ms apart (as a burst does over HTTP, request by request): a worker
    that steps at once takes the first alone; with gather_ms it keeps reading for that long after the first
    and prefills all four in its first step. The outputs are the same."""
    spread = [*TINY[:1], *TINY[8:], "workload.num_requests=4", "workload.arrival=poisson", "workload.rate=10"]
    spread += ["workload.prompt_len.kind=fixed", "workload.prompt_len.value=30"]
    deployments = (
        "deployments=[{name: now, kind: colocated, num_workers: 1},"
        "{name: gather, kind: colocated, num_workers: 1, gather_ms: 1000}]"
    )
    now, gather = run(_cfg([*spread, deployments]), tmp_path, progress=False)
    assert _outputs(now) == _outputs(gather)
    assert _prefill_tokens(now, "colocated")[0] < 120
    assert _prefill_tokens(gather, "colocated")[0] == 120


def test_a_decode_worker_under_memory_pressure_admits_with_room_to_finish_and_refetches(tmp_path):
    """80 pages of 4 tokens; each request needs 23 pages (60 prompt + 30 output tokens), 8 arrive at once.
    Before admission with room to finish, the decode worker reserved every prompt while pages were free,
    ran out as they grew, and recomputed preempted prompts in its decode steps. Now: it queues them, and
    a request that still runs out (no horizon: decode_reserved_tokens=0) is refetched from the prefill
    worker, unless recompute_local says otherwise. Greedy output never changes. (With fair_share, the
    default, a request is owed only its share of the cache: more start at once and some are preempted.)"""
    pressure = ["model.num_pages=80", "workload.num_requests=8", "workload.arrival=poisson"]
    pressure += ["workload.rate=1000", "workload.prompt_len.value=60", "workload.output_len.value=30"]
    common = "kind: disaggregated, num_prefill: 1, num_decode: 1"
    deployments = (
        f"deployments=[{{name: room, {common}, fair_share: false}},"
        f"{{name: refetch, {common}, decode_reserved_tokens: 0}},"
        f"{{name: local, {common}, decode_reserved_tokens: 0, decode_preemption: recompute_local}}]"
    )
    overrides = [*TINY[:1], *TINY[8:], *pressure, "workload.prompt_len.kind=fixed", deployments]
    room, refetch, local = run(_cfg(overrides), tmp_path, progress=False)
    s = room["summary"]  # nothing preempted, nothing recomputed: the reference run
    assert set(s["preemptions"].values()) == set(s["recomputed_prompt_tokens"].values()) == {0}
    for rec in (room, refetch, local):
        assert rec["summary"]["completed"] == 8, rec["requests"]
        assert _outputs(rec) == _outputs(room), rec["deployment"]  # greedy: the same tokens
        assert all(t["free_pages"] == t["num_pages"] == 80 for t in rec["timelines"])  # nothing leaked
    assert _prefill_tokens(room, "decode") == []  # every prompt was prefilled remotely, once
    s = refetch["summary"]
    assert s["preemptions"]["decode-0"] > 0 and s["refetched_tokens"]["decode-0"] > 0
    assert s["recomputed_prompt_tokens"]["decode-0"] == 0 and _prefill_tokens(refetch, "decode") == []
    s = local["summary"]
    assert s["preemptions"]["decode-0"] > 0 and s["recomputed_prompt_tokens"]["decode-0"] > 0
    assert sum(_prefill_tokens(local, "decode")) >= s["recomputed_prompt_tokens"]["decode-0"]


def test_multiturn_conversations_reuse_their_history_and_send_only_the_new_kv(tmp_path):
    """4 conversations x 3 turns through 1P1D with prefix caching on and off: the same replies; with it,
    turns after the first find their history in the decode worker's cache and only the rest is sent."""
    multiturn = [
        "workload=multiturn",
        "workload.conversations=4",
        "workload.turns=3",
        "workload.concurrency=4",
    ]
    multiturn += ["workload.system_prompt_len=40", "workload.turn_len=12", "workload.think_time_s=0.05"]
    multiturn += ["workload.output_len.value=8", "model.page_size=4"]
    common = "kind: disaggregated, num_prefill: 1, num_decode: 1"
    deployments = (
        f"deployments=[{{name: cached, {common}}}, {{name: plain, {common}, prefix_caching: false}}]"
    )
    cached, plain = run(_cfg([*TINY[:1], *TINY[8:], *multiturn, deployments]), tmp_path, progress=False)
    assert cached["summary"]["completed"] == plain["summary"]["completed"] == 12
    assert _outputs(cached) == _outputs(plain)
    rows = {r["request_id"]: r for r in cached["requests"]}
    plain_rows = {r["request_id"]: r for r in plain["requests"]}
    for rid, row in rows.items():
        assert row["prompt_tokens"] == plain_rows[rid]["prompt_tokens"]
        if row["turn"] == 0:
            continue
        assert row["cached_tokens"] >= row["prompt_tokens"] - row["new_tokens"] - 4  # the history, to a page
        assert row["transfer_bytes"] < plain_rows[rid]["transfer_bytes"]
        assert plain_rows[rid]["cached_tokens"] == 0
    turns = cached["summary"]["by_turn"]
    assert [t["turn"] for t in turns] == [0, 1, 2] and all(t["requests"] == 4 for t in turns)
    assert 0 < cached["summary"]["prefix_hit_rate"] and plain["summary"]["prefix_hit_rate"] == 0
    assert cached["summary"]["prefix_hits"]["prefill-0"] > 0  # its own cache: later turns' history
    assert all(t["free_pages"] == t["num_pages"] for rec in (cached, plain) for t in rec["timelines"])


def test_cache_aware_routing_keeps_each_conversation_where_its_history_is(tmp_path):
    """Two colocated workers, 3 conversations x 3 turns: cache_aware (the overlap weighted far above the
    load) sends every turn to the worker that served the conversation's last one, and every later turn
    finds its history there; round_robin cannot (3 conversations over 2 workers: some turn switches)."""
    multiturn = ["workload=multiturn", "workload.conversations=3", "workload.turns=3"]
    multiturn += ["workload.concurrency=3", "workload.system_prompt_len=40", "workload.turn_len=12"]
    multiturn += ["workload.think_time_s=0.05", "workload.output_len.value=8", "model.page_size=4"]
    common = "kind: colocated, num_workers: 2"
    deployments = (
        f"deployments=[{{name: cache, {common}, routing_overlap_weight: 100}},"
        f"{{name: rr, {common}, routing: round_robin}}]"
    )
    cache, rr = run(_cfg([*TINY[:1], *TINY[8:], *multiturn, deployments]), tmp_path, progress=False)
    assert cache["summary"]["completed"] == rr["summary"]["completed"] == 9
    assert _outputs(cache) == _outputs(rr)

    def by_conversation(record):
        rows = sorted(record["requests"], key=lambda r: (r["conversation"], r["turn"]))
        return {c: [r for r in rows if r["conversation"] == c] for c in range(3)}

    switched = 0
    for turns in by_conversation(cache).values():
        assert len({r["worker"] for r in turns}) == 1
        for r in turns[1:]:
            assert r["cached_tokens"] >= r["prompt_tokens"] - 12 - 4  # all but the new message, to a page
    for turns in by_conversation(rr).values():
        for prev, r in zip(turns, turns[1:], strict=False):
            if r["worker"] != prev["worker"]:
                switched += 1
                assert r["cached_tokens"] < r["prompt_tokens"] - 12 - 4
    assert switched >= 1

    def later_turns_hit_rate(record):  # the first turns race for the system prompt's pages: left out
        later = [r for r in record["requests"] if r["turn"] > 0]
        return sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later)

    assert later_turns_hit_rate(cache) > later_turns_hit_rate(rr)
    assert 0 < rr["summary"]["prefix_hit_rate"] < 1 and 0 < cache["summary"]["prefix_hit_rate"] < 1


def test_killed_workers_restart_under_the_local_launcher_and_take_requests_again(tmp_path):
    """1 prefill + 2 decode workers with launcher.max_restarts=1: decode-0, then prefill-0, are SIGKILLed
    mid-run; each comes back (the prefill worker connects afresh to the restarted decode worker), later
    requests are served by the restarted decode worker, and every output equals LLM.generate's (a
    transfer the prefill kill cuts is recomputed on its decode worker: on_transfer_failure=recompute)."""
    from engine import LLM, SamplingParams
    from experiments.config import from_cfg
    from experiments.deploy.config import check_fits_model
    from experiments.workload import make_requests

    overrides = [*TINY, "workload.arrival=poisson", "workload.rate=4", "workload.num_requests=80"]
    overrides += ["workload.output_len.value=24", "launcher.max_restarts=1"]  # 20 s: a restart takes ~3
    overrides += ["transfer.on_transfer_failure=recompute"]  # a transfer cut by the prefill kill: recomputed
    overrides += ["deployments=[{name: 1p2d, kind: disaggregated, num_prefill: 1, num_decode: 2}]"]
    config = from_cfg(_cfg(overrides))
    m = check_fits_model(config)
    requests = make_requests(config.workload, m.tokenizer, m.config.vocab_size, m.config.max_position)
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    want = LLM("tiny-random").generate([list(r.prompt_ids) for r in requests], params)
    killed: dict[str, float] = {}

    def kill_then_kill_again(run_state, procs):
        if run_state.deployment.name != "1p2d":
            return
        now = time.perf_counter()
        if "decode-0" not in killed and len(run_state.results) >= 2:
            procs["decode-0"].kill()
            killed["decode-0"] = now
        back = [t for t, what in run_state.events if what == "decode-0 back after a restart"]
        if back and "prefill-0" not in killed and now > back[0] + 5:
            procs["prefill-0"].kill()
            killed["prefill-0"] = now - run_state.start

    (faulty,) = run(_cfg(overrides), tmp_path, progress=False, hooks=kill_then_kill_again)
    assert set(killed) == {"decode-0", "prefill-0"}, faulty["events"]
    events = [what for _, what in faulty["events"]]
    for name in killed:
        assert f"{name} back after a restart" in events, events
    s = faulty["summary"]
    assert s["completed"] == 80 and s["errors"] == 0, [r["error"] for r in faulty["requests"] if r["error"]]
    assert _outputs(faulty) == {r.request_id: w.token_ids for r, w in zip(requests, want, strict=True)}
    back_at = min(t for t, what in faulty["events"] if what == "decode-0 back after a restart")
    # Between decode-0's return and prefill-0's death its only peer is up: every prompt it serves came over
    # the reconnected channel (around and after the prefill kill it computes them itself, as it should)
    later = [
        r
        for r in faulty["requests"]
        if back_at < r["arrival_s"] < killed["prefill-0"] - 1.5 and r["worker"] == "decode-0"
    ]
    assert later and all(r["prefill"] == "remote" for r in later), later
    assert all(t["free_pages"] == t["num_pages"] for t in faulty["timelines"])


def test_admission_slo_refuses_requests_it_predicts_late_and_serves_the_rest_exactly(tmp_path):
    """1P1D under a burst far past a 20 ms TTFT: with deployment.admission=slo the router refuses
    requests at once (rejected, not errors: no worker saw them) once it has measured the prefill worker's
    speed, and every request it admitted ends with LLM.generate's output; admission=none over the same
    arrivals refuses none."""
    from engine import LLM, SamplingParams
    from experiments.config import from_cfg
    from experiments.deploy.config import check_fits_model
    from experiments.workload import make_requests

    overrides = [*TINY, "workload.arrival=poisson", "workload.rate=40", "workload.num_requests=48"]
    overrides += ["workload.prompt_len.low=150", "workload.prompt_len.high=300"]
    overrides += ["workload.output_len.value=4"]
    overrides += ["slo.ttft_s=0.02", "deployment.prefix_caching=false"]
    pair = "kind: disaggregated, num_prefill: 1, num_decode: 1, prefix_caching: false"
    overrides += [f"deployments=[{{name: none, {pair}}}, {{name: slo, {pair}, admission: slo}}]"]
    config = from_cfg(_cfg(overrides))
    m = check_fits_model(config)
    requests = make_requests(config.workload, m.tokenizer, m.config.vocab_size, m.config.max_position)
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    want = {r.request_id: w.token_ids for r, w in zip(requests, LLM("tiny-random").generate(
        [list(r.prompt_ids) for r in requests], params), strict=True)}  # fmt: skip
    none, slo = run(_cfg(overrides), tmp_path, progress=False)
    assert none["summary"]["rejected"] == 0 and none["summary"]["completed"] == 48
    s = slo["summary"]
    assert s["rejected"] > 0 and s["errors"] == 0 and s["completed"] + s["rejected"] == 48, slo["requests"]
    refused = [r for r in slo["requests"] if r["finish_reason"] == "rejected"]
    assert all("predicted TTFT" in r["error"] and r["worker"] == "" and not r["output_ids"] for r in refused)
    first = min(slo["requests"], key=lambda r: r["arrival_s"])
    assert first["finish_reason"] != "rejected"  # until a Load has measured the prefill speed: taken
    served = {r["request_id"]: r["output_ids"] for r in slo["requests"] if r["finish_reason"] != "rejected"}
    assert served == {rid: want[rid] for rid in served}
    assert s["admitted_attainment_pct"] >= s["attainment_pct"]
    assert all(t["free_pages"] == t["num_pages"] for t in slo["timelines"])


def test_a_long_tmpdir_still_gives_sockets_the_kernel_takes(tmp_path, monkeypatch):
    """A unix socket's path holds 107 bytes: under a TMPDIR so deep that a worker's socket would pass it,
    the run's private directory goes to /tmp (still 0700) instead of failing with a ZMQ error at start."""
    import shutil
    import tempfile

    from experiments.deploy.fleet import IPC_PATH_MAX, private_dir

    deep = tmp_path / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    names = ["prefill-0", "decode-0"]
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    made = private_dir(names)
    try:
        assert Path(made).parent == Path("/tmp") and len(made) + len("/decode-0-prefill-0") <= IPC_PATH_MAX
        assert os.stat(made).st_mode & 0o777 == 0o700 and list(deep.iterdir()) == []
    finally:
        os.rmdir(made)
    short = tempfile.mkdtemp(prefix="pdkt-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", short)
    try:
        near = private_dir(names)
        assert Path(near).parent == Path(short)  # a short TMPDIR is kept
    finally:
        shutil.rmtree(short)


def test_workers_switch_roles_mid_run_scripted_or_by_the_planner_and_no_request_fails(tmp_path):
    """Elastic roles on 1 prefill + 2 decode workers, beside a colocated run of the same requests.
    Scripted (deployment.planner.switches): decode-1 turns prefill while requests stream on it (they go
    on on decode-0, after their tokens so far), then prefill-0 turns decode once no decode worker has
    anything in flight there. By the planner (enabled, looking every 0.3 s; a TTFT SLO no prompt meets, a
    TPOT SLO every step meets): one decode worker moves to prefill and no further (min_decode), the
    events saying why. Both: every request finishes with the colocated run's greedy tokens, each switch
    is an event and a move with its time, and every page is free on every worker after, whichever roles
    they ended in."""
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
        "{name: scripted, kind: disaggregated, num_prefill: 1, num_decode: 2,"
        " planner: {switches: [[0.3, decode-1, prefill], [0.8, prefill-0, decode]]}},"
        "{name: planned, kind: disaggregated, num_prefill: 1, num_decode: 2,"
        " planner: {enabled: true, interval_s: 0.3, patience: 1, min_decode: 1}}]"
    ]
    reference, scripted, planned = run(_cfg(overrides), tmp_path, progress=False)
    for elastic in (scripted, planned):
        s = elastic["summary"]
        assert s["completed"] == 24 and s["errors"] == 0, elastic["requests"]
        assert _outputs(elastic) == _outputs(reference)
        assert all(t["free_pages"] == t["num_pages"] for t in elastic["timelines"])
    moves = scripted["role_moves"]
    assert [(m["worker"], m["from"], m["to"]) for m in moves] == [
        ("decode-1", "decode", "prefill"),
        ("prefill-0", "prefill", "decode"),
    ], scripted["events"]
    assert all(m["seconds"] < 5 for m in moves), moves
    assert scripted["summary"]["migrations"] > 0  # decode-1 handed requests back mid-stream
    assert {t["name"]: t["role"] for t in scripted["timelines"]} == {
        "prefill-0": "decode",
        "decode-0": "decode",
        "decode-1": "prefill",
    }
    assert "prefill-0" in {r["worker"] for r in scripted["requests"]}  # it decoded after its switch
    log = (tmp_path / "logs" / "scripted" / "decode-1.log").read_text()
    assert "switched from decode to prefill" in log
    moves = planned["role_moves"]
    assert len(moves) == 1 and moves[0]["from"] == "decode" and moves[0]["to"] == "prefill", moves
    assert moves[0]["why"].startswith("TTFT at ") and "x its SLO" in moves[0]["why"]


def test_the_prefill_budget_auto_is_picked_by_what_computes_the_step(monkeypatch):
    """deployment.chunk_size=auto (the default): vLLM's CPU budget on AVX-512 BF16 or AMX CPUs running a
    bf16 model, 1,024 on a CPU in fp32, each where it was measured better; 512 on a GPU or in bf16 on a
    CPU without bf16 compute."""
    from experiments.deploy.config import DeploymentConfig, prefill_budget
    from pdkernels import cpu

    assert DeploymentConfig(name="d").chunk_size == "auto"
    for native, device, dtype, want in [
        (True, "cpu", "bfloat16", 2048),
        (True, "cpu", "float32", 1024),
        (False, "cpu", "float32", 1024),
        (True, "cuda", "bfloat16", 512),
        (True, "cuda", "float32", 512),
        (False, "cpu", "bfloat16", 512),
    ]:
        monkeypatch.setattr(cpu, "native_bf16", lambda native=native: native)
        assert prefill_budget("auto", device, dtype) == want, (native, device, dtype)
        assert prefill_budget(300, device, dtype) == 300  # a number is kept as it is
