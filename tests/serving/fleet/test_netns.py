"""Hosts in network namespaces (serving/fleet/netns.py): KV written over NIXL/UCX between two of
them crosses their shaped veth link (its counters say so) and arrives intact; nothing is left behind,
a SIGKILLed owner's namespaces included (its watcher removes them); addresses exist only inside the
namespaces."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from serving.fleet import netns
from serving.fleet.netns import Hosts, Link
from tests import needs
from tests.experiments.runs import skip_without_ebpf

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)")
needs.nixl()


def _mine(hosts: Hosts) -> list[str]:
    return [n for n in netns.namespaces() if n in (*hosts.names, hosts.switch)]


def test_a_write_over_nixl_crosses_the_shaped_link_intact(tmp_path):
    nbytes = 32 << 20
    with Hosts(2, Link("400mbit"), subnet=1) as hosts:
        before = [hosts.counters(i) for i in range(2)]
        env = dict(os.environ, TMPDIR=str(tmp_path))
        cmd = [sys.executable, "-m", "tests.experiments.netns_peer"]
        procs = [
            hosts.run(0, [*cmd, "send", str(tmp_path), str(nbytes), hosts.nic(0)], cwd=ROOT, env=env),
            hosts.run(1, [*cmd, "recv", str(tmp_path), str(nbytes), hosts.nic(1)], cwd=ROOT, env=env),
        ]
        assert [p.wait(timeout=180) for p in procs] == [0, 0]
        assert (tmp_path / "recv.result").read_text() == "intact"
        state, seconds = (tmp_path / "send.result").read_text().split()
        assert state == "DONE"
        sent = hosts.counters(0)[0] - before[0][0]
        received = hosts.counters(1)[1] - before[1][1]
        # every byte crossed the veths (not shared memory): the payload plus TCP/IP headers, a few percent
        assert nbytes <= sent <= 1.06 * nbytes and nbytes <= received <= 1.06 * nbytes, (sent, received)
        print(f"{nbytes} bytes in {float(seconds):.3f} s over 400mbit: {sent} bytes on the wire")
    assert not _mine(hosts)


def test_addresses_live_only_inside_the_namespaces():
    with Hosts(2, subnet=2) as hosts:
        root = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True).stdout
        assert hosts.address(0) not in root and hosts.address(1) not in root
        routes = subprocess.run(hosts.command(0, ["ip", "route"]), capture_output=True, text=True).stdout
        assert "default" not in routes and routes.count("\n") == 1  # its own /24, nothing else
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert "h0n0" not in links and "br0" not in links  # no end of any link in the machine's namespace


OWNER = textwrap.dedent(
    f"""
    import os, sys
    sys.path.insert(0, {str(ROOT)!r})
    from serving.fleet.netns import Hosts
    hosts = Hosts(2, subnet=int(sys.argv[1]), tag="killed")
    print(hosts._watcher.pid, " ".join([*hosts.names, hosts.switch]), flush=True)
    print(hosts.run(0, ["sleep", "600"]).pid, flush=True)
    sys.stdin.read()  # until killed
    """
)


def _killed_owner(subnet: int, kill_watcher: bool) -> tuple[list[str], int]:
    """An owner of 2 hosts (a process sleeping in one) SIGKILLed, its watcher first if kill_watcher:
    its namespaces' names and the sleeper's pid."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(subnet)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    watcher, *names = owner.stdout.readline().split()
    sleeper = int(owner.stdout.readline())
    assert len(names) == 3 and all(n in netns.namespaces() for n in names)
    if kill_watcher:
        os.kill(int(watcher), signal.SIGKILL)
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=30)
    return names, sleeper


def test_a_sigkilled_owner_s_namespaces_are_removed_by_its_watcher():
    """The owner runs no cleanup; the watcher Hosts started sees it end and removes its namespaces, and
    kills what ran in them."""
    names, sleeper = _killed_owner(3, kill_watcher=False)
    give_up = time.monotonic() + 120  # a bound only a watcher that never acts reaches
    while any(n in netns.namespaces() for n in names):
        assert time.monotonic() < give_up, f"{names} still there"
        time.sleep(0.05)
    assert _state(sleeper) in (None, "Z")  # killed (a zombie until init reaps it: the owner is gone)


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_namespaces_whose_owner_and_watcher_were_both_killed_go_with_the_next_hosts():
    names, _ = _killed_owner(7, kill_watcher=True)
    assert all(n in netns.namespaces() for n in names)  # nothing ran a cleanup
    with Hosts(1, subnet=4) as hosts:  # the next one sweeps first
        assert not any(n in netns.namespaces() for n in names)
    assert not _mine(hosts)


UDP_PROBE = textwrap.dedent(
    """
    import os, socket, sys
    side, address, folder = sys.argv[1:4]
    WINDOW = 200  # datagrams in flight at most: far below every queue on the path (the CPUs' backlogs: 1,000)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if side == "recv":
        s.setsockopt(socket.SOL_SOCKET, 33, 256 << 20)  # SO_RCVBUFFORCE: nothing dropped by the socket
        s.bind((address, 9000))
        open(folder + "/ready", "w").close()
        seen = set()
        while True:  # until the test stops it
            data, sender = s.recvfrom(64)
            if data.startswith(b"b"):  # a barrier: every datagram of the windows before it has arrived
                open(folder + "/seen.tmp", "w").write(str(len(seen)))
                os.replace(folder + "/seen.tmp", folder + "/seen")
                s.sendto(b"a" + data[1:], sender)
            else:
                seen.add(int(data))
    else:
        import select
        total = int(sys.argv[4])
        for start in range(-WINDOW, total, WINDOW):  # the first barrier resolves the neighbours (ARP): the
            for n in range(max(start, 0), min(start + WINDOW, total)):  # unresolved queue drops the rest
                s.sendto(str(n).encode(), (address, 9000))
            barrier, acked = b"b%d" % start, False  # it crosses the same loss: sent until its ack comes
            while not acked:
                s.sendto(barrier, (address, 9000))
                while not acked and select.select([s], [], [], 0.05)[0]:  # 0.05 s: when to send it again
                    acked = s.recv(64) == b"a" + barrier[1:]
    """
)


@pytest.mark.parametrize("loss_pct", [0, 20])
def test_loss_drops_each_packet_on_its_own_draw_on_both_ends_of_the_path(tmp_path, loss_pct):
    """cluster.link.loss_pct without netem (an eBPF classifier on each NIC's egress, both sides): each
    classifier drops p of the packets it sees (tc's own count), and a datagram from host 0 to host 1
    crosses host 0's link and host 1's, so (1 - p)^2 of them arrive. The sender keeps at most a window of
    them in flight (a barrier acknowledged by the receiver ends each, and one before the first resolves
    the hosts' addresses): sent as fast as it could, the datagrams queued for ARP's answer and the CPUs'
    backlogs overflowed on a busy machine, and 0.55 arrived for 0.64, by machine speed."""
    skip_without_ebpf()
    sent = 4000
    with Hosts(2, Link("100mbit", loss_pct=loss_pct), subnet=12) as hosts:
        probe = [sys.executable, "-c", UDP_PROBE]
        receiver = hosts.run(1, [*probe, "recv", hosts.address(1), str(tmp_path)])
        while not (tmp_path / "ready").exists():
            assert receiver.poll() is None, "the receiver ended before it was ready"
            os.sched_yield()
        sender = hosts.run(0, [*probe, "send", hosts.address(1), str(tmp_path), str(sent)])
        assert sender.wait(timeout=120) == 0
        receiver.kill()
        receiver.wait(timeout=60)
        snmp = subprocess.run(hosts.command(1, ["cat", "/proc/net/snmp"]), capture_output=True, text=True)
        names, values = [line.split() for line in snmp.stdout.splitlines() if line.startswith("Udp:")][:2]
        assert values[names.index("RcvbufErrors")] == "0", "the receiving socket dropped some (not the link)"
        arrived = int((tmp_path / "seen").read_text()) / sent
        want, p = (1 - loss_pct / 100) ** 2, loss_pct / 100
        sides = [(hosts.names[0], "eth0"), (hosts.switch, "h1n0")]  # the path's two egresses
        for hop, (namespace, dev) in enumerate(sides):
            cmd = ["ip", "netns", "exec", namespace, "tc", "-s", "-j", "qdisc", "show", "dev", dev]
            shown = subprocess.run(cmd, capture_output=True, text=True).stdout
            (seen,) = [(q["packets"], q["drops"]) for q in json.loads(shown) if q["kind"] == "clsact"] or [
                (0, 0)
            ]
            if loss_pct:  # each sees what the hop before let through; 0.03: 4 standard deviations at 20%
                assert seen[0] > sent * ((1 - p) ** hop - 0.03), (dev, seen, p)
                assert abs(seen[1] / seen[0] - p) < 0.03, (dev, seen, p)
        dropped = [netns.link_stats(namespace, dev)["tx"]["dropped"] for namespace, dev in sides]
        assert abs(arrived - want) < 0.04, (arrived, want, "veths' drops:", dropped)
        shown = subprocess.run(hosts.command(0, ["tc", "filter", "show", "dev", "eth0", "egress"]),
                               capture_output=True, text=True).stdout  # fmt: skip
        assert ("direct-action" in shown) == (loss_pct > 0)
    assert not _mine(hosts)


def test_the_loss_program_s_threshold_covers_every_percentage():
    """The draw is compared as an unsigned 32-bit number against loss x 2^32 (an immediate that is
    negative as a signed one from 50% on); 100% drops without a draw."""
    import struct

    from serving.fleet import netns_loss

    def below(pct):
        code = netns_loss.program(pct)
        return None if len(code) == 16 else struct.unpack("<BBhi", code[8:16])[3] % 2**32

    assert below(0) == 0 and below(1) == round(0.01 * 2**32) and below(50) == 2**31
    assert below(99.9) == round(0.999 * 2**32) and below(100) is None
    with pytest.raises(ValueError, match="loss_pct=101 is not allowed"):
        netns_loss.program(101)
    skip_without_ebpf()
    os.close(netns_loss.load(5))  # the kernel's verifier takes it


@pytest.mark.parametrize(
    "link, match",
    [
        (dict(rate="fast"), r"cluster.link.rate='fast' is not allowed: a tc rate"),
        (dict(delay_us=-1), r"cluster.link.delay_us=-1 is not allowed"),
        (dict(loss_pct=101), r"cluster.link.loss_pct=101 is not allowed"),
    ],
)
def test_bad_link_settings_name_the_key(link, match):
    with pytest.raises(ValueError, match=match):
        Link(**link)


def test_a_failed_build_leaves_nothing(monkeypatch):
    """A link the kernel cannot shape (a qdisc it lacks) fails naming the qdisc, and the namespaces made
    so far are gone."""
    made = []
    real = netns._ip

    def spy(*args):
        if args[:2] == ("netns", "add"):
            made.append(args[2])
        return real(*args)

    monkeypatch.setattr(netns, "_ip", spy)
    monkeypatch.setattr(Link, "qdisc", lambda self, netem=True: ["no_such_qdisc"])
    with pytest.raises(RuntimeError, match="no_such_qdisc"):
        Hosts(2, subnet=5)
    assert made and not any(n in netns.namespaces() for n in made)


def test_the_main_job_runs_1p1d_across_two_hosts_and_its_kv_crosses_the_link(short_tmp, tmp_path):
    """launcher=netns: the prefill and the decode worker each in a host of its own, 1 Gbit/s between
    them; every request completes, and the prefill host's NIC sent at least the KV the run counts
    (measured: 9% more, the control plane and the transports' headers beside the KV: bounded here)."""
    env = dict(os.environ, TMPDIR=str(short_tmp.resolve()))
    args = [
        sys.executable, "-m", "experiments.run", "model=tiny-random", "deployment=1p1d", "launcher=netns",
        "cluster.link.rate=1gbit", "cluster.subnet=6", "workload.num_requests=8",
        "workload.prompt_len.value=800", "workload.output_len.value=8", "plots=false",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    job = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = job.communicate(timeout=600)
    assert job.returncode == 0, stderr[-3000:]
    run = json.loads((tmp_path / "run" / "results.json").read_text())["runs"][0]
    assert sum(1 for r in run["requests"] if r["finish_reason"] in ("length", "stop")) == 8
    for r in run["requests"]:  # the prefill worker's side of each transfer joined with the decode side's
        assert r["prefill_compute_s"] > 0 and r["kv_exposed_s"] > 0 and r["kv_span_s"] > 0, r
    kv = run["summary"]["transfer_bytes"]
    workers = {w["role"]: w for w in run["workers"]}
    assert workers["prefill"]["node_id"] != workers["decode"]["node_id"]
    sent, received = workers["prefill"]["nic_tx_bytes"][0], workers["decode"]["nic_rx_bytes"][0]
    assert kv > 4 << 20 and kv <= sent <= 1.15 * kv + (256 << 10), (kv, sent)
    assert kv <= received <= 1.15 * kv + (256 << 10), (kv, received)
    # its hosts went with it (those of its process: another test's may be up beside it)
    assert not [n for n in netns.namespaces() if n.startswith(f"{netns.PREFIX}{job.pid}-")]


def test_ray_nodes_one_per_host_run_the_workers_and_the_kv_crosses_the_link(short_tmp, tmp_path, monkeypatch):
    """cluster.ray: a Ray node in each host (the head and the driver on host 0), each worker a Ray actor
    on its host's node; every request completes, the KV crosses the link, and the hosts go with every Ray
    process in them. The user has a Ray token of their own (planted: RAY_AUTH_TOKEN_PATH, as
    ~/.ray/auth_token that Ray's ray.init writes): the cluster uses one of its own on every node (the head
    took the user's and the joining node none: refused, InvalidAuthToken), and the user's is back after."""
    import ray

    from experiments.run import run
    from tests.experiments.runs import _cfg

    monkeypatch.setenv("TMPDIR", str(short_tmp.resolve()))
    token = tmp_path / "auth_token"
    token.write_text("f" * 64)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    mine = f"{netns.PREFIX}{os.getpid()}-"  # this process's hosts (another test's may be up beside them)
    before = {n for n in netns.namespaces() if n.startswith(mine)}
    overrides = [
        "model=tiny-random", "deployment=1p1d", "launcher=netns", "cluster.ray=true", "cluster.subnet=23",
        "cluster.link.rate=1gbit", "workload.num_requests=6", "workload.prompt_len.value=800",
        "workload.output_len.value=8", "plots=false",
    ]  # fmt: skip
    (record,) = run(_cfg(overrides), tmp_path, progress=False)
    assert record["summary"]["completed"] == 6
    workers = {w["role"]: w for w in record["workers"]}
    assert workers["prefill"]["node_id"] != workers["decode"]["node_id"]
    assert workers["prefill"]["ray_node_id"] != workers["decode"]["ray_node_id"]  # two Ray nodes
    kv = record["summary"]["transfer_bytes"]
    assert kv <= workers["prefill"]["nic_tx_bytes"][0] <= 1.15 * kv + (256 << 10)
    assert kv <= workers["decode"]["nic_rx_bytes"][0] <= 1.15 * kv + (256 << 10)
    assert not ray.is_initialized() and {n for n in netns.namespaces() if n.startswith(mine)} <= before
    assert os.environ.get("RAY_AUTH_TOKEN_PATH") == str(token) and "RAY_AUTH_MODE" not in os.environ
    # no Ray process of those hosts left (gcs, raylets, workers: each names its node's address)
    left = subprocess.run(["pgrep", "-f", r"198\.18\.92\."], capture_output=True, text=True).stdout.split()
    assert not left, left


def test_two_nics_a_host_share_out_the_kv_across_mismatched_tp(short_tmp, tmp_path, monkeypatch):
    """cluster.nics_per_host=2: a TP-2 prefill worker's ranks each send on a NIC of their own, to a TP-1
    decode worker whose one agent listens on both; the KV splits across the two links about evenly, and
    the tokens are those of the same deployment on one NIC."""
    from experiments.run import run
    from tests.experiments.runs import _cfg, _outputs

    monkeypatch.setenv("TMPDIR", str(short_tmp.resolve()))
    base = [
        "model=tiny-random", "deployment=1p1d", "deployment.prefill_tp=2", "launcher=netns",
        "cluster.link.rate=50mbit", "workload.num_requests=4", "workload.arrival=concurrency",
        "workload.concurrency=1", "workload.prompt_len.value=600", "workload.output_len.value=4",
        "plots=false",
    ]  # fmt: skip
    (one,) = run(_cfg([*base, "cluster.subnet=20"]), tmp_path / "one", progress=False)
    (two,) = run(
        _cfg([*base, "cluster.subnet=21", "cluster.nics_per_host=2"]), tmp_path / "two", progress=False
    )
    assert two["summary"]["completed"] == 4 and _outputs(two) == _outputs(one)
    kv = two["summary"]["transfer_bytes"]
    workers = {w["role"]: w for w in two["workers"]}
    for side in (workers["prefill"]["nic_tx_bytes"], workers["decode"]["nic_rx_bytes"]):
        assert len(side) == 2 and all(0.4 * kv <= b <= 0.75 * kv for b in side), (kv, side)


def test_one_rank_s_kv_is_striped_over_four_nics(short_tmp, tmp_path, monkeypatch):
    """cluster.nics_per_host=4 and TP 1 on both sides: the rank has an agent on each NIC (a rail), and each
    request's KV is striped over the four links about evenly; the tokens are those of one NIC."""
    from experiments.run import run
    from tests.experiments.runs import _cfg, _outputs

    monkeypatch.setenv("TMPDIR", str(short_tmp.resolve()))
    base = [
        "model=tiny-random", "deployment=1p1d", "launcher=netns", "cluster.link.rate=50mbit",
        "workload.num_requests=3", "workload.arrival=concurrency", "workload.concurrency=1",
        "workload.prompt_len.value=600", "workload.output_len.value=4", "plots=false",
    ]  # fmt: skip
    (one,) = run(_cfg([*base, "cluster.subnet=27"]), tmp_path / "one", progress=False)
    (four,) = run(
        _cfg([*base, "cluster.subnet=28", "cluster.nics_per_host=4"]), tmp_path / "four", progress=False
    )
    assert four["summary"]["completed"] == 3 and _outputs(four) == _outputs(one)
    kv = four["summary"]["transfer_bytes"]
    workers = {w["role"]: w for w in four["workers"]}
    for side in (workers["prefill"]["nic_tx_bytes"], workers["decode"]["nic_rx_bytes"]):
        assert len(side) == 4 and all(0.18 * kv <= b <= 0.4 * kv for b in side), (kv, side)


@pytest.mark.parametrize(
    "cluster, match",
    [
        (dict(hosts=0), r"cluster.hosts=0 is not allowed: an integer in \[1, 250\]"),
        (dict(nics_per_host=5), r"cluster.nics_per_host=5 is not allowed"),
        (dict(link={"rate": "fast"}), r"cluster.link.rate='fast' is not allowed"),
        (dict(link={"speed": 1}), r"cluster.link=.* is not allowed: a mapping of rate"),
        (dict(ray="yes"), r"cluster.ray='yes' is not allowed: true or false"),
    ],
)
def test_bad_cluster_settings_name_the_key(cluster, match):
    from serving.config import ClusterConfig

    with pytest.raises(ValueError, match=match):
        ClusterConfig(**cluster)


def test_without_root_it_refuses_with_a_clear_message(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="launcher=netns.*CAP_NET_ADMIN"):
        Hosts(1)


@pytest.mark.slow  # make test-all; make test: batch-invariant tokens across deployments in tests/engine
def test_batch_invariant_colocated_1p1d_and_1p1d_over_hosts_give_the_same_greedy_tokens(short_tmp, tmp_path):
    """model.batch_invariant: 16 random 512-token prompts at concurrency 4 give the same greedy tokens and
    log-probabilities, to the last bit, colocated (prompts chunked beside other requests' decodes), 1P1D
    over loopback and 1P1D with each worker a host of its own. (Without it the tokens agreed here but the
    log-probabilities did not, in fp32 and in bf16 alike.)"""
    env = dict(os.environ, TMPDIR=str(short_tmp.resolve()))
    common = [
        "model=tiny-random", "model.dtype=float32", "model.batch_invariant=true", "workload.num_requests=16",
        "workload.prompt_len.value=512", "workload.arrival=concurrency", "workload.concurrency=4",
        "workload.output_len.value=16", "workload.sampling={ignore_eos: true, logprobs: 0}", "plots=false",
    ]  # fmt: skip
    runs = {
        "local": [
            "deployments=[{name: colocated, kind: colocated, num_workers: 1, chunk_size: 256},"
            "{name: 1p1d, kind: disaggregated, num_prefill: 1, num_decode: 1, chunk_size: 256}]"
        ],
        "hosts": ["deployment=1p1d", "deployment.chunk_size=256", "launcher=netns", "cluster.subnet=26"],
    }
    outputs = {}
    for name, args in runs.items():
        folder = tmp_path / name
        cmd = [sys.executable, "-m", "experiments.run", *common, *args, f"hydra.run.dir={folder}"]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        for run in json.loads((folder / "results.json").read_text())["runs"]:
            assert run["summary"]["completed"] == 16, run["summary"]
            rows = {r["request_id"]: (r["output_ids"], r["output_logprobs"]) for r in run["requests"]}
            outputs[f"{name} {run['deployment']}"] = rows
    assert sorted(outputs) == ["hosts 1p1d", "local 1p1d", "local colocated"]
    first = outputs["local colocated"]
    assert all(len(ids) == len(logprobs) == 16 for ids, logprobs in first.values())
    assert outputs["local 1p1d"] == first and outputs["hosts 1p1d"] == first
