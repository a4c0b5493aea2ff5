"""Launchers of workers on hosts in network namespaces on this machine (launcher=netns; the hosts:
serving/fleet/netns.py): each worker a process inside its host (`NetnsLauncher`), or, with
cluster.ray, a Ray actor on a Ray node started inside its host (`NetnsRayLauncher`). Either way worker i
runs on host i % cluster.hosts, binds its control sockets on that host's address and moves its KV over
that host's NICs, and results.json records each host's NIC counters and TCP retransmits.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace

from serving.config import RayConfig
from serving.fleet.launcher import (
    LOOPBACK,
    LocalLauncher,
    LocalWorker,
    RayLauncher,
    RayWorker,
    _Actor,
    connect,
    drop_token,
    use_token,
)
from serving.worker import WorkerSpec


class NetnsLauncher(LocalLauncher):
    """Workers as processes of this host, each inside a host of its own (a network namespace joined to
    the others by a shaped link: serving/fleet/netns.py). Worker i runs on host i % cluster.hosts,
    binds its control sockets on that host's address (tcp://, CURVE) and sends or receives KV on its NIC
    (UCX over TCP alone). The driver stays in this namespace and reaches the workers through the run's
    private directory (ipc://), as under `local`."""

    def __init__(self, cluster, max_restarts: int = 0):
        from serving.fleet.netns import Hosts, Link

        super().__init__(LOOPBACK, max_restarts)
        self.hosts = Hosts(cluster.hosts, Link(**cluster.link), cluster.nics_per_host, cluster.subnet)
        self._host: dict[str, int] = {}  # worker -> its host

    def start(self, specs: list[WorkerSpec]) -> dict[str, LocalWorker]:
        return super().start(_place(self.hosts, self._host, specs))

    def where(self, worker: LocalWorker) -> dict:
        return {"pid": worker.pid, **_host_of(self.hosts, self._host[worker.spec.name])}

    def shutdown(self, workers=None) -> None:
        self.hosts.close()  # the namespaces, their links, and anything still running in them


def _place(hosts, placed: dict[str, int], specs: list[WorkerSpec]) -> list[WorkerSpec]:
    """Worker i on host i % hosts (placed: name -> host), its control sockets on that host's address,
    its KV on that host's NICs: its ranks share them out (rank r: NICs r, r + ranks, ...; one rank: every
    NIC), as transfer.nics_per_rank would say, unless that says otherwise."""
    out = []
    for i, spec in enumerate(specs):
        host = i % len(hosts.names)
        placed[spec.name] = host
        names = [hosts.nic(host, k) for k in range(hosts.nics)]
        ranks = spec.tp * spec.dp
        per_rank = spec.transfer.nics_per_rank or tuple(
            ",".join(names[r::ranks] or names[r % len(names) :: len(names)]) for r in range(ranks)
        )
        t = replace(
            spec.transfer,
            control_transport="tcp",
            control_host=hosts.address(host),
            nixl_devices=",".join(names),
            nics_per_rank=per_rank if len(names) > 1 else spec.transfer.nics_per_rank,
        )
        out.append(replace(spec, transfer=t, netns=hosts.names[host]))
    return out


def _host_of(hosts, host: int) -> dict:
    """A host, and its NIC byte counters and TCP retransmits now (what crossed its links so far)."""
    counters = [hosts.counters(host, k) for k in range(hosts.nics)]
    return {
        "node_id": hosts.names[host],
        "address": hosts.address(host),
        "nic_tx_bytes": [tx for tx, _ in counters],
        "nic_rx_bytes": [rx for _, rx in counters],
        "tcp_retransmits": hosts.retransmits(host),
        "link_delayed_by": hosts.delay_by,  # netem, the switch's wire (netns_wire), or None: no delay
    }


def _sweep_ray_temps() -> None:
    """Remove the Ray folders of NetnsRayLaunchers whose process is gone (SIGKILLed before shutdown)."""
    import glob

    from serving.fleet.netns import alive

    for folder in glob.glob(os.path.join(tempfile.gettempdir(), "pdk-ray-*-*")):
        owner = os.path.basename(folder).split("-")[2]
        if owner.isdigit() and not alive(int(owner)):
            shutil.rmtree(folder, ignore_errors=True)


class NetnsRayLauncher(RayLauncher):
    """launcher=netns with cluster.ray: a Ray node per host (`ray start` inside its namespace, on its
    address, with a resource pdk_host_<i>), the head on host 0, where the driver's thread joins it (a Ray
    driver connects from a node of its cluster), and each worker a Ray actor on its host's node, placed as
    under netns (worker i on host i % hosts). shutdown() leaves Ray, takes the driver's thread back to its
    own namespace and removes the hosts, with every Ray process in them."""

    PORT = 6379

    def __init__(self, cluster, cfg: RayConfig, max_restarts: int = 0):
        import subprocess
        import sys

        from serving.fleet.netns import Hosts, Link, switch_thread

        self.hosts = Hosts(cluster.hosts, Link(**cluster.link), cluster.nics_per_host, cluster.subnet)
        self._host: dict[str, int] = {}
        self._left = None
        head = f"{self.hosts.address(0)}:{self.PORT}"
        super().__init__(replace(cfg, address=head, max_restarts=max_restarts))
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        _sweep_ray_temps()
        # short (Ray's socket paths live under it), and named by its owner: a SIGKILLed one's goes next time
        self._temp = tempfile.mkdtemp(prefix=f"pdk-ray-{os.getpid()}-")
        use_token(self._temp)  # every node, its workers and this driver: one token of this cluster's
        # a multi-node cluster, whatever a one-machine cluster of this process set (serving.fleet.launcher)
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1")
        try:
            for i in range(len(self.hosts.names)):
                node = [ray, "start", f"--node-ip-address={self.hosts.address(i)}", "--num-cpus=64",
                        f'--resources={{"pdk_host_{i}": 1000}}']  # fmt: skip
                first = [
                    "--head",
                    f"--port={self.PORT}",
                    f"--temp-dir={self._temp}",
                    "--include-dashboard=false",
                ]
                node += first if i == 0 else [f"--address={head}"]
                done = subprocess.run(self.hosts.command(i, node), capture_output=True, text=True, env=env,
                                      timeout=cfg.start_timeout_s)  # fmt: skip
                if done.returncode:
                    raise RuntimeError(f"ray start on host {i} failed: {done.stderr.strip()[-2000:]}")
            self._left = switch_thread(self.hosts.names[0])
        except BaseException:
            self.hosts.close()
            drop_token()
            shutil.rmtree(self._temp, ignore_errors=True)
            raise

    def control_host(self) -> str:
        return LOOPBACK  # the driver's socket is ipc://, in the run's private directory

    def start(self, specs: list[WorkerSpec]) -> dict[str, RayWorker]:
        import ray

        connect(self.cfg)
        actor_class = ray.remote(_Actor)
        workers = {}
        try:
            for s in _place(self.hosts, self._host, specs):
                actor = actor_class.options(
                    num_cpus=s.deployment.threads_per_worker * s.tp * s.dp,
                    resources={f"pdk_host_{self._host[s.name]}": 1},
                    max_restarts=self.cfg.max_restarts if s.role.restartable else 0,
                ).remote()
                node_id, pid = ray.get(actor.where.remote(), timeout=self.cfg.start_timeout_s)
                workers[s.name] = RayWorker(s.name, actor, s, None, node_id, pid)
        except BaseException:
            super().shutdown(workers)
            raise
        return workers

    def where(self, worker: RayWorker) -> dict:
        ray_node = worker.where()
        host = _host_of(self.hosts, self._host[worker.spec.name])
        return {**host, "pid": ray_node["pid"], "ray_node_id": ray_node["node_id"]}

    def shutdown(self, workers: dict[str, RayWorker] | None = None) -> None:
        import ray

        from serving.fleet.netns import switch_thread

        try:
            super().shutdown(workers)
            ray.shutdown()
        finally:
            if self._left is not None:
                switch_thread(None, self._left)
                self._left = None
            self.hosts.close()  # the Ray nodes' processes go with their namespaces
            drop_token()
            shutil.rmtree(self._temp, ignore_errors=True)


def make_launcher(config):
    """The launcher config.launcher names: local processes, Ray actors, or hosts in network namespaces
    (processes, or with cluster.ray Ray actors, on each host; this module sits above the others)."""
    if config.launcher.name == "ray":
        return RayLauncher(config.launcher.ray)
    if config.launcher.name == "netns":
        if config.launcher.cluster.ray:
            cfg = config.launcher.ray or RayConfig()
            return NetnsRayLauncher(config.launcher.cluster, cfg, config.launcher.max_restarts)
        return NetnsLauncher(config.launcher.cluster, config.launcher.max_restarts)
    return LocalLauncher(config.transfer.control_host, config.launcher.max_restarts)
