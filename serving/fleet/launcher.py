"""Launchers start a deployment's workers and say whether each is still alive; everything above them
(the runtime's routing, the control plane, KV over NIXL) is the same for both.

- `local`: one process per worker on this host (each starts its own TP ranks), forked from
  multiprocessing's fork server, a fresh interpreter that imported torch and read the built-in models'
  tokenizer GGUF once (serving/fleet/preload.py: a worker then starts without either, 4.2 s of CPU
  each on an AVX2 EPYC), given the environment of its launch; a dead
  one is started again up to `launcher.max_restarts` times (0 by default), a decode worker too: the
  driver hands its new control addresses to the prefill workers, which connect to it afresh.
- `ray`: one Ray actor per worker, each in its own placement group (one bundle: the worker and its TP
  ranks, which it starts as its own processes, on one node), placed by role: on a node with the role's
  custom resource (`ray.role_resources`), or on the node `ray.node_ids` names. The driver and the workers
  still talk over our control plane (tcp://, CURVE); each worker binds on its node's address. Ray is told
  to restart a dead prefill or colocated worker `ray.max_restarts` times; the runtime then runs it again
  and it re-handshakes (a decode worker is not restarted: its prefill peers hold its old addresses).

- `netns` (serving/fleet/netns_launch.py): as `local`, or with `cluster.ray` as `ray` with a Ray
  node per host, each worker inside a host of this machine (a network namespace with shaped links:
  serving/fleet/netns.py), its control sockets on its host's address and its KV over its NICs.

A worker handle answers like multiprocessing.Process: is_alive(), exitcode, pid, join(), kill().
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
from dataclasses import replace

from engine.forking import fork_context
from serving.config import RayConfig, launcher_of
from serving.fleet.procs import die_with
from serving.worker import WorkerSpec, worker_main

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"


def _fork_server():
    """multiprocessing's fork server, torch and the tokenizer imported in it once (engine/forking.py)."""
    return fork_context(["serving.fleet.preload"])


def start_fork_server(cfg) -> None:
    """With the local launcher (cfg: the job's hydra config), start the fork server now, in the
    background: its preload (torch, 3 s of CPU here) then runs beside the caller's own start-up (which
    imports torch too) instead of after it, when the first worker is forked (that waits, under
    multiprocessing's lock, until the server is up). Once per process."""
    from multiprocessing import forkserver

    if launcher_of(cfg).name != "local":
        return
    _fork_server()
    threading.Thread(target=forkserver.ensure_running, name="fork-server-start", daemon=True).start()


def stop_fork_server() -> None:
    """Stop multiprocessing's fork server and its resource tracker now and wait for them (each would
    leave only when this process's end of its socket or pipe closes at exit, up to 1-2 s after the
    process itself: a caller that waits for a process group to be gone saw them outlive the server).
    Their children are stopped by then."""
    from multiprocessing import forkserver, resource_tracker

    try:
        forkserver._forkserver._stop()  # CPython's own tests stop it so (3.8-3.13)
    except (AttributeError, OSError, ChildProcessError) as e:
        log.warning("could not stop the fork server: %r", e)
    tracker = resource_tracker._resource_tracker
    try:
        if hasattr(tracker, "_stop"):  # 3.12 on
            tracker._stop()
        elif getattr(tracker, "_fd", None) is not None:  # 3.11: what _stop does (EOF on its pipe ends it)
            os.close(tracker._fd)
            os.waitpid(tracker._pid, 0)
            tracker._fd = tracker._pid = None
    except (AttributeError, OSError, ChildProcessError) as e:
        log.warning("could not stop the resource tracker: %r", e)


def _local_main(spec: WorkerSpec, env: dict[str, str], owner: int) -> None:
    """A local worker, forked from the fork server: it ends with the job that launched it (owner: its
    pid; the fork server is its parent), then takes the environment it was launched in (the server's is
    from when it started), then its host's network namespace (launcher=netns), then worker_main."""
    die_with(owner, f"worker {spec.name}")
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # TMPDIR read afresh
    _enter_host(spec)
    worker_main(spec)


def _enter_host(spec: WorkerSpec) -> None:
    """A worker on a netns host: into its network namespace (a no-op for a Ray actor of that host's node,
    started inside it), and UCX on TCP over the host's NICs alone (no shared memory, no CMA: the link
    carries the KV)."""
    if spec.netns is not None:
        from serving.fleet.netns import enter

        enter(spec.netns)
        os.environ.update(UCX_TLS="tcp", UCX_NET_DEVICES=spec.transfer.nixl_devices)


class LocalWorker:
    """One worker as a process of this host; rerun() starts it again (a restart)."""

    def __init__(self, ctx, spec: WorkerSpec):
        self.spec, self._ctx, self.restarts = spec, ctx, 0
        self.proc = None
        self._start()

    def _start(self) -> None:
        args = (self.spec, dict(os.environ), os.getpid())
        self.proc = self._ctx.Process(target=_local_main, args=args, name=self.spec.name)
        self.proc.start()  # not a daemon: a worker with TP > 1 starts its own rank processes

    def rerun(self) -> None:
        self.proc.join(timeout=0)
        self.restarts += 1
        self._start()

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    @property
    def exitcode(self) -> int | None:
        return self.proc.exitcode

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self.proc.join(timeout)

    def kill(self) -> None:
        self.proc.kill()


class LocalLauncher:
    """Workers as processes of this host."""

    def __init__(self, control_host: str = LOOPBACK, max_restarts: int = 0):
        self._control_host, self.max_restarts = control_host, max_restarts

    def control_host(self) -> str:
        """Where the runtime binds its tcp:// control socket (transfer.control_host)."""
        return self._control_host

    def start(self, specs: list[WorkerSpec]) -> dict[str, LocalWorker]:
        ctx = _fork_server()
        return {s.name: LocalWorker(ctx, s) for s in specs}

    def where(self, worker: LocalWorker) -> dict:
        return {"node_id": socket.gethostname(), "pid": worker.pid}

    def restart(self, name: str, worker: LocalWorker) -> bool:
        """Start a dead worker again, if it has restarts left (launcher.max_restarts)."""
        if worker.restarts >= self.max_restarts:
            return False  # it stays dead; the deployment serves with the others
        log.warning("restarting worker %s (restart %d of %d)", name, worker.restarts + 1, self.max_restarts)
        worker.rerun()
        return True

    def shutdown(self, workers=None) -> None:
        pass  # Fleet.stop has stopped the processes


class RayWorker:
    """One worker as a Ray actor: alive while its run() call has not returned."""

    def __init__(self, name: str, actor, spec: WorkerSpec, group, node_id: str, pid: int):
        self.name, self.actor, self.spec, self.group = name, actor, spec, group
        self.node_id, self.pid = node_id, pid
        self.restarts = 0
        self._run = actor.run.remote(spec)
        self._where = None  # after a restart: the new process's (node id, pid), once it answers
        self._exitcode: int | None = None

    def is_alive(self) -> bool:
        import ray

        if self._run is None:  # restarting: run() goes once the restarted actor answered where()
            self.where()
        if self._exitcode is None and self._run is not None and ray.wait([self._run], timeout=0)[0]:
            try:
                ray.get(self._run)
                self._exitcode = 0
            except Exception as e:  # the actor died (killed, its node lost): RayActorError and kin
                log.warning("worker %s (Ray actor) ended: %s", self.name, type(e).__name__)
                self._exitcode = 1
        return self._exitcode is None

    @property
    def exitcode(self) -> int | None:
        self.is_alive()
        return self._exitcode

    def rerun(self) -> None:
        """Run the worker again on its restarted actor. Ray fails a call sent while the actor is still
        restarting ("The actor is restarting": ActorUnavailableError) unless the call may be retried; a
        driver that learns of the death before the new process is up sends it then (under load, it
        did: the run() failed, nothing noticed, and the decode worker held its requests for a restart
        that never came). So where() goes with retries (it only answers) and run(), which must run at
        most once, goes when where() has answered: the actor is back."""
        self.restarts += 1
        self._exitcode = None
        self._where = self.actor.where.options(max_task_retries=-1).remote()
        self._run = None

    def where(self) -> dict:
        import ray

        if self._where is not None and ray.wait([self._where], timeout=0)[0]:
            try:
                self.node_id, self.pid = ray.get(self._where)
                if self._run is None:
                    self._run = self.actor.run.remote(self.spec)
            except Exception as e:  # it died for good (no restart left) before it answered
                log.warning("worker %s did not come back: %s", self.name, type(e).__name__)
                if self._run is None:
                    self._exitcode = 1
            self._where = None
        return {"node_id": self.node_id, "pid": self.pid}

    def join(self, timeout: float | None = None) -> None:
        import ray

        ray.wait([self._run], timeout=timeout)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


class _Actor:
    """The Ray actor a worker runs in (made a Ray remote class in RayLauncher)."""

    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def run(self, spec: WorkerSpec) -> None:
        import ray

        # the control sockets this worker binds (a decode worker's, for its prefill peers) go on this
        # node's address: other nodes connect to it
        host = ray.util.get_node_ip_address()
        if (nice := os.getpriority(os.PRIO_PROCESS, 0)) > 0:  # a cluster not ours: Ray's worker_niceness
            try:
                os.setpriority(os.PRIO_PROCESS, 0, 0)
            except OSError:  # raising a priority needs CAP_SYS_NICE
                log.warning(
                    "worker %s serves at nice %d (Ray's worker_niceness): start the cluster with "
                    "RAY_worker_niceness=0 for full priority",
                    spec.name,
                    nice,
                )
        _enter_host(spec)
        worker_main(replace(spec, transfer=replace(spec.transfer, control_host=host)))


_cluster = None  # the local cluster this process started (ray.local_nodes), shut down at exit
_token_dir = None  # ... and the private folder of its authentication token
_auth_before: dict[str, str | None] = {}  # the authentication variables as they were before use_token
_shape = None  # what connect() connected this process to: (address, local nodes, CPUs each, role resources)


def _shape_of(cfg: RayConfig) -> tuple:
    if cfg.address is not None:
        return (cfg.address,)
    roles = tuple(sorted((str(k), str(v)) for k, v in cfg.role_resources.items()))
    return (None, cfg.local_nodes, cfg.cpus_per_node, roles)


AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def use_token(folder: str) -> None:
    """Token authentication for a cluster this process starts: a fresh token in a file only its owner
    reads (folder/auth_token, 0600), named in this process's environment, which the nodes it starts, their
    workers and this driver all read; no process joins without it. Ray turns token auth on by itself for
    `ray start --head` when ~/.ray/auth_token exists (a user's, or one an earlier ray.init wrote) but not
    for a node that joins: with one there, the netns cluster's second node was refused (InvalidAuthToken).
    Set here, nothing in the user's home decides it."""
    path = os.path.join(folder, "auth_token")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(secrets.token_hex(32))
    _auth_before.update((var, os.environ.get(var)) for var in AUTH_VARS if var not in _auth_before)
    os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=path)
    _reload_auth()


def drop_token() -> None:
    """This process's cluster is gone: its token goes, and the variables are as they were before."""
    for var, value in _auth_before.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    _auth_before.clear()
    _reload_auth()


def _reload_auth() -> None:
    """Ray reads the mode and the token once per process and caches them: read them again (what Ray's own
    tests do between clusters)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def connect(cfg: RayConfig) -> None:
    """ray.init once per process: to cfg.address, or to a local cluster of cfg.local_nodes nodes on
    127.0.0.1 (node 0 has the prefill resource, the others the decode one; every node the colocated
    one, if set). Connected already to another cluster than cfg asks for (another address, or a local one
    of other nodes), this process leaves it first: a run placed on the wrong cluster waits for room it
    never gets. Connected by someone else (ray.init), it stays."""
    global _cluster, _shape
    import ray

    if ray.is_initialized() and _shape in (None, _shape_of(cfg)):
        return
    if ray.is_initialized():
        log.warning("leaving the Ray cluster this process used (%s) for the one asked for now", _shape)
        disconnect()
    _shape = _shape_of(cfg)
    if cfg.address is not None:
        ray.init(address=cfg.address, log_to_driver=False)
        return
    # Ray turns 127.0.0.1 into this host's network address unless it runs as a one-machine cluster: keep
    # every node, the driver and the workers on loopback. The setting is read when ray is imported
    # (this process may have imported it already; the nodes' processes inherit the variable)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    ray_constants.ENABLE_RAY_CLUSTER = False
    global _token_dir
    _token_dir = tempfile.mkdtemp(prefix="pdk-ray-auth-")
    use_token(_token_dir)

    roles = cfg.role_resources
    cluster = Cluster()
    for i in range(cfg.local_nodes):
        if cfg.local_nodes == 1:  # one node takes every role
            names = roles.values()
        else:
            names = (roles.get("prefill" if i == 0 else "decode"), roles.get("colocated"))
        resources = {r: 1000 for r in names if r}
        # Ray runs its workers at nice 15, for its own daemons' sake: beside anything else on the
        # machine (a second test run) an actor then took over 2 minutes to import its module. Ours are
        # the serving workers: nice 0 (the head's setting is the cluster's)
        head = {"_system_config": {"worker_niceness": 0}} if i == 0 else {}
        cluster.add_node(
            num_cpus=cfg.cpus_per_node,
            resources=resources,
            node_ip_address=LOOPBACK,
            include_dashboard=False,
            **head,
        )
    _cluster = cluster
    atexit.register(disconnect)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()


def disconnect() -> None:
    global _cluster, _shape, _token_dir
    import ray

    _shape = None
    ray.shutdown()
    if _cluster is not None:
        _cluster.shutdown()
        _cluster = None
        # the one-machine setting goes with its cluster: a multi-node one started later in this process
        # (launcher=netns with Ray) must not inherit it (its nodes' `ray start` refused to join)
        from ray._private import ray_constants

        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        ray_constants.ENABLE_RAY_CLUSTER = not ray_constants.IS_WINDOWS_OR_OSX
    if _token_dir is not None:  # after its nodes: they read the token until they are gone
        drop_token()
        shutil.rmtree(_token_dir, ignore_errors=True)
        _token_dir = None


class RayLauncher:
    """Workers as Ray actors, one placement group each, placed by role or by node id."""

    def __init__(self, cfg: RayConfig):
        self.cfg = cfg

    def control_host(self) -> str:
        """The driver's node address as Ray knows it: workers on other nodes connect to it."""
        import ray

        connect(self.cfg)
        return ray.util.get_node_ip_address()

    def start(self, specs: list[WorkerSpec]) -> dict[str, RayWorker]:
        import ray
        from ray.util.placement_group import placement_group

        connect(self.cfg)
        actor_class = ray.remote(_Actor)
        groups, workers = {}, {}
        try:
            for s in specs:
                if s.name in self.cfg.node_ids:
                    continue  # placed on the node named (_where)
                bundle = {"CPU": s.deployment.threads_per_worker * s.tp * s.dp}
                resource = self.cfg.role_resources.get(s.role)
                if resource:
                    bundle[resource] = 0.001  # a node that takes this role
                groups[s.name] = placement_group([bundle], strategy="STRICT_PACK")
            ready = [g.ready() for g in groups.values()]
            done, _ = ray.wait(ready, num_returns=len(ready), timeout=self.cfg.start_timeout_s)
            if len(done) < len(ready):
                raise TimeoutError(
                    f"Ray could not place every worker within ray.start_timeout_s={self.cfg.start_timeout_s}"
                    f": each needs a node with threads_per_worker x tp CPUs and its role's resource "
                    f"(ray.role_resources={dict(self.cfg.role_resources)}); cluster: "
                    f"{ray.cluster_resources()}"
                )
            for s in specs:
                actor = actor_class.options(
                    num_cpus=s.deployment.threads_per_worker * s.tp * s.dp,
                    max_restarts=self.cfg.max_restarts if s.role.restartable else 0,
                    scheduling_strategy=self._where(s, groups.get(s.name)),
                ).remote()
                node_id, pid = ray.get(actor.where.remote(), timeout=self.cfg.start_timeout_s)
                workers[s.name] = RayWorker(s.name, actor, s, groups.get(s.name), node_id, pid)
        except BaseException:
            self.shutdown(workers)  # their actors and groups
            for name, g in groups.items():
                if name not in workers:
                    ray.util.remove_placement_group(g)
            raise
        return workers

    def _where(self, spec: WorkerSpec, group):
        """Its placement group (one bundle: its CPUs on a node with its role's resource), or the node
        ray.node_ids names for it."""
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        if spec.name in self.cfg.node_ids:
            return NodeAffinitySchedulingStrategy(self.cfg.node_ids[spec.name], soft=False)
        return PlacementGroupSchedulingStrategy(group)

    def where(self, worker: RayWorker) -> dict:
        return worker.where()

    def restart(self, name: str, worker: RayWorker) -> bool:
        """Run a dead worker again if Ray may still restart its actor."""
        if worker.restarts >= self.cfg.max_restarts or not worker.spec.role.restartable:
            return False  # a restarted decode worker would need new addresses at its prefill peers
        log.warning(
            "restarting worker %s (restart %d of %d)", name, worker.restarts + 1, self.cfg.max_restarts
        )
        worker.rerun()
        return True

    def shutdown(self, workers: dict[str, RayWorker] | None = None) -> None:
        import ray

        for w in (workers or {}).values():
            try:
                w.kill()
                if w.group is not None:
                    ray.util.remove_placement_group(w.group)
            except Exception as e:  # already gone
                log.debug("cleaning up %s: %s", w.name, e)
