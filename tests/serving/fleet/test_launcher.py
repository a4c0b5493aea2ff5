"""The ray launcher on a local two-node Ray cluster (1 CPU each, every address 127.0.0.1): 1P1D with the
prefill worker on one node and the decode worker on the other, KV over NIXL between them."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray  # make test installs it: missing, this module fails
from hydra import compose, initialize_config_dir

from tests import needs
from tests.waits import until

needs.nixl()

from experiments.run import run  # noqa: E402
from serving.config import RayConfig  # noqa: E402
from serving.fleet import launcher  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TINY = ["model=tiny-random", "workload.arrival=concurrency", "workload.concurrency=2", "plots=false"]
TINY += ["workload.prompt_len.kind=uniform", "workload.prompt_len.low=2", "workload.prompt_len.high=40"]
TINY += ["workload.output_len.value=8", "start_timeout_s=600", "run_timeout_s=600"]
RAY = ["launcher=ray", "ray.local_nodes=2"]
RAY_S = 600.0  # how long a wait on Ray may take before it counts as a hang (a ceiling, not a speed check)


@pytest.fixture(scope="module", autouse=True)
def _one_cluster_then_gone(tmp_path_factory):
    """The in-process runs share one local cluster; it is shut down after this module. The user has a Ray
    token of their own (planted: RAY_AUTH_TOKEN_PATH, as ~/.ray/auth_token that Ray's ray.init writes):
    each cluster uses its own, and the user's setting is back after."""
    token = tmp_path_factory.mktemp("user") / "auth_token"
    token.write_text("f" * 64)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_TOKEN_PATH", str(token))
        env.delenv("RAY_AUTH_MODE", raising=False)
        env.delenv("RAY_AUTH_TOKEN", raising=False)
        yield
        launcher.disconnect()
        assert os.environ.get("RAY_AUTH_TOKEN_PATH") == str(token) and "RAY_AUTH_MODE" not in os.environ


def _cfg(overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose("config", overrides=overrides)


def _outputs(record):
    return {r["request_id"]: r["output_ids"] for r in record["requests"]}


def _pages_free_at_stop(log_file: Path) -> tuple[int, int]:
    found = re.search(r"stopped by the driver \((\d+) of (\d+) pages free\)", log_file.read_text())
    return int(found[1]), int(found[2])


@pytest.mark.slow  # make test-all: Ray across nodes is make test's in test_netns.py (a node per host)
def test_1p1d_across_two_nodes_from_the_command_line_gives_the_colocated_tokens(tmp_path):
    deployments = (
        "deployments=[{name: colocated, kind: colocated, num_workers: 1},"
        "{name: 1p1d, kind: disaggregated, num_prefill: 1, num_decode: 1}]"
    )
    args = [sys.executable, "-m", "experiments.run", *TINY, *RAY, "workload.num_requests=6", deployments]
    done = subprocess.run(
        [*args, f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=850
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    colocated, disagg = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert disagg["summary"]["completed"] == 6 and disagg["summary"]["remote_prefills"] > 0
    assert _outputs(disagg) == _outputs(colocated)
    workers = {w["name"]: w for w in disagg["workers"]}
    assert set(workers) == {"prefill-0", "decode-0"}
    assert workers["prefill-0"]["node_id"] != workers["decode-0"]["node_id"]  # the roles' two nodes
    assert all(w["pid"] > 0 and w["role"] == n.split("-")[0] for n, w in workers.items())
    assert colocated["workers"][0]["node_id"] in {w["node_id"] for w in workers.values()}


@pytest.mark.slow  # make test-all: a second local Ray cluster started and stopped
def test_a_run_that_asks_for_another_local_cluster_gets_it():
    """This process connected to a one-node cluster; a config that asks for two nodes leaves it for a new
    one (it used to keep the first, where a run placing two roles on two nodes waited for room)."""
    launcher.connect(RayConfig(local_nodes=1))
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 1
        launcher.connect(RayConfig(local_nodes=2))
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        launcher.connect(RayConfig(local_nodes=2))  # the same again: kept
        assert launcher._cluster is not None and len([n for n in ray.nodes() if n["Alive"]]) == 2
    finally:
        launcher.disconnect()


def test_the_local_clusters_workers_serve_at_full_priority():
    """Ray starts its workers at nice 15: beside a busy machine (the rest of the suite) an actor took over
    two minutes to import its module and the command line's run above failed. The local cluster's are
    at nice 0, as a worker process of the local launcher is."""
    launcher.connect(RayConfig(local_nodes=1))
    try:
        niceness = ray.remote(num_cpus=0)(lambda: os.getpriority(os.PRIO_PROCESS, 0))
        assert ray.get(niceness.remote(), timeout=600) == 0
    finally:  # one node, one CPU: a later test here that wants two nodes would find this one and wait
        launcher.disconnect()  # (the killed-prefill-actor test did: nowhere to place its decode worker)


def test_a_worker_whose_actor_restarts_slower_than_the_driver_notices_runs_again(tmp_path):
    """Ray fails a call sent to an actor that is still restarting (ActorUnavailableError: "The actor is
    restarting") unless the call may be retried. Beside the rest of the slow tests the restarted prefill
    actor took longer to come up than the driver took to see its death, rerun()'s run() failed, nothing
    noticed, and the decode worker held every request for a restart that never came. Here the restart
    waits on a gate the test opens only after rerun(): the worker runs again, seen alive throughout."""
    gate, ran, began = tmp_path / "gate", tmp_path / "ran", tmp_path / "restart-began"

    class SlowToRestart:  # launcher._Actor's two calls; defined here so that Ray ships it by value
        def __init__(self):
            if ray.get_runtime_context().was_current_actor_reconstructed:
                began.write_text(str(os.getpid()))
                while not gate.exists():
                    time.sleep(0.01)

        def where(self):
            return ray.get_runtime_context().get_node_id(), os.getpid()

        def run(self, spec):
            with open(ran, "a") as f:
                f.write(f"{os.getpid()}\n")
            while True:  # a worker serves until it is stopped (here: killed)
                time.sleep(1)

    launcher.connect(RayConfig(local_nodes=1))
    actor = ray.remote(num_cpus=0, max_restarts=1)(SlowToRestart).remote()
    try:
        node_id, pid = ray.get(actor.where.remote(), timeout=600)
        worker = launcher.RayWorker("prefill-0", actor, "spec", None, node_id, pid)
        until(lambda: ran.exists() and ran.read_text().split() == [str(pid)], "the first run", RAY_S)
        os.kill(pid, signal.SIGKILL)
        until(lambda: not worker.is_alive(), "the death to be seen", RAY_S)
        until(began.exists, "Ray to begin the restart", RAY_S)  # the new process up, the actor not yet back
        worker.rerun()
        assert worker.is_alive()
        gate.write_text("")

        def ran_again():
            assert worker.is_alive(), "the run on the restarted actor failed"
            return len(ran.read_text().split()) == 2

        until(ran_again, "the run on the restarted actor", RAY_S)
        assert worker.where()["pid"] == int(began.read_text()) == int(ran.read_text().split()[1])
        assert worker.is_alive() and worker.exitcode is None
    finally:
        ray.kill(actor, no_restart=True)
        launcher.disconnect()


@pytest.mark.slow  # make test-all; make test keeps the restart under the local launcher (test_run.py)
def test_a_killed_prefill_actor_loses_no_request_frees_decode_pages_and_comes_back(tmp_path):
    """SIGKILL the prefill actor after the first result: the requests it had in flight are not lost but
    prefilled again (Runtime._prefill_again: a prefill worker's death loses nothing; this test, older than
    that, expected them to fail), the decode worker frees the pages their cut transfers held; Ray
    restarts the actor (max_restarts 1), it re-handshakes, and every later request, held by the decode
    worker meanwhile, is prefilled by it."""
    overrides = [*TINY, *RAY, "deployment=1p1d", "ray.max_restarts=1", "workload.num_requests=12"]
    overrides += ["workload.prompt_len.kind=fixed", "workload.prompt_len.value=200"]
    overrides += ["deployment.chunk_size=8"]  # 25 passes a prompt: 50 ms after the first result, the next
    killed, first, resent = [], [], []  # two are mid-transfer

    def kill_prefill_after_first_result(run_state, runtime):
        procs = runtime.fleet.procs
        if run_state.results and not first:
            first.append(time.monotonic())
        if first and not killed and time.monotonic() > first[0] + 0.05:
            os.kill(procs["prefill-0"].pid, signal.SIGKILL)  # the actor's process: as if it crashed
            killed.append(len(run_state.results))
        resent[:] = [runtime.prefill_resent]

    (rec,) = run(_cfg(overrides), tmp_path, progress=False, hooks=kill_prefill_after_first_result)
    s = rec["summary"]
    errors = [r["error"] for r in rec["requests"] if r["error"]]
    assert killed and killed[0] < 12 and s["num_requests"] == 12, rec["events"]
    assert not errors and s["completed"] == 12, errors
    assert resent[0] >= 1  # the ones in flight when it died, sent again
    assert all(r["prefill"] == "remote" for r in rec["requests"])
    events = [what for _, what in rec["events"]]
    assert any("prefill-0 exited" in e and "restarting" in e for e in events), events
    assert "prefill-0 back after a restart" in events, events
    free, total = _pages_free_at_stop(tmp_path / "logs" / "1p1d" / "decode-0.log")
    assert free == total  # every decode page came back, the cut transfers' too


@pytest.mark.slow
def test_the_http_server_serves_1p1d_across_two_nodes(tmp_path):
    """experiments.serve with launcher=ray, no other change: a completion prefilled on the other node.
    (slow: the server starts its fleet as the main job does, whose Ray runs make test keeps.)"""
    from engine import LLM, SamplingParams
    from tests.experiments.serving import _metrics, _start, _stop

    openai = pytest.importorskip("openai")
    proc, url = _start(tmp_path, "deployment=1p1d", *RAY)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        # temperature 0: the server's default is OpenAI's 1.0, the reference below is greedy
        got = client.completions.create(
            model="tiny-random", prompt="The capital of France is", max_tokens=6, temperature=0
        )
        want = LLM("tiny-random").generate(["The capital of France is"], SamplingParams(max_tokens=6))[0]
        assert got.choices[0].text == want.text
        metrics = _metrics(url)
        assert metrics[("pdk_prefills_total", (("where", "remote"),))] == 1
    finally:
        _stop(proc)  # the server, its actors and its local cluster: nothing of its group left


@pytest.mark.slow
def test_tp_1_to_2_across_two_nodes_gives_the_colocated_tokens(tmp_path):
    """Prefill TP 1 on node 0, decode TP 2 on node 1 (2 CPUs each: a new local cluster)."""
    launcher.disconnect()
    deployments = (
        "deployments=[{name: colocated, kind: colocated, num_workers: 1},"
        "{name: 1p1d-tp1-2, kind: disaggregated, num_prefill: 1, num_decode: 1, decode_tp: 2}]"
    )
    overrides = [*TINY, *RAY, "ray.cpus_per_node=2", "workload.num_requests=6", deployments]
    colocated, disagg = run(_cfg(overrides), tmp_path, progress=False)
    assert disagg["summary"]["completed"] == 6 and _outputs(disagg) == _outputs(colocated)
    workers = {w["name"]: w for w in disagg["workers"]}
    assert workers["prefill-0"]["node_id"] != workers["decode-0"]["node_id"]
    launcher.disconnect()


@pytest.mark.parametrize(
    "override, message",
    [
        ("ray.max_restarts=-1", "ray.max_restarts=-1 is not allowed: an integer >= 0"),
        ("ray.local_nodes=0", "ray.local_nodes=0 is not allowed: must be an integer > 0"),
        ("+ray.role_resources.router=x", "keys among ('colocated', 'prefill', 'decode'); got ['router']"),
        ("+ray.nodes=3", "ray has unknown key(s) ['nodes']"),
    ],
)
def test_bad_ray_settings_fail_before_any_cluster_starts(tmp_path, override, message):
    with pytest.raises(ValueError) as err:
        run(_cfg(["model=tiny-random", "launcher=ray", override]), tmp_path, progress=False)
    assert message in str(err.value)
