"""Hosts on one machine: network namespaces joined by shaped veth links (DESIGN.md, "Hosts on one machine").

`Hosts(n)` makes n namespaces, each a host with `nics_per_host` veth NICs (eth0, eth1, ...), and one more
namespace, the switch, holding a bridge per NIC index that every host's NIC of that index is plugged into.
Each NIC's two directions are shaped (`Link`: rate, delay, jitter, loss; tbf for a rate, netem where there
is delay and the kernel has it, loss by an eBPF classifier: netns_loss.py) on its host side (what the host
sends) and its switch side (what it receives). Where there is delay and the kernel has no netem, a process
in the switch's namespace carries the frames in place of the bridges and holds each for its links' delay
(netns_wire.py); `Hosts.delay_by` says which.
Addresses exist only inside these namespaces (198.18.0.0/15, the range set aside for benchmarking
networks: RFC 2544), there is no default route, and the machine's own namespace gets no interface, route
or address: nothing can leave, nothing can come in.

Processes run inside a host with run(i, cmd) (`ip netns exec`); a NIC's byte counters (counters()) are
the ground truth for what crossed its link. close() kills every process in the namespaces and deletes
them, which removes their veths, bridges and qdiscs too; a context manager and atexit call it.
A SIGKILLed owner calls nothing: each Hosts starts a watcher (`python -m serving.fleet.netns`, in a
session of its own) that waits for its owner to end and then does what close() does; and should the
watcher be gone too, every Hosts first deletes the namespaces of owners that are gone (their names carry
the owner's pid). Needs CAP_NET_ADMIN (root): without it, a PermissionError
that says so.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from serving.fleet import netns_loss

PREFIX = "pdk-"  # every namespace this module makes: pdk-<owner pid>-<tag>-<host index or sw>
RANGE = "198.18"  # 198.18.0.0/15: RFC 2544's benchmarking range, never routed anywhere
MAX_NICS, MAX_SUBNETS = 4, 64  # 198.18.(subnet * MAX_NICS + nic).(host + 1)/24
CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000
MS_REC, MS_SLAVE, MNT_DETACH = 0x4000, 0x80000, 2
RATE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)")  # tc's rates: 10gbit, 400mbit, 50mbps
# bytes/s: 1kbit to 10tbit. tc takes 0bit (a link that passes nothing) and fails on a rate past its
# range only once the hosts are built: both are refused with the other config errors instead
MIN_RATE, MAX_RATE = 125, 1.25e12


def check_cluster(hosts: int, nics_per_host: int, subnet: int) -> None:
    """The cluster's shape (cluster.hosts, nics_per_host, subnet): a ValueError naming the key otherwise."""
    for key, value, low, high in (
        ("hosts", hosts, 1, 250),
        ("nics_per_host", nics_per_host, 1, MAX_NICS),
        ("subnet", subnet, 0, MAX_SUBNETS - 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"cluster.{key}={value!r} is not allowed: an integer in [{low}, {high}]")


@dataclass(frozen=True)
class Link:
    """What each NIC's link does to a packet, both ways: rate (tc's units: 10gbit, 400mbit), one-way delay
    and its jitter, and random loss."""

    rate: str = "10gbit"
    delay_us: int = 0
    jitter_us: int = 0
    loss_pct: float = 0.0

    def __post_init__(self):
        if not RATE.fullmatch(str(self.rate)) or not MIN_RATE <= self.bytes_per_s() <= MAX_RATE:
            raise ValueError(
                f"cluster.link.rate={self.rate!r} is not allowed: a tc rate from 1kbit to 10tbit, such as "
                "10gbit or 400mbit"
            )
        for key in ("delay_us", "jitter_us"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10_000_000:
                raise ValueError(f"cluster.link.{key}={value!r} is not allowed: microseconds in [0, 1e7]")
        if not 0 <= self.loss_pct <= 100:
            raise ValueError(
                f"cluster.link.loss_pct={self.loss_pct!r} is not allowed: a percentage in [0, 100]"
            )

    def bytes_per_s(self) -> float:
        number, unit, kind = RATE.fullmatch(self.rate).groups()
        scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[unit]
        return float(number) * scale / (8 if kind == "bit" else 1)

    @property
    def delayed(self) -> bool:
        return bool(self.delay_us or self.jitter_us)

    def qdisc(self, netem: bool = True) -> list[str]:
        """The root qdisc of each side: tbf for the rate (every kernel with traffic control has it), netem
        with its own rate when there is delay or jitter and netem is to do it (sch_netem: not every kernel
        has it; Hosts then delays in user space, netns_wire). Loss is not a qdisc's: an eBPF filter
        (netns_loss)."""
        if not (self.delayed and netem):
            burst = max(
                int(self.bytes_per_s() * 0.004), 4 * 65536
            )  # 4 ms of the rate, at least 4 GSO packets
            return ["tbf", "rate", self.rate, "burst", str(burst), "latency", "100ms"]
        args = ["netem", "rate", self.rate, "delay", f"{self.delay_us}us"]
        args += [f"{self.jitter_us}us"] if self.jitter_us else []
        return args + ["limit", "100000"]  # packets queued: room for a fast link's delay


def _ip(*args: str) -> str:
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise RuntimeError(
            "hosts in network namespaces need iproute2's `ip` (apt-get install iproute2)"
        ) from None
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _tc(namespace: str, *args: str) -> None:
    done = subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True)
    if done.returncode and "netem" in args and "unknown" in done.stderr:
        raise RuntimeError("this kernel has no netem qdisc (sch_netem): delay_by='wire' delays in user space")
    if done.returncode:
        raise RuntimeError(f"tc {' '.join(args)} in {namespace}: {done.stderr.strip()}")


def link_stats(namespace: str, dev: str) -> dict:
    """A device's counters in namespace (iproute2's stats64: tx and rx bytes, packets, dropped, ...)."""
    return json.loads(_ip("-n", namespace, "-j", "-s", "link", "show", "dev", dev))[0]["stats64"]


def has_netem(namespace: str) -> bool:
    """Whether the kernel has sch_netem: tried on namespace's loopback (and taken off again)."""
    try:
        _tc(namespace, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
    except RuntimeError as e:
        if "sch_netem" in str(e):
            return False
        raise
    _tc(namespace, "qdisc", "del", "dev", "lo", "root")
    return True


def _check(result: int, what: str) -> None:
    """A libc call's result: OSError naming what failed, with errno's text."""
    import ctypes

    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _setns(fd: int, what: str) -> None:
    """The calling thread into the network namespace fd names (closed here)."""
    import ctypes

    try:
        _check(ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET), what)
    finally:
        os.close(fd)


def _open_ns(namespace: str) -> int:
    return os.open(f"/run/netns/{namespace}", os.O_RDONLY | os.O_CLOEXEC)


def enter(namespace: str) -> None:
    """Move this process (single-threaded still) into namespace's network stack (setns; os.setns is
    Python 3.12 on), and give it that stack's view of /sys, as `ip netns exec` does: a mount namespace of
    its own with a fresh sysfs on /sys. UCX finds TCP interfaces by listing /sys/class/net, which
    otherwise shows the machine's: a host's eth1 went unfound, its eth0 found only if the machine had one."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if os.stat(f"/run/netns/{namespace}").st_ino == os.stat("/proc/self/ns/net").st_ino:
        return  # there already (a Ray node's worker, started inside its host by `ip netns exec`)
    _setns(_open_ns(namespace), f"setns (entering {namespace})")
    _check(libc.unshare(CLONE_NEWNS), f"unshare(CLONE_NEWNS) (entering {namespace})")
    _check(  # nothing leaks out
        libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None),
        f"mount --make-rslave / (entering {namespace})",
    )
    _check(libc.umount2(b"/sys", MNT_DETACH), f"umount /sys (entering {namespace})")
    _check(libc.mount(namespace.encode(), b"/sys", b"sysfs", 0, None), f"mount sysfs (entering {namespace})")


def switch_thread(namespace: str | None, back: int | None = None) -> int | None:
    """Move the calling thread's network stack into namespace (threads it starts later follow it), and
    return a descriptor of the one it left; with namespace None, move it back to `back` (and close it).
    The driver of a Ray cluster on these hosts joins its head's host so (a Ray driver connects from a node
    of its own cluster)."""
    if namespace is None:
        _setns(back, "setns into the namespace left")
        return None
    target = _open_ns(namespace)
    left = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(target, f"setns into {namespace}")
    except OSError:
        os.close(left)
        raise
    return left


def alive(pid: int) -> bool:
    """Whether process pid exists (another user's counts: it cannot be signalled, but it is there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    """This module's namespaces on the machine (anyone's)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def remove(namespace: str) -> None:
    """Kill what runs in namespace, then delete it (its veths, bridges and qdiscs go with it)."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    give_up = time.monotonic() + 10
    while subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.strip():
        if time.monotonic() > give_up:
            break
        time.sleep(0.02)
    subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)


def sweep() -> list[str]:
    """Delete the namespaces of owners that are gone (a main job SIGKILLed before its cleanup)."""
    gone = []
    for name in namespaces():
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not alive(int(pid)):
            remove(name)
            gone.append(name)
    return gone


def watch(owner: int, names: list[str]) -> None:
    """Wait for process owner to end, however it ends, then remove these namespaces (and what runs in
    them). Hosts runs it as a process of its own; close() stops it once it has removed them itself."""
    from serving.fleet.procs import exit_waiter

    wait = exit_waiter(owner, poll_s=0.5)
    if wait is not None:  # None: gone already
        wait()
    mine = set(namespaces())
    for name in names:
        if name in mine:
            remove(name)


class Hosts:
    def __init__(
        self,
        n: int,
        link: Link | None = None,
        nics_per_host: int = 1,
        subnet: int = 0,
        tag: str | None = None,
        delay_by: str = "auto",
    ):
        """n hosts of nics_per_host NICs each; subnet (0-63) picks the addresses (tests use their own);
        delay_by: what delays a link with delay_us or jitter_us, "netem", "wire" (netns_wire) or "auto"
        (netem where the kernel has it)."""
        if delay_by not in ("auto", "netem", "wire"):
            raise ValueError(f"delay_by={delay_by!r} is not allowed: auto, netem or wire")
        if os.geteuid() != 0:
            raise PermissionError(
                "hosts in network namespaces (launcher=netns) need CAP_NET_ADMIN: run as root"
            )
        check_cluster(n, nics_per_host, subnet)
        sweep()
        self.link, self.nics, self.subnet = link or Link(), nics_per_host, subnet
        tag = tag or secrets.token_hex(3)
        base = f"{PREFIX}{os.getpid()}-{tag}"
        self.names = [f"{base}-{i}" for i in range(n)]
        self.switch = f"{base}-sw"
        self._delay_by = delay_by
        self.delay_by: str | None = None  # "netem" or "wire" (netns_wire) where the link has delay
        self._wire: subprocess.Popen | None = None
        self._closed = False
        self._watcher = subprocess.Popen(
            [sys.executable, "-m", "serving.fleet.netns", str(os.getpid()), *self.names, self.switch],
            start_new_session=True,  # a signal to the owner's process group leaves it to clean up
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        # loss: one eBPF program, pinned while it is attached to every NIC's two sides
        pinned = netns_loss.pinned(self.link.loss_pct) if self.link.loss_pct else contextlib.nullcontext()
        with pinned as loss:
            for name in [self.switch, *self.names]:
                _ip("netns", "add", name)
                _ip("-n", name, "link", "set", "lo", "up")
            if self.link.delayed and self._delay_by == "auto":
                self.delay_by = "netem" if has_netem(self.switch) else "wire"
            elif self.link.delayed:
                self.delay_by = self._delay_by
            wire = self.delay_by == "wire"
            for k in range(self.nics if not wire else 0):  # the wire forwards in place of bridges
                _ip("-n", self.switch, "link", "add", f"br{k}", "type", "bridge")
                _ip("-n", self.switch, "link", "set", f"br{k}", "up")
            ports = []
            for i, host in enumerate(self.names):
                for k in range(self.nics):
                    port = f"h{i}n{k}"  # the switch's end of host i's NIC k
                    ports.append(port)
                    _ip("link", "add", "name", f"eth{k}", "netns", host, "type", "veth", "peer", "name", port,
                        "netns", self.switch)  # fmt: skip
                    if wire:
                        _ip("-n", self.switch, "link", "set", port, "promisc", "on", "up")
                    else:
                        _ip("-n", self.switch, "link", "set", port, "master", f"br{k}", "up")
                    _ip("-n", host, "addr", "add", f"{self.address(i, k)}/24", "dev", f"eth{k}")
                    _ip("-n", host, "link", "set", f"eth{k}", "up")
                    for namespace, dev in ((host, f"eth{k}"), (self.switch, port)):
                        qdisc = self.link.qdisc(netem=not wire)
                        _tc(namespace, "qdisc", "add", "dev", dev, "root", *qdisc)
                        if loss is not None:
                            _tc(namespace, "qdisc", "add", "dev", dev, "clsact")
                            _tc(namespace, "filter", "add", "dev", dev, "egress", "bpf", "da",
                                "object-pinned", loss)  # fmt: skip
            if wire:
                self._start_wire(ports)
            self._wait_up()

    def _wait_up(self, timeout_s: float = 30.0) -> None:
        """Until every host's NICs are operationally up. The kernel marks a veth's carrier up a moment after
        both ends are (linkwatch runs deferred), and UCX, which lists interfaces that are running, started
        in that moment found none but `lo` (it happened once)."""
        give_up = time.monotonic() + timeout_s
        for host in self.names:
            for k in range(self.nics):
                while True:
                    (shown,) = json.loads(_ip("-n", host, "-j", "link", "show", "dev", f"eth{k}"))
                    if shown.get("operstate") == "UP":
                        break
                    if time.monotonic() > give_up:
                        raise RuntimeError(f"eth{k} of {host} is not up after {timeout_s:.0f} s: {shown}")
                    time.sleep(0.01)

    def _start_wire(self, ports: list[str]) -> None:
        """netns_wire in the switch's namespace, forwarding between ports; returns once it is ready."""
        from serving.fleet import netns_wire

        cmd = [sys.executable, netns_wire.__file__, *ports, f"--delay-us={self.link.delay_us}",
               f"--jitter-us={self.link.jitter_us}", f"--owner={os.getpid()}"]  # fmt: skip
        self._wire = subprocess.Popen(
            ["ip", "netns", "exec", self.switch, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        line = self._wire.stdout.readline()  # "ready", or nothing when it failed
        if line.strip() != b"ready":
            self._wire.wait(timeout=10)
            raise RuntimeError(
                f"the switch's wire (netns_wire) did not start: {self._wire.stderr.read()[-2000:]!r}"
            )

    def address(self, host: int, nic: int = 0) -> str:
        return f"{RANGE}.{self.subnet * MAX_NICS + nic}.{host + 1}"

    def nic(self, host: int, nic: int = 0) -> str:
        """The NIC's device name inside its host (UCX_NET_DEVICES there)."""
        return f"eth{nic}"

    def command(self, host: int, cmd: list[str]) -> list[str]:
        """cmd run inside host's namespace."""
        return ["ip", "netns", "exec", self.names[host], *cmd]

    def run(self, host: int, cmd: list[str], **popen) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, cmd), **popen)

    def counters(self, host: int, nic: int = 0) -> tuple[int, int]:
        """(bytes sent, bytes received) by host's NIC so far, as its veth counts them."""
        stats = link_stats(self.names[host], f"eth{nic}")
        return stats["tx"]["bytes"], stats["rx"]["bytes"]

    def retransmits(self, host: int) -> int:
        """TCP segments host has sent again so far (its network stack's RetransSegs: what loss costs)."""
        snmp = subprocess.run(self.command(host, ["cat", "/proc/net/snmp"]), capture_output=True, text=True)
        names, values = [line.split() for line in snmp.stdout.splitlines() if line.startswith("Tcp:")][:2]
        return int(values[names.index("RetransSegs")])

    def set_link(self, host: int, up: bool, nic: int = 0) -> None:
        """A fault: take host's NIC down (its link carries nothing either way; TCP retransmits until it is
        back) or bring it up again, addresses and shaping kept."""
        _ip("-n", self.names[host], "link", "set", f"eth{nic}", "up" if up else "down")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for name in [*self.names, self.switch]:
            remove(name)  # the wire too, a process in the switch's namespace
        self._watcher.kill()  # nothing left for it to remove
        self._watcher.wait(timeout=10)
        if self._wire is not None:
            self._wire.wait(timeout=10)
            self._wire.stdout.close()
            self._wire.stderr.close()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":  # the watcher Hosts starts: OWNER_PID NAMESPACE...
    watch(int(sys.argv[1]), sys.argv[2:])
