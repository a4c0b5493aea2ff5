"""A deployment's worker processes, held for the main job's driver and the HTTP server's runtime.

`start_fleet` starts every worker through its launcher (local processes or Ray actors; each starts its
own TP ranks) and waits until each is Ready; a `Fleet` then holds the runtime's socket to them. It makes
the deployment's keyring (transfer.auth) and binds one ROUTER socket that accepts only its workers' keys;
a message counts only when its ZMQ identity is the worker its key belongs to. Control sockets live in a
private directory (`ipc://`, the default) or bind to `transfer.control_host` (`tcp://`), always behind
CURVE. The fleet notices workers that die (a dead prefill worker is reported to every decode worker:
its requests fail at once, their pages are freed), has the launcher restart them where it may, and
brings a restarted one back. In an elastic deployment it also moves workers between prefill and decode
(`Fleet.switch`; `Elastic` asks the planner and makes its moves); on stop, nothing of a worker outlives
it.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.role import Role
from serving.config import DeploymentConfig, RuntimeConfig, dp_peers, engine_config
from serving.control import driver_socket, private_dir, recv_all, send_to
from serving.fleet.procs import descendants, reap
from serving.messages import (
    Connect,
    Failed,
    Listening,
    PeerDead,
    PeerLeaving,
    Ready,
    Released,
    Stop,
    Switched,
    SwitchRole,
    Timeline,
)
from serving.worker import WorkerSpec
from transfer.auth import Credentials, keyring

log = logging.getLogger(__name__)


def worker_names(d: DeploymentConfig) -> list[str]:
    if d.colocated:
        return [f"colocated-{i}" for i in range(d.num_workers)]
    return [f"prefill-{i}" for i in range(d.num_prefill)] + [f"decode-{i}" for i in range(d.num_decode)]


def worker_specs(
    config: RuntimeConfig,
    d: DeploymentConfig,
    driver: str,
    run_dir: str,
    keys: dict[str, Credentials],
    first_core: int = 0,
    store=None,
) -> list[WorkerSpec]:
    """Every worker of a deployment, with its peers, keys and cores (threads x TP x DP each, round robin from
    first_core; none on an existing Ray cluster, whose nodes' cores this host cannot see: Ray reserves
    CPUs there. A local Ray cluster's nodes are this host: its workers are pinned as local ones are)."""
    cpus = sorted(os.sched_getaffinity(0))
    next_core = first_core

    def cores(tp: int, dp: int) -> tuple[int, ...]:
        nonlocal next_core
        if config.launcher.name == "ray" and config.launcher.ray.address is not None:
            return ()
        n = d.threads_per_worker * tp * dp  # each DP group's engine leads tp ranks
        out = tuple(cpus[(next_core + k) % len(cpus)] for k in range(n))
        next_core += n
        return out

    names = worker_names(d)
    tiers, secret = config.kv_tiers, secrets.token_hex(32)  # keys the pages' MACs in the shared pool
    disk = os.path.join(tiers.disk_dir, d.name) if tiers.disk_dir else os.path.join(run_dir, "kv")
    pool = {"store_master": store.master, "store_metadata": store.metadata} if store is not None else {}
    prefill = tuple(n for n in names if n.startswith("prefill-"))
    decode = tuple(n for n in names if n.startswith("decode-"))
    common = dict(
        deployment=d,
        transfer=config.transfer,
        kernels=config.kernels,
        driver_address=driver,
        run_dir=run_dir,
    )
    specs = []
    for name in names:
        role = Role(name.split("-")[0])
        groups = tuple(peer for p in prefill for peer in dp_peers(p, d.prefill_dp))  # each prefill group
        peers = {Role.COLOCATED: (), Role.PREFILL: decode, Role.DECODE: groups}[role]
        wait_for = None
        if d.elastic:  # any of them may prefill for any other later: a decode worker waits for today's
            peers, wait_for = tuple(n for n in names if n != name), prefill
        seed = int(name.split("-")[1]) if role == Role.COLOCATED else 0
        # a restarted worker finds its own files again
        kv_tiers = tiers.engine(os.path.join(disk, name), secret, **pool) if tiers.serves(d) else None
        engine = engine_config(config.model, d, role, config.slo.tpot_s, seed, kv_tiers)
        specs.append(
            WorkerSpec(
                name,
                engine,
                creds=keys[name],
                peers=peers,
                cores=cores(engine.tp, engine.dp),
                wait_for=wait_for,
                kv_wire_dtype=config.model.kv_dtype if role is Role.PREFILL else "auto",
                **common,
            )
        )
    launcher = config.launcher  # with restarts, a decode worker waits for a prefill worker to return
    if (launcher.ray.max_restarts if launcher.name == "ray" else launcher.max_restarts) > 0:
        specs = [replace(s, restart_wait_s=config.start_timeout_s) for s in specs]
    return specs


@dataclass
class Fleet:
    """A deployment's workers, started (by its launcher), connected and Ready, and the runtime's socket
    to them. It also notices workers that die, has the launcher restart them where it can, and brings
    a restarted one back (Connect again, then its Ready)."""

    sock: object  # zmq ROUTER
    procs: dict[str, object]  # name -> worker handle (multiprocessing.Process, launcher.RayWorker)
    roles: dict[str, Role]
    run_dir: str
    launcher: object = None
    start_timeout_s: float = 300.0  # how long a restarted worker may take to come back
    listening: dict[str, dict[str, str]] = field(default_factory=dict)  # decode worker -> its addresses
    starting: set[str] = field(default_factory=set)  # prefill workers listening, their Connect not sent
    dead: set[str] = field(default_factory=set)
    restarting: set[str] = field(default_factory=set)
    cache_salt: bytes = b""  # what the workers' prefix cache page names start from (their Ready says)
    speeds: dict[str, tuple] = field(default_factory=dict)  # name -> its Ready's (prefill tok/s, step s)
    switching: dict[str, Role] = field(default_factory=dict)  # elastic worker -> the role it moves to
    releasing: dict[str, set] = field(default_factory=dict)  # leaving prefill worker -> decode workers
    # that may still have something in flight there (their Released has not come)
    store: object = None  # the KV pool's processes (kv_tiers.store: transfer.backends.mooncake)
    prefill_dp: int = 1  # each prefill worker's DP groups (deployment.prefill_dp): a messenger peer each

    @property
    def frontends(self) -> list[str]:
        """Where requests go: decode and colocated workers."""
        return [n for n, r in self.roles.items() if r.samples]

    def send(self, name: str, msg) -> bool:
        return send_to(self.sock, name, msg)

    def switch(self, name: str, role: Role | str) -> None:
        """Move a live elastic worker to role (prefill | decode); the caller has stopped routing to it
        (Router.leave). A decode worker is told at once: it hands its requests back (HandedBack, which
        receive() passes on for the caller to resume elsewhere). A prefill worker is told once every
        decode worker has Released it. Either answers Switched when it serves its new role; one move at a
        time."""
        if self.switching:
            raise ValueError(f"{sorted(self.switching)} is still switching; one move at a time")
        role, now = Role.parse(role), self.roles.get(name)
        if now is None or not now.switchable or name in self.dead or now == role:
            raise ValueError(f"worker {name!r} cannot move to {role!r}: it is {self.roles.get(name)}")
        if len(self._live(self.roles[name])) < 2:
            raise ValueError(f"worker {name!r} is the last live {self.roles[name]} worker: it stays")
        self.switching[name] = role
        if role == Role.PREFILL:
            self.send(name, SwitchRole(Role.PREFILL))
            return
        self.releasing[name] = {n for n in self._live(Role.DECODE)}
        for decode in self.releasing[name]:
            self.send(decode, PeerLeaving(name))
        self._released(name)

    def _live(self, role: Role) -> list[str]:
        return [
            n for n, r in self.roles.items() if r == role and n not in self.dead and n not in self.switching
        ]

    def _released(self, name: str) -> None:
        """Once no decode worker has anything in flight on leaving prefill worker `name`, it switches."""
        if name in self.releasing and not self.releasing[name]:
            del self.releasing[name]
            self.send(name, SwitchRole("decode", self._live("prefill")))

    def receive(self) -> list[tuple[str, object]]:
        """Messages from the workers; the ones that bring a restarted worker back are handled here."""
        out = []
        for name, msg in recv_all(self.sock):
            if isinstance(msg, Released):
                self.releasing.get(msg.peer, set()).discard(name)
                self._released(msg.peer)
            elif isinstance(msg, Listening) and self.switching.get(name) == Role.DECODE:
                self.listening[name] = msg.addresses  # its new sockets: each prefill worker connects
                for p in self._live("prefill"):
                    self.send(p, Connect({name: msg.addresses.get(p, "")}))
            elif isinstance(msg, Listening) and self.switching.get(name) == Role.PREFILL:
                self.send(name, Connect({d: self.listening[d].get(name, "") for d in self._live("decode")}))
            elif isinstance(msg, Switched) and name in self.switching:
                del self.switching[name]
                self.roles[name] = msg.role
                if msg.role == Role.PREFILL:  # the prefill workers drop their sockets to it
                    self.listening.pop(name, None)
                    for p in self._live("prefill"):
                        if p != name:
                            self.send(p, Connect({name: ""}))
                out.append((name, msg))
            elif isinstance(msg, Listening) and self.roles[name] == Role.DECODE and name in self.restarting:
                self.listening[name] = msg.addresses  # a restarted decode worker: new sockets, new peers
                for p in (n for n, r in self.roles.items() if r == Role.PREFILL and n not in self.dead):
                    self.send(p, Connect({name: msg.addresses.get(p, "")}))
            elif isinstance(msg, Listening) and self.roles[name] == Role.DECODE:
                self.listening[name] = msg.addresses
                self._connect_starting()
            elif isinstance(msg, Listening) and name in self.restarting:
                self._connect(name)
            elif isinstance(msg, Listening):  # a prefill worker as the deployment starts: this socket now
                # reaches it (a Connect sent before its first message could be dropped: ROUTER_MANDATORY)
                self.starting.add(name)
                self._connect_starting()
            elif isinstance(msg, Ready) and name in self.restarting:
                self.restarting.discard(name)
                self.dead.discard(name)
                log.warning("worker %s is back after a restart", name)
                out.append((name, msg))
            else:
                out.append((name, msg))
        return out

    def _connect_starting(self) -> None:
        """Once every decode worker listens, each prefill worker that said Listening gets its Connect."""
        if len(self.listening) == sum(r == Role.DECODE for r in self.roles.values()):
            for p in sorted(self.starting):
                self._connect(p)
            self.starting.clear()

    def _connect(self, prefill: str) -> None:
        """A prefill worker's Connect: each decode worker's address for it and for each of its other DP
        groups (dp_peers)."""
        decode = [n for n, r in self.roles.items() if r == Role.DECODE]
        groups = dp_peers(prefill, self.prefill_dp)[1:]
        sent = self.send(
            prefill,
            Connect(
                {dn: self.listening[dn].get(prefill, "") for dn in decode},
                {dn: [self.listening[dn].get(g, "") for g in groups] for dn in decode} if groups else {},
            ),
        )
        if not sent:  # it is gone (its death is found and handled by deaths())
            log.warning("prefill worker %s took no Connect", prefill)

    def deaths(self) -> list[tuple[str, int | None]]:
        """(name, exit code) of the workers found dead since the last call. Each is restarted if its
        launcher may (it comes back with a Ready that receive() passes on); until then it takes no
        requests. A dead prefill worker's decode peers are told (PeerDead): they end its requests. A
        restarted worker that dies again before its Ready (or whose restart failed) is a death too: it
        was missed, and its decode peers held their requests for it until their wait ran out."""
        out = []
        for name, proc in self.procs.items():
            if (name in self.dead and name not in self.restarting) or proc.is_alive():
                continue
            self.dead.add(name)
            self.restarting.discard(name)
            code, pid = proc.exitcode, proc.pid
            self.switching.pop(name, None)  # a move it was making is over
            self.releasing.pop(name, None)
            for leaving in list(self.releasing):  # it will never say Released
                self.releasing[leaving].discard(name)
                self._released(leaving)
            log.warning("worker %s exited (code %s)", name, code)
            out.append((name, code))
            if self.launcher is not None and self.launcher.restart(name, proc):
                self.restarting.add(name)
            if self.roles[name] == Role.PREFILL:
                back = self.start_timeout_s if name in self.restarting else 0.0
                for frontend in self.frontends:
                    if frontend not in self.dead:
                        self.send(frontend, PeerDead(name, back, pid or 0))
        return out

    def workers(self) -> list[dict]:
        """Every worker: name, role, the node it runs on and its pid (results.json `workers`)."""
        return [{"name": n, "role": self.roles[n], **self.launcher.where(p)} for n, p in self.procs.items()]

    def stop(self, on_message=None, timeout_s: float = 10.0) -> None:
        """Stop every worker (on_message(name, msg) sees what they send meanwhile: timelines, late
        results): Stop, then up to timeout_s for them to answer and exit, then SIGKILL (a frozen one
        too). Their own children (TP ranks) are reaped as well, so nothing of the deployment outlives this
        call."""
        children = [pid for p in self.procs.values() for pid in descendants(getattr(p, "pid", None))]
        try:
            # the workers that receive KV first, then the rest: a decode worker's timeline then says what
            # it holds while its prefill peers are up (pages set aside for one that may still write are
            # let go once its process is seen gone: its own stop raced the report). Each wave has its own
            # timeout_s: a frozen decode worker spent all of it, and its prefill peers, never asked, were
            # killed with it
            receives = {n: getattr(self.roles.get(n), "receives_kv", False) for n in self.procs}
            for wave in ([n for n in self.procs if receives[n]], [n for n in self.procs if not receives[n]]):
                give_up = time.monotonic() + timeout_s
                live = [n for n in wave if self.procs[n].is_alive() and self.send(n, Stop())]
                while live and time.monotonic() < give_up:
                    self.sock.poll(50)
                    for name, msg in self.receive():
                        if on_message is not None:
                            on_message(name, msg)
                        if isinstance(msg, Timeline):
                            live = [n for n in live if n != name]
            for name, p in self.procs.items():
                p.join(timeout=max(0.0, give_up - time.monotonic()) if p.is_alive() else 0)
                if p.is_alive():
                    log.warning("worker %s did not stop within %s s: killed", name, timeout_s)
                    p.kill()
                    p.join(timeout=5)
            reap(children, timeout_s=max(1.0, give_up - time.monotonic()))
        finally:
            self.sock.close()
            if self.launcher is not None:
                self.launcher.shutdown(self.procs)
            if self.store is not None:  # after the workers, its clients
                self.store.stop()
            shutil.rmtree(self.run_dir, ignore_errors=True)


def start_fleet(
    config: RuntimeConfig, d: DeploymentConfig, log_dir: Path | None = None, first_core: int = 0
) -> Fleet:
    """Start the deployment's workers (config.launcher) and wait until every one is Ready (raises, with
    none left running, if one fails or the start times out). log_dir: where each writes <name>.log;
    first_core: where its cores start (a parallel sweep job's own share)."""
    import zmq

    from serving.fleet.netns_launch import make_launcher

    if config.model.device == "cpu" and config.launcher.name != "local":
        # pdkernels' C++ CPU paths: built here once (about 20 s on a new machine), not by each worker (the
        # local launcher's fork server builds or loads them for its workers: this process then never
        # imports torch)
        from pdkernels import cpu

        cpu.module()
    launcher = make_launcher(config)
    run_dir = private_dir(worker_names(d))
    keys = keyring(["driver"] + worker_names(d))
    sock = driver_socket(keys, run_dir, replace(config.transfer, control_host=launcher.control_host()))
    driver_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        store = _start_store(config, d, log_dir or Path(run_dir), launcher)
    except BaseException:
        sock.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    specs = worker_specs(config, d, driver_address, run_dir, keys, first_core, store)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        specs = [
            replace(s, log_file=str(log_dir / f"{s.name}.log"), log_level=config.log_level) for s in specs
        ]
    fleet = Fleet(sock, {}, {s.name: s.role for s in specs}, run_dir, launcher, config.start_timeout_s)
    fleet.store, fleet.prefill_dp = store, d.prefill_dp
    try:
        fleet.procs = launcher.start(specs)
        _await_ready(fleet, config.start_timeout_s)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def _start_store(config: RuntimeConfig, d: DeploymentConfig, log_dir: Path, launcher=None):
    """The deployment's KV pool (kv_tiers.store), started before its workers, who are its clients. Under
    launcher=netns it runs on the last host, so its clients reach it over their links."""
    tiers = config.kv_tiers
    if tiers.store == "none" or not tiers.serves(d):
        return None
    from transfer.backends.mooncake import StoreProcesses

    hosts = getattr(launcher, "hosts", None)
    if hosts is not None:
        last = len(hosts.names) - 1
        return StoreProcesses(hosts.address(last), tiers.store_bytes, str(log_dir), config.start_timeout_s,
                              netns=hosts.names[last])  # fmt: skip
    return StoreProcesses(tiers.store_host, tiers.store_bytes, str(log_dir), config.start_timeout_s)


def _await_ready(fleet: Fleet, timeout_s: float) -> None:
    """Every worker Ready (fleet.receive tells each prefill worker where its decode peers listen)."""
    ready, give_up = set(), time.monotonic() + timeout_s
    while len(ready) < len(fleet.procs):
        fleet.sock.poll(100)
        for name, msg in fleet.receive():
            if isinstance(msg, Failed):
                raise RuntimeError(f"worker {name} failed to start:\n{msg.error}")
            if isinstance(msg, Ready):
                ready.add(name)
                fleet.speeds[name] = (msg.prefill_tok_s, msg.decode_step_s)
                fleet.cache_salt = fleet.cache_salt or msg.cache_salt
        dead = [n for n, p in fleet.procs.items() if not p.is_alive()]
        if dead:
            raise RuntimeError(
                f"worker(s) {dead} exited while starting (codes {[fleet.procs[n].exitcode for n in dead]})"
            )
        if time.monotonic() > give_up:
            raise TimeoutError(
                f"workers {sorted(set(fleet.procs) - ready)} not ready within start_timeout_s={timeout_s}"
            )
