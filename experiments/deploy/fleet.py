"""A deployment's worker processes, held for the main job's driver and the HTTP server's runtime.

`start_fleet` starts every worker through its launcher (local processes or Ray actors; each starts its
own TP ranks) and waits until each is Ready; a `Fleet` then holds the driver's socket to them. It makes
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
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from experiments.deploy.config import DeploymentConfig, RuntimeConfig
from experiments.deploy.messages import (
    Connect,
    Failed,
    Listening,
    PeerDead,
    PeerLeaving,
    Ready,
    Released,
    Result,
    Stop,
    Switched,
    SwitchRole,
    Timeline,
    driver_codec,
)
from experiments.deploy.policy import Planner, Router
from experiments.deploy.worker import WorkerSpec
from transfer.auth import Credentials, keyring
from transfer.config import TransferConfig
from transfer.wire import MAX_MESSAGE_BYTES, WireError

log = logging.getLogger(__name__)
_CODEC = driver_codec()


def worker_names(d: DeploymentConfig) -> list[str]:
    if d.kind == "colocated":
        return [f"colocated-{i}" for i in range(d.num_workers)]
    return [f"prefill-{i}" for i in range(d.num_prefill)] + [f"decode-{i}" for i in range(d.num_decode)]


def worker_specs(
    config: RuntimeConfig,
    d: DeploymentConfig,
    driver: str,
    run_dir: str,
    keys: dict[str, Credentials],
    first_core: int = 0,
) -> list[WorkerSpec]:
    """Every worker of a deployment, with its peers, keys and cores (threads x TP each, round robin from
    first_core; none on an existing Ray cluster, whose nodes' cores this host cannot see: Ray reserves
    CPUs there. A local Ray cluster's nodes are this host: its workers are pinned as local ones are)."""
    cpus = sorted(os.sched_getaffinity(0))
    next_core = first_core

    def cores(tp: int) -> tuple[int, ...]:
        nonlocal next_core
        if config.launcher.name == "ray" and config.launcher.ray.address is not None:
            return ()
        n = d.threads_per_worker * tp
        out = tuple(cpus[(next_core + k) % len(cpus)] for k in range(n))
        next_core += n
        return out

    names = worker_names(d)
    prefill = tuple(n for n in names if n.startswith("prefill-"))
    decode = tuple(n for n in names if n.startswith("decode-"))
    common = dict(
        model=config.model,
        deployment=d,
        transfer=config.transfer,
        kernels=config.kernels,
        driver_address=driver,
        run_dir=run_dir,
    )
    specs = []
    for name in names:
        role = name.split("-")[0]
        tp = {"colocated": d.tp, "prefill": d.prefill_tp, "decode": d.decode_tp}[role]
        peers = {"colocated": (), "prefill": decode, "decode": prefill}[role]
        wait_for = None
        if d.elastic:  # any of them may prefill for any other later: a decode worker waits for today's
            peers, wait_for = tuple(n for n in names if n != name), prefill
        seed = int(name.split("-")[1]) if role == "colocated" else 0
        specs.append(
            WorkerSpec(
                name,
                role,
                creds=keys[name],
                peers=peers,
                tp=tp,
                cores=cores(tp),
                seed=seed,
                wait_for=wait_for,
                **common,
            )
        )
    launcher = config.launcher  # with restarts, a decode worker waits for a prefill worker to return
    if (launcher.ray.max_restarts if launcher.name == "ray" else launcher.max_restarts) > 0:
        specs = [replace(s, restart_wait_s=config.start_timeout_s) for s in specs]
    return specs


@dataclass
class Fleet:
    """A deployment's workers, started (by its launcher), connected and Ready, and the driver's socket
    to them. It also notices workers that die, has the launcher restart them where it can, and brings
    a restarted one back (Connect again, then its Ready)."""

    sock: object  # zmq ROUTER
    procs: dict[str, object]  # name -> worker handle (multiprocessing.Process, launcher.RayWorker)
    roles: dict[str, str]
    run_dir: str
    launcher: object = None
    start_timeout_s: float = 300.0  # how long a restarted worker may take to come back
    listening: dict[str, dict[str, str]] = field(default_factory=dict)  # decode worker -> its addresses
    dead: set[str] = field(default_factory=set)
    restarting: set[str] = field(default_factory=set)
    cache_salt: bytes = b""  # what the workers' prefix cache page names start from (their Ready says)
    switching: dict[str, str] = field(default_factory=dict)  # elastic worker -> the role it moves to
    releasing: dict[str, set] = field(default_factory=dict)  # leaving prefill worker -> decode workers
    # that may still have something in flight there (their Released has not come)

    @property
    def frontends(self) -> list[str]:
        """Where requests go: decode and colocated workers."""
        return [n for n, r in self.roles.items() if r != "prefill"]

    def send(self, name: str, msg) -> bool:
        return _send(self.sock, name, msg)

    def switch(self, name: str, role: str) -> None:
        """Move a live elastic worker to role (prefill | decode); the caller has stopped routing to it
        (Router.leave). A decode worker is told at once: it hands its requests back (HandedBack, which
        receive() passes on for the caller to resume elsewhere). A prefill worker is told once every
        decode worker has Released it. Either answers Switched when it serves its new role; one move at a
        time."""
        if self.switching:
            raise ValueError(f"{sorted(self.switching)} is still switching; one move at a time")
        if self.roles.get(name) not in ("prefill", "decode") or name in self.dead or self.roles[name] == role:
            raise ValueError(f"worker {name!r} cannot move to {role!r}: it is {self.roles.get(name)}")
        if len(self._live(self.roles[name])) < 2:
            raise ValueError(f"worker {name!r} is the last live {self.roles[name]} worker: it stays")
        self.switching[name] = role
        if role == "prefill":
            self.send(name, SwitchRole("prefill"))
            return
        self.releasing[name] = {n for n in self._live("decode")}
        for decode in self.releasing[name]:
            self.send(decode, PeerLeaving(name))
        self._released(name)

    def _live(self, role: str) -> list[str]:
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
        for name, msg in _recv(self.sock):
            if isinstance(msg, Released):
                self.releasing.get(msg.peer, set()).discard(name)
                self._released(msg.peer)
            elif isinstance(msg, Listening) and self.switching.get(name) == "decode":
                self.listening[name] = msg.addresses  # its new sockets: each prefill worker connects
                for p in self._live("prefill"):
                    self.send(p, Connect({name: msg.addresses.get(p, "")}))
            elif isinstance(msg, Listening) and self.switching.get(name) == "prefill":
                self.send(name, Connect({d: self.listening[d].get(name, "") for d in self._live("decode")}))
            elif isinstance(msg, Switched) and name in self.switching:
                del self.switching[name]
                self.roles[name] = msg.role
                if msg.role == "prefill":  # the prefill workers drop their sockets to it
                    self.listening.pop(name, None)
                    for p in self._live("prefill"):
                        if p != name:
                            self.send(p, Connect({name: ""}))
                out.append((name, msg))
            elif isinstance(msg, Listening) and self.roles[name] == "decode" and name in self.restarting:
                self.listening[name] = msg.addresses  # a restarted decode worker: new sockets, new peers
                for p in (n for n, r in self.roles.items() if r == "prefill" and n not in self.dead):
                    self.send(p, Connect({name: msg.addresses.get(p, "")}))
            elif isinstance(msg, Listening) and self.roles[name] == "decode":
                self.listening[name] = msg.addresses
                if len(self.listening) == sum(r == "decode" for r in self.roles.values()):
                    for p in (n for n, r in self.roles.items() if r == "prefill"):
                        self._connect(p)
            elif isinstance(msg, Listening) and name in self.restarting:
                self._connect(name)
            elif isinstance(msg, Ready) and name in self.restarting:
                self.restarting.discard(name)
                self.dead.discard(name)
                log.warning("worker %s is back after a restart", name)
                out.append((name, msg))
            else:
                out.append((name, msg))
        return out

    def _connect(self, prefill: str) -> None:
        decode = [n for n, r in self.roles.items() if r == "decode"]
        self.send(prefill, Connect({dn: self.listening[dn].get(prefill, "") for dn in decode}))

    def deaths(self) -> list[tuple[str, int | None]]:
        """(name, exit code) of the workers found dead since the last call. Each is restarted if its
        launcher may (it comes back with a Ready that receive() passes on); until then it takes no
        requests. A dead prefill worker's decode peers are told (PeerDead): they end its requests."""
        out = []
        for name, proc in self.procs.items():
            if name in self.dead or proc.is_alive():
                continue
            self.dead.add(name)
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
            if self.roles[name] == "prefill":
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
        results): Stop, then up to timeout_s for them to exit, then SIGKILL (a frozen one too). Their own
        children (TP ranks) are reaped as well, so nothing of the deployment outlives this call."""
        children = [pid for p in self.procs.values() for pid in descendants(getattr(p, "pid", None))]
        try:
            live = [n for n, p in self.procs.items() if p.is_alive() and self.send(n, Stop())]
            give_up = time.monotonic() + timeout_s
            while live and time.monotonic() < give_up:
                self.sock.poll(50)
                for name, msg in self.receive():
                    if on_message is not None:
                        on_message(name, msg)
                    if isinstance(msg, Timeline):
                        live = [n for n in live if n != name]
            for p in self.procs.values():
                p.join(timeout=max(0.0, give_up - time.monotonic()) if p.is_alive() else 0)
                if p.is_alive():
                    log.warning(
                        "worker %s did not stop within %s s: killed", getattr(p, "name", p), timeout_s
                    )
                    p.kill()
                    p.join(timeout=5)
            reap(children, timeout_s=max(1.0, give_up - time.monotonic()))
        finally:
            self.sock.close()
            if self.launcher is not None:
                self.launcher.shutdown(self.procs)
            shutil.rmtree(self.run_dir, ignore_errors=True)


class Elastic:
    """An elastic deployment's moves (deployment.planner), for the main job's driver and the server's
    runtime alike: each turn, tick() asks the Planner (its scripted switches, or its look at the SLO) and
    starts the move it names (the router stops routing to the worker, the fleet tells it); switched()
    makes the worker's new role the router's. Every step is an event (when, what): results.json's."""

    def __init__(self, deployment, slo, fleet: Fleet, router: Router, events: list, moves: list):
        """events: where (when, what) go; moves: where each move goes, {worker, from, to, at (perf_counter),
        why, seconds (what the switch took of the worker's time, once done)}."""
        self.planner = Planner(deployment.planner, (slo.ttft_s, slo.tpot_s))
        self.fleet, self.router, self.events, self.moves = fleet, router, events, moves

    def tick(self) -> None:
        if not self.planner.due():
            return
        fleet = self.fleet
        roles = {n: r for n, r in fleet.roles.items() if r != "colocated" and n not in fleet.dead}
        move = self.planner.decide(roles, self.router, busy=bool(fleet.switching))
        if move is None:
            return
        worker, role = move
        now = time.perf_counter()
        try:
            fleet.switch(worker, role)
        except ValueError as e:
            self.events.append((now, f"planner: no move: {e}"))
            return
        self.router.leave(worker)
        old = fleet.roles[worker]
        self.moves.append({"worker": worker, "from": old, "to": role, "at": now, "why": self.planner.why})
        self.events.append((now, f"{worker}: {old} -> {role} begins ({self.planner.why})"))
        log.info("%s: %s -> %s (%s)", worker, old, role, self.planner.why)

    def switched(self, name: str, msg: Switched) -> None:
        self.router.join(name, msg.role)
        for move in self.moves:
            if move["worker"] == name and "seconds" not in move:
                move["seconds"], move["settle_s"] = msg.seconds, msg.settle_s
        what = (
            f"{name} serves {msg.role} ({msg.seconds:.3f} s of its time, {msg.settle_s:.3f} s of it settling)"
        )
        self.events.append((time.perf_counter(), what))

    def finished(self, result: Result, sent: float) -> None:
        """A request's end, for the planner's percentiles (sent: when it was routed, perf_counter)."""
        if result.error is None and result.token_times:
            times = result.token_times
            tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
            self.planner.observe(times[0] - sent, tpot)


def descendants(pid: int | None) -> list[tuple[int, str]]:
    """(pid, start time) of every process below pid on this host, from /proc ([] elsewhere, or for a
    process that is not local: a Ray actor's pid lives on its node)."""
    if not isinstance(pid, int) or not os.path.isdir("/proc"):
        return []
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        fields = _stat(entry) if entry.isdigit() else None
        if fields is not None:
            children.setdefault(int(fields[1]), []).append((int(entry), fields[19]))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


def _stat(pid) -> list[str] | None:
    """/proc/<pid>/stat's fields after "(comm)": state, ppid, ..., starttime at [19]; None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def reap(procs: list[tuple[int, str]], timeout_s: float) -> None:
    """Wait up to timeout_s for these processes (pid, start time) to exit, then SIGKILL the rest (a pid
    reused since, with another start time, is left alone)."""
    import signal

    def alive(pid: int, start: str) -> bool:
        fields = _stat(pid)
        return fields is not None and fields[19] == start and fields[0] != "Z"

    give_up = time.monotonic() + timeout_s
    while any(alive(*p) for p in procs) and time.monotonic() < give_up:
        time.sleep(0.05)
    for pid, start in procs:
        if alive(pid, start):
            log.warning("process %d of a stopped worker was still running: killed", pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start_fleet(
    config: RuntimeConfig, d: DeploymentConfig, log_dir: Path | None = None, first_core: int = 0
) -> Fleet:
    """Start the deployment's workers (config.launcher) and wait until every one is Ready (raises, with
    none left running, if one fails or the start times out). log_dir: where each writes <name>.log;
    first_core: where its cores start (a parallel sweep job's own share)."""
    import zmq

    from experiments.deploy.launcher import make_launcher

    if config.model.device == "cpu":
        # pdkernels' C++ CPU paths: built here once (about 20 s on a new machine), not by each worker
        from pdkernels import cpu

        cpu.module()
    launcher = make_launcher(config)
    run_dir = private_dir(worker_names(d))
    keys = keyring(["driver"] + worker_names(d))
    sock = driver_socket(keys, run_dir, replace(config.transfer, control_host=launcher.control_host()))
    driver_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    specs = worker_specs(config, d, driver_address, run_dir, keys, first_core)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        specs = [
            replace(s, log_file=str(log_dir / f"{s.name}.log"), log_level=config.log_level) for s in specs
        ]
    fleet = Fleet(sock, {}, {s.name: s.role for s in specs}, run_dir, launcher, config.start_timeout_s)
    try:
        fleet.procs = launcher.start(specs)
        _await_ready(fleet, config.start_timeout_s)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def driver_socket(keys: dict[str, Credentials], run_dir: str, transfer: TransferConfig):
    """The driver's ROUTER socket, bound and accepting only the keyring's workers."""
    import zmq

    from transfer.auth import serve

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    serve(sock, keys["driver"], f"driver:{run_dir}", [n for n in keys if n != "driver"])
    t = transfer
    sock.bind(f"ipc://{run_dir}/driver" if t.control_transport == "ipc" else f"tcp://{t.control_host}:0")
    return sock


def _recv(sock) -> list[tuple[str, object]]:
    """(worker, message) for every valid message waiting; a frame whose identity is not the worker its
    key belongs to, or that does not decode, is dropped and logged."""
    import zmq

    from transfer.auth import sender

    out = []
    while sock.poll(0, zmq.POLLIN):
        frames = sock.recv_multipart(copy=False)
        name = frames[0].bytes.decode(errors="replace")
        if len(frames) != 2 or sender(frames[1]) != name:
            log.warning("dropped a message whose identity %r is not its sender's", name)
            continue
        try:
            out.append((name, _CODEC.decode(frames[1].bytes)))
        except WireError as e:
            log.warning("from %s: %s", name, e)
    return out


def _send(sock, name: str, msg) -> bool:
    import zmq

    try:
        sock.send_multipart([name.encode(), _CODEC.encode(msg)], zmq.NOBLOCK)
        return True
    except zmq.ZMQError:  # the worker is gone (ROUTER_MANDATORY) or not taking messages
        return False


IPC_PATH_MAX = 107  # bytes of a unix socket's path (sockaddr_un.sun_path, less its terminator)


def private_dir(names: list[str]) -> str:
    """A new directory (mode 0700: only this user reaches its sockets) for the run's ipc:// sockets, in
    TMPDIR; in /tmp when TMPDIR is so long that a socket's path would pass the kernel's limit."""
    # (+ 4: an elastic worker's sockets carry the generation of its messenger)
    longest = max(len(f"{a}-{b}") for a in [*names, "driver"] for b in names) + 1 + 4
    run_dir = tempfile.mkdtemp(prefix="pdk-")
    if len(run_dir.encode()) + longest > IPC_PATH_MAX:
        os.rmdir(run_dir)
        run_dir = tempfile.mkdtemp(prefix="pdk-", dir="/tmp")
    return run_dir


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
