"""`launcher`, `ray` and `cluster`: how a deployment's workers start (serving/fleet/launcher.py,
netns_launch.py): processes on this host, Ray actors, or processes on hosts in network namespaces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.checks import check_count, check_positive, refuse

ROLES = ("colocated", "prefill", "decode")
LAUNCHERS = ("local", "ray", "netns")


@dataclass(frozen=True)
class RayConfig:
    """Where the `ray` launcher finds its cluster and how it places workers (conf/launcher/ray.yaml)."""

    address: str | None = None  # an existing cluster ("auto" or host:port); None: start a local one
    local_nodes: int = 2  # address None: nodes of the local cluster (127.0.0.1); node 0 takes prefill
    cpus_per_node: int = 1  # the local cluster's CPUs per node
    role_resources: dict = field(
        default_factory=lambda: {"prefill": "pdk_prefill", "decode": "pdk_decode", "colocated": None}
    )  # role -> the custom resource a node must have to take that role's workers (None: any node)
    node_ids: dict = field(default_factory=dict)  # worker name -> Ray node id (explicit placement)
    max_restarts: int = 0  # Ray restarts a dead worker this many times; it re-handshakes
    start_timeout_s: float = 120.0  # the cluster up and every worker's placement group placed

    def __post_init__(self):
        if self.address is not None and not (isinstance(self.address, str) and self.address):
            refuse("ray.address", self.address, 'null (a local cluster), "auto" or the head\'s host:port')
        if self.address is None:
            check_positive("ray.local_nodes", self.local_nodes, integer=True)
        check_positive("ray.cpus_per_node", self.cpus_per_node, integer=True)
        check_positive("ray.start_timeout_s", self.start_timeout_s)
        check_count("ray.max_restarts", self.max_restarts)
        unknown = sorted(set(self.role_resources) - set(ROLES))
        if unknown:
            refuse("ray.role_resources", dict(self.role_resources), f"keys among {ROLES}; got {unknown}")
        for role, resource in self.role_resources.items():
            if resource is not None and not (isinstance(resource, str) and resource):
                refuse(f"ray.role_resources.{role}", resource, "a custom resource name or null (any node)")


@dataclass(frozen=True)
class ClusterConfig:
    """The netns launcher's hosts on this machine (conf/launcher/netns.yaml; serving/fleet/netns.py)."""

    hosts: int = 2  # network namespaces; worker i runs on host i % hosts
    nics_per_host: int = 1  # veth NICs per host (a bridge per NIC index)
    # every NIC's link, both ways: a tc rate; one-way delay and jitter (us): netem, else netns_wire; loss (%)
    link: dict = field(
        default_factory=lambda: {"rate": "10gbit", "delay_us": 0, "jitter_us": 0, "loss_pct": 0}
    )
    subnet: int = 0  # 198.18.(subnet * 4 + nic).(host + 1): two runs at once need two subnets
    ray: bool = False  # a Ray node per host (the head, and the driver, on host 0): workers are Ray actors

    def __post_init__(self):
        from serving.fleet.netns import Link, check_cluster

        if not isinstance(self.ray, bool):
            refuse("cluster.ray", self.ray, "true or false")
        if hasattr(self.link, "keys"):  # a mapping from the YAML (OmegaConf's, too): a plain dict
            object.__setattr__(self, "link", {k: self.link[k] for k in self.link.keys()})
        check_cluster(self.hosts, self.nics_per_host, self.subnet)
        if not isinstance(self.link, dict) or set(self.link) - {"rate", "delay_us", "jitter_us", "loss_pct"}:
            refuse("cluster.link", self.link, "a mapping of rate, delay_us, jitter_us, loss_pct")
        Link(**self.link)  # checked: ValueError naming cluster.link.<key>


@dataclass(frozen=True)
class LauncherConfig:
    name: str = "local"  # local: processes on this host | ray: actors on a Ray cluster | netns: hosts here
    ray: RayConfig | None = None  # the ray launcher's settings
    cluster: ClusterConfig | None = None  # the netns launcher's hosts
    # local: a dead worker is started again this many times (decode workers too); ray: ray.max_restarts
    max_restarts: int = 0

    def __post_init__(self):
        if self.name not in LAUNCHERS:
            refuse("launcher", self.name, f"one of {LAUNCHERS}")
        check_count("launcher.max_restarts", self.max_restarts)
        if self.name == "ray" and self.ray is None:
            object.__setattr__(self, "ray", RayConfig())
        if self.name == "netns" and self.cluster is None:
            object.__setattr__(self, "cluster", ClusterConfig())
