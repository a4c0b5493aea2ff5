"""Mooncake Store (https://github.com/kvcache-ai/Mooncake) as the KV pool every worker shares; the only
module that imports `mooncake`.

`StoreProcesses` is what a launcher starts beside the workers: the master (metadata of every object), an
HTTP metadata server (Mooncake's own, bound to the host we give it: the master's built-in one binds every
interface) and one memory process that holds the pool's bytes (`mooncake_client`, so that the pool
outlives any worker). `StoreClient` is a worker's client: it mounts no memory of its own, registers a
buffer and moves objects between it and the pool; every call runs on one thread of its own and has a
deadline, past which the store counts as down for a while (a miss, never an error).

On a CPU machine the wheel is `mooncake-transfer-engine-non-cuda`; its libraries need `libibverbs.so.1`
and libnl, which NIXL's wheel ships under hashed names: `link_libraries()` links them where Mooncake's
libraries look (its RPATH), once per environment (`make` does it; `python -m transfer.backends.mooncake`).

Mooncake's TCP transfer engine listens on every interface (its port search binds INADDR_ANY) and does not
authenticate peers, nor does the master (any process that reaches it may list, read, remove or write
objects); run the pool on a trusted network. What we keep: the master, its metrics and admin server, the
metadata server and the memory process's service bind to `host`, and what workers put is sealed under
keys only the deployment's secret derives (engine/kv/pool.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import glob
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

log = logging.getLogger(__name__)
# after a failed or late call the pool is skipped FIRST_DOWN_S, twice as long after each failure that follows
# with no call done well between, up to DOWN_FOR_S: one transient failure costs a short run half a second
# of its pool, not five; a store that stays down is asked once every DOWN_FOR_S
FIRST_DOWN_S, DOWN_FOR_S = 0.5, 5.0
LOOKUP_S = 0.5  # an existence check's deadline by default: the engine's thread waits on it
NO_OBJECT, TOO_SMALL = -704, -600  # Mooncake's codes for a key it does not hold, a buffer too small
LATE, FAILED = object(), object()
STARTS = 3  # tries at starting the store's processes, each on fresh ports


def _site() -> str:
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "kv_tiers.store=mooncake needs Mooncake Store: pip install '.[store]' (on a CPU machine "
            "mooncake-transfer-engine-non-cuda), then python -m transfer.backends.mooncake"
        )
    return os.path.dirname(list(spec.submodule_search_locations)[0])


ALIASES = {"libibverbs.so.1": "libibverbs-", "libnuma.so.1": "libnuma-", "libcurl.so.4": "libcurl-"}


def _system_has(soname: str) -> bool:
    try:
        ctypes.CDLL(soname)
        return True
    except OSError:
        return False


def link_libraries() -> list[str]:
    """Link the libraries NIXL's wheel ships (hashed names, and the sonames Mooncake asks for: always
    libibverbs, libnuma and libcurl where the system lacks them) into the folder Mooncake's libraries
    read (their RPATH); returns the links made (none when they exist)."""
    site = _site()
    libs = os.path.join(site, "mooncake_transfer_engine_non_cuda.libs")
    if not os.path.isdir(libs):
        return []  # the CUDA build links its own
    made = []
    for package in ("nixl_cu12.libs", "nixl_cu13.libs"):
        for path in sorted(glob.glob(os.path.join(site, package, "lib*.so*"))):
            base = os.path.basename(path)
            names = [base]  # what the aliased ones need, found through the same RPATH
            names += [a for a, prefix in ALIASES.items() if base.startswith(prefix)]
            for name in names:
                link = os.path.join(libs, name)
                if name in ALIASES and name != "libibverbs.so.1" and _system_has(name):
                    continue
                if not os.path.lexists(link):
                    os.symlink(os.path.relpath(path, libs), link)
                    made.append(link)
    return made


def _store_class():
    # Mooncake logs through glog to stderr (a worker's console): its failures reach us as return codes,
    # which this module logs; its INFO lines are noise there (errors it still prints)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise ImportError(
            f"Mooncake Store could not load ({e}): run `python -m transfer.backends.mooncake` once to "
            "link the libraries it needs from NIXL's wheel"
        ) from e
    return MooncakeDistributedStore


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_address(master: str) -> str:
    """This machine's address on the route to the master (loopback for a master on loopback)."""
    host = master.rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: it only picks the route
        return s.getsockname()[0]


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the process that started it dies (nothing left behind)."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _ports_in(netns: str, host: str, n: int) -> list[int]:
    """n ports free on host inside network namespace netns (a launcher=netns host: its own stack)."""
    code = (
        f"import socket; s = [socket.socket() for _ in range({n})]; [x.bind(({host!r}, 0)) for x in s]; "
        "print(*[x.getsockname()[1] for x in s])"
    )
    out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", code], capture_output=True,
                         text=True, check=True, timeout=30)  # fmt: skip
    return [int(p) for p in out.stdout.split()]


def _listens(pid: int, port: int) -> bool:
    """Whether process pid itself holds a TCP socket listening on port: a row of its namespace's table
    (/proc/<pid>/net/tcp, readable from outside that namespace) whose socket is one of pid's open files.
    Another process listening on the port (it was taken between our pick and the store's bind) is not
    the store: a connection would have taken it for one."""
    try:
        with open(f"/proc/{pid}/net/tcp") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        inodes = {r[9] for r in rows if int(r[1].rsplit(":", 1)[1], 16) == port and r[3] == "0A"}  # LISTEN
        if not inodes:
            return False
        fds = os.listdir(f"/proc/{pid}/fd")
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") in {f"socket:[{i}]" for i in inodes} for fd in fds)
    except OSError:  # pid exited meanwhile: its caller reads the exit code
        return False


def _log_tail(path: str, chars: int = 600) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - chars))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


class ExitedAtStart(RuntimeError):
    """One of the store's processes exited before it listened: it is started again on other ports."""


class StoreProcesses:
    """A pool's master, metadata server and memory, started on host (inside network namespace netns, a
    launcher=netns host, where given), stopped by stop()."""

    def __init__(
        self, host: str, pool_bytes: int, log_dir: str, timeout_s: float = 60.0, netns: str | None = None
    ):
        self.host, self.netns = host, netns
        self._inside = ["ip", "netns", "exec", netns] if netns else []  # what runs here runs on its host
        self.procs: list[subprocess.Popen] = []
        os.makedirs(log_dir, exist_ok=True)
        for attempt in range(1, STARTS + 1):
            try:
                self._start(pool_bytes, log_dir, timeout_s)
                break
            except ExitedAtStart as e:
                self.stop()
                if attempt == STARTS:
                    raise
                log.warning("%s: starting the store again on other ports", e)
            except BaseException:
                self.stop()
                raise
        log.warning(
            "Mooncake Store pool of %d bytes: master %s (its transfer engine listens on every interface "
            "without authenticating peers: keep it on a trusted network)",
            pool_bytes,
            self.master,
        )

    def _start(self, pool_bytes: int, log_dir: str, timeout_s: float) -> None:
        """One try on fresh ports: ours are picked free and bound by the store a moment later, and
        Mooncake's transfer engine searches its own, so another process may take one between."""
        site = os.path.join(_site(), "mooncake")
        host, netns = self.host, self.netns
        ports = _ports_in(netns, host, 4) if netns else [free_port(host) for _ in range(4)]
        rpc, metrics, meta, mem = ports
        self.master = f"{host}:{rpc}"
        self.metadata = f"http://{host}:{meta}/metadata"
        commands = {
            "master": [
                os.path.join(site, "mooncake_master"),
                f"--rpc_address={host}",
                f"--rpc_port={rpc}",
                f"--metrics_host={host}",
                f"--metrics_port={metrics}",
                "--enable_http_metadata_server=false",
            ],
            "metadata": [
                sys.executable,
                "-m",
                "mooncake.http_metadata_server",
                "--host",
                host,
                "--port",
                str(meta),
            ],
            "memory": [
                os.path.join(site, "mooncake_client"),
                f"--host={host}",
                f"--port={mem}",
                f"--master_server_address={self.master}",
                f"--metadata_server={self.metadata}",
                f"--global_segment_size={pool_bytes}",
                "--local_buffer_size=16777216",
                "--protocol=tcp",
            ],
        }
        for name, port in (("master", rpc), ("metadata", meta), ("memory", mem)):
            path = os.path.join(log_dir, f"store-{name}.log")
            with open(path, "ab") as out:
                self.procs.append(
                    subprocess.Popen(
                        self._inside + commands[name],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        preexec_fn=_die_with_parent,
                        env=_bound_to(host),
                    )
                )
            self._await_port(name, port, path, time.monotonic() + timeout_s)
        self._await_mounted(metrics, time.monotonic() + timeout_s)

    def _await_mounted(self, metrics_port: int, deadline: float) -> None:
        """Until the master counts the memory process's segment and the metadata server holds that
        segment's transfer metadata: a worker's first put before either fails (-800 after the mount,
        seen under the full suite), and the pool was then skipped for 5 s (a whole short run). Read
        where they listen (inside the store's namespace under netns)."""
        metrics, metadata = f"http://{self.host}:{metrics_port}/metrics", self.metadata
        code = textwrap.dedent(
            f"""
            import urllib.parse, urllib.request
            body = urllib.request.urlopen({metrics!r}, timeout=2).read().decode()
            head = 'segment_total_capacity_bytes{{segment="'
            line = next((x for x in body.splitlines() if x.startswith(head)), None)
            assert line and float(line.split()[-1]) > 0, "no segment mounted yet"
            key = urllib.parse.quote("mooncake/ram/" + line[len(head) :].split('"')[0], safe="")
            urllib.request.urlopen({metadata!r} + "?key=" + key, timeout=2).read()
            print("ready")
            """
        )
        while True:
            done = subprocess.run(
                [*self._inside, sys.executable, "-c", code], capture_output=True, text=True, timeout=30
            )
            if done.returncode == 0 and done.stdout.strip() == "ready":
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the Mooncake Store's memory never became ready (mounted, its metadata published): "
                    f"{done.stderr.strip()[-300:]}"
                )
            time.sleep(0.05)

    def _await_port(self, name: str, port: int, log_path: str, deadline: float) -> None:
        proc = self.procs[-1]
        while not _listens(proc.pid, port):
            if proc.poll() is not None:
                raise ExitedAtStart(
                    f"the Mooncake Store {name} exited at start (code {proc.returncode}); its log "
                    f"({log_path}) ends: {_log_tail(log_path)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Mooncake Store {name} did not listen on {port} in time")
            time.sleep(0.05)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def stop(self, timeout_s: float = 5.0) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.procs = []


# the address Mooncake's transfer engine tells its peers to reach it at (not what it binds). Given per
# process, never left in this one's environment: a client's 127.0.0.1, left there by setdefault, was
# inherited by the next store's processes and workers in network-namespace hosts, whose peers then
# dialled their own 127.0.0.1 (the first put's -800 beside the full suite: a test file of loopback
# pools ran first in the same pytest worker)
BIND = "MC_TCP_BIND_ADDRESS"


def _bound_to(host: str) -> dict:
    """This process's environment with the store's processes told to give peers host."""
    return {**os.environ, BIND: host}


class StoreClient:
    """A worker's client of the pool: pages move between its registered host buffer and the pool."""

    def __init__(self, master: str, metadata: str, memory, deadline_s: float, lookup_s: float = LOOKUP_S):
        host = local_address(master)
        self.deadline_s, self.down_until = deadline_s, 0.0
        self.lookup_s = lookup_s  # an existence check's deadline (kv_tiers.store_lookup_s)
        self.down_for = FIRST_DOWN_S  # the next outage's length
        self.outages = 0  # times the pool went down (a failure while up)
        self._lock = threading.Lock()
        self._calls = cf.ThreadPoolExecutor(1, thread_name_prefix="kv-pool")
        self._late: cf.Future | None = None  # the last call past its deadline (it goes on)
        self.store = _store_class()()
        told = os.environ.get(BIND)  # set for this process by its user: theirs; else this client's address,
        if told is None:  # for the setup (which reads it) only
            os.environ[BIND] = host
        try:
            rc = self._call(self.store.setup, host, metadata, 0, 16 << 20, "tcp", "", master, wait=30.0)
        finally:
            if told is None:
                os.environ.pop(BIND, None)
        if rc is LATE or rc is FAILED or rc != 0:
            raise RuntimeError(f"Mooncake Store client setup failed (code {rc}) against master {master}")
        self.base = memory.data_ptr()
        self._memory = memory  # registered: must outlive the client's use of it
        rc = self._call(self.store.register_buffer, self.base, memory.numel(), wait=30.0)
        if rc is LATE or rc is FAILED or rc != 0:
            raise RuntimeError(f"Mooncake Store could not register the host pool's buffer (code {rc})")

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    def _call(self, fn, *args, wait: float | None = None):
        """fn(*args) on the client's own thread, within the deadline: its value, or LATE (it goes on on
        that thread, so memory it was given stays in use) or FAILED (it raised)."""
        future = self._calls.submit(fn, *args)
        try:
            return future.result(timeout=wait or self.deadline_s)
        except cf.TimeoutError:
            self._late = future
            self._failed(getattr(fn, "__name__", "a call"), "past its deadline")
            return LATE
        except Exception as e:
            self._failed(getattr(fn, "__name__", "a call"), repr(e))
            return FAILED

    def settled(self) -> bool:
        """Every call that went past its deadline has returned (one thread runs them in order): memory
        they were given is no longer read or written."""
        return self._late is None or self._late.done()

    def _failed(self, what: str, why) -> None:
        """The pool is down for down_for, which doubles for the next (one warning per outage)."""
        with self._lock:
            if self.up:
                self.outages += 1
                log.warning(
                    "Mooncake Store %s failed (%s): the pool is a miss for %s s", what, why, self.down_for
                )
            self.down_until = time.monotonic() + self.down_for
            self.down_for = min(DOWN_FOR_S, 2 * self.down_for)

    def _done(self) -> None:
        """A call came back well: the next outage is short again."""
        with self._lock:
            self.down_for = FIRST_DOWN_S

    def exists(self, keys: list[str]) -> list[bool]:
        """Which keys the pool holds (all False while it is down)."""
        if not self.up or not keys:
            return [False] * len(keys)
        found = self._call(self.store.batch_is_exist, keys, wait=min(self.deadline_s, self.lookup_s))
        if found in (LATE, FAILED) or any(f < 0 for f in found):
            if found not in (LATE, FAILED):
                self._failed("batch_is_exist", found)
            return [False] * len(keys)
        self._done()
        return [f == 1 for f in found]

    def _page(self, fn, *args):
        """fn(*args), a page moving to or from the buffer: 'failed' while the pool is down or when it
        raised, 'late' past its deadline (the buffer is still in use), else what it returned."""
        if not self.up:
            return "failed"
        value = self._call(fn, *args)
        return "late" if value is LATE else "failed" if value is FAILED else value

    def get(self, key: str, offset: int, nbytes: int) -> str:
        """The object key into the buffer at offset (exactly nbytes): 'ok', 'miss' (evicted since, or
        another size), 'failed' or 'late' (the buffer may still be written: keep it)."""
        n = self._page(self.store.get_into, key, self.base + offset, nbytes)
        if isinstance(n, str):
            return n
        if n == nbytes:
            self._done()
            return "ok"
        if n in (NO_OBJECT, TOO_SMALL) or n >= 0:
            return "miss"
        self._failed("get_into", n)
        return "failed"

    def put(self, key: str, offset: int, nbytes: int) -> str:
        """The buffer at offset as the object key: 'ok', 'failed' or 'late' (still being read)."""
        rc = self._page(self.store.put_from, key, self.base + offset, nbytes)
        if isinstance(rc, str):
            return rc
        if rc != 0:
            self._failed("put_from", rc)
            return "failed"
        self._done()
        return "ok"

    def remove(self, key: str) -> str:
        """Drop the object key: 'ok' (or it was not there), 'failed' or 'late' (a lease on it: read
        moments ago)."""
        rc = self._page(self.store.remove, key)
        if isinstance(rc, str):
            return rc
        return "ok" if rc in (0, NO_OBJECT) else "failed"

    def close(self) -> None:
        self._calls.shutdown(wait=False, cancel_futures=True)


if __name__ == "__main__":
    print("\n".join(link_libraries()) or "Mooncake's libraries are linked already")
