"""Faults on a link that KV really crosses (launcher=netns): the requests end with the text a run without
the fault gives, every page comes back on both sides, and nothing hangs."""

import os
import threading
import time

import pytest

from experiments.run import run
from tests import needs
from tests.experiments.runs import _cfg, _outputs, skip_without_ebpf

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)")
needs.nixl()

RUN = [
    "model=tiny-random", "deployment=1p1d", "launcher=netns", "cluster.link.rate=20mbit",
    "workload.num_requests=6", "workload.arrival=concurrency", "workload.concurrency=2",
    "workload.prompt_len.value=600", "workload.output_len.value=8", "plots=false",
    "start_timeout_s=600", "run_timeout_s=600",
]  # fmt: skip
DOWN_S = 2.0


def _pages_back(record) -> None:
    for t in record["timelines"]:
        assert t["free_pages"] == t["num_pages"], (t["name"], t["free_pages"], t["num_pages"])


@pytest.mark.parametrize("loss_pct", [pytest.param(1, marks=pytest.mark.slow), 5])
def test_random_loss_on_every_link_loses_no_token(short_tmp, tmp_path, monkeypatch, loss_pct):
    """1% and 5% of packets dropped on each NIC's link both ways (KV, control plane and heartbeats
    alike): TCP retransmits, and every request ends with the tokens of a run without loss."""
    skip_without_ebpf()
    monkeypatch.setenv("TMPDIR", str(short_tmp.resolve()))
    (clean,) = run(_cfg([*RUN, "cluster.subnet=10"]), tmp_path / "clean", progress=False)
    lossy = [*RUN, f"cluster.subnet={11 + (loss_pct > 1)}", f"cluster.link.loss_pct={loss_pct}"]
    (record,) = run(_cfg(lossy), tmp_path / "lossy", progress=False)
    assert record["summary"]["completed"] == 6 and record["summary"]["errors"] == 0
    assert _outputs(record) == _outputs(clean)
    prefill = next(w for w in record["workers"] if w["role"] == "prefill")
    assert prefill["nic_tx_bytes"][0] >= record["summary"]["transfer_bytes"]  # the KV crossed the lossy link
    clean_prefill = next(w for w in clean["workers"] if w["role"] == "prefill")
    if loss_pct >= 5:  # and lost some of it on the way. Not held at 1%: 1% of a run this small is a
        # handful of drops at most (fewer still where the veths carry TCP's segments unsplit), which the
        # clean run's own retransmits can equal (once in a full suite's run: 2 against the clean run's 3)
        assert prefill["tcp_retransmits"] > clean_prefill["tcp_retransmits"]
    _pages_back(record)


def test_50_ms_of_jitter_loses_no_token(short_tmp, tmp_path, monkeypatch):
    """Delay with 50 ms of jitter on every link (packets reordered): the fault-free tokens. netem delays
    where the kernel has it, the switch's user-space wire (netns_wire) where it has not (as here)."""
    monkeypatch.setenv("TMPDIR", str(short_tmp.resolve()))
    (clean,) = run(_cfg([*RUN, "cluster.subnet=18"]), tmp_path / "clean", progress=False)
    jitter = [*RUN, "cluster.subnet=19", "cluster.link.delay_us=1000", "cluster.link.jitter_us=50000"]
    (record,) = run(_cfg(jitter), tmp_path / "jitter", progress=False)
    assert {w["link_delayed_by"] for w in record["workers"]} <= {"netem", "wire"}
    assert record["summary"]["completed"] == 6 and record["summary"]["errors"] == 0
    assert _outputs(record) == _outputs(clean)
    _pages_back(record)


def test_the_prefill_host_s_link_down_for_2_s_mid_transfer_loses_nothing(short_tmp, tmp_path, monkeypatch):
    """Once the prefill host's NIC has sent the KV of about one request, it goes down for 2 s: TCP
    retransmits once it is back, and every request ends with the tokens of the same run without the
    fault (control messages and heartbeats cross the same link: 2 s is inside peer_timeout_s)."""
    monkeypatch.setenv("TMPDIR", str(short_tmp.resolve()))
    (clean,) = run(_cfg([*RUN, "cluster.subnet=8"]), tmp_path / "clean", progress=False)
    assert clean["summary"]["completed"] == 6
    faults, cut_at = [], []

    def cut_once_kv_flows(run_state, runtime):
        hosts = runtime.fleet.launcher.hosts
        sent = hosts.counters(0)[0]  # host 0: prefill-0's
        if not faults and sent > 400_000:  # the KV of about 2/3 of a request crossed
            hosts.set_link(0, up=False)
            faults.append(threading.Timer(DOWN_S, hosts.set_link, (0, True)))
            faults[0].start()
            cut_at.append((sent, len(run_state.results)))

    (cut,) = run(_cfg([*RUN, "cluster.subnet=9"]), tmp_path / "cut", progress=False, hooks=cut_once_kv_flows)
    assert faults, "the KV never flowed"
    faults[0].join()
    ((sent, finished),) = cut_at
    assert finished < 6, "every request had finished before the cut"
    prefill = next(w for w in cut["workers"] if w["role"] == "prefill")
    assert prefill["nic_tx_bytes"][0] > sent + 400_000, "no KV crossed the link after it came back"
    assert cut["summary"]["completed"] == 6 and cut["summary"]["errors"] == 0
    assert _outputs(cut) == _outputs(clean)
    _pages_back(cut)


# 2 prefill hosts and a decode host; the decode pool holds several requests beside the set-aside ones
TWO_PREFILL = [*RUN, "deployment.num_prefill=2", "cluster.hosts=3", "model.num_pages=1024",
               "transfer.peer_timeout_s=3"]  # fmt: skip
# round_robin: prefill-0 takes the 1st, 3rd and 5th prompts, so the KV crosses host 0's link, which the
# hook cuts. cache_aware picks the prefill worker by the speed each timed as it started, and in CI a
# prefill-0 that timed itself at under half prefill-1's speed (three workers starting on 2 cores) took
# no prompt at all: its link carried no KV and was never cut. (Not for the cut-for-good test: in turn,
# a prompt went to prefill-0 after the cut too, and once no lost transfer's pages were set aside.)
IN_TURN = "deployment.routing=round_robin"
PAGES_A_REQUEST = 150  # 600 prompt tokens at tiny-random's 4 per page


FLOWING_BYTES = 4_000  # more than prefill-0's host sends between two looks unless KV is crossing


def _cut_prefill(down_s: float | None, log: list, workers=("prefill-0",)):
    """A hook: once the host of one of these prefill workers (prefill-0's: host 0) has sent more than a
    request's KV and is sending KV now (its counter grew by FLOWING_BYTES since the hook last looked: a
    transfer is under way, so one is cut mid-flight, not between two), its NIC goes down, for down_s
    seconds or (None) for good. log gets (bytes sent, results so far, the worker cut off)."""
    last: dict[int, int] = {}

    def hook(run_state, runtime):
        launcher = runtime.fleet.launcher
        for name in workers:
            host = launcher._host[name]
            sent = launcher.hosts.counters(host)[0]
            flowing, last[host] = sent - last.get(host, 0) >= FLOWING_BYTES, sent
            if not log and sent > 400_000 and flowing:
                launcher.hosts.set_link(host, up=False)
                log.append((sent, len(run_state.results), name))
                if down_s is not None:
                    log.append(threading.Timer(down_s, launcher.hosts.set_link, (host, True)))
                    log[-1].start()

    return hook


def test_a_prefill_host_cut_off_for_good_loses_no_request(short_tmp, tmp_path, monkeypatch):
    """The host of the prefill worker that carries KV is cut off mid-transfer and never comes back (its
    process lives on). Past transfer.peer_timeout_s the decode worker fails its requests as lost; they
    are sent again, to the other prefill worker, and end with the fault-free tokens. The lost transfers'
    pages stay set aside on the decode side (a write the cut-off worker posted may still land) and their
    ids are free; nothing else is held. Either worker may be the one: cache_aware routing sends the
    prompts to the one that timed itself faster as it started (on a CPU where three workers start on 2
    cores, prefill-1 took all six and prefill-0's link carried nothing)."""
    monkeypatch.setenv("TMPDIR", str(short_tmp.resolve()))
    (clean,) = run(_cfg([*TWO_PREFILL, "cluster.subnet=13"]), tmp_path / "clean", progress=False)
    cut = []
    hook = _cut_prefill(None, cut, workers=("prefill-0", "prefill-1"))
    (record,) = run(_cfg([*TWO_PREFILL, "cluster.subnet=14"]), tmp_path / "cut", progress=False, hooks=hook)
    assert cut and cut[0][1] < 6, "the KV never flowed, or every request had finished before the cut"
    gone = cut[0][2]
    other = {"prefill-0": "prefill-1", "prefill-1": "prefill-0"}[gone]
    assert record["summary"]["completed"] == 6 and record["summary"]["errors"] == 0
    assert _outputs(record) == _outputs(clean)
    assert {r["prefill_worker"] for r in record["requests"]} == {other}  # every one, in the end
    held = {t["name"]: t["num_pages"] - t["free_pages"] for t in record["timelines"]}
    lost = held["decode-0"] // PAGES_A_REQUEST
    assert lost >= 1 and held["decode-0"] == lost * PAGES_A_REQUEST, held  # the lost transfers' alone
    assert held[other] == 0 and held[gone] <= lost * PAGES_A_REQUEST, held


@pytest.mark.slow  # make test-all: a prefill host lost for good is make test's, below
def test_a_prefill_host_s_nic_down_past_peer_timeout_loses_nothing_and_gives_every_page_back(
    short_tmp, tmp_path, monkeypatch
):
    """Prefill-0's NIC goes down while it streams, for longer than transfer.peer_timeout_s (3 s), then
    comes back: its requests were sent again meanwhile and end with the fault-free tokens; once back, its
    posted writes finish and its Ended frees the pages set aside for them, so every page comes back on
    every side (the run's last step waits for that, as the workers' Loads report it)."""
    monkeypatch.setenv("TMPDIR", str(short_tmp.resolve()))
    (clean,) = run(_cfg([*TWO_PREFILL, IN_TURN, "cluster.subnet=15"]), tmp_path / "clean", progress=False)
    cut, back = [], []
    cut_hook = _cut_prefill(5.0, cut)

    def hook(run_state, runtime):
        cut_hook(run_state, runtime)
        if cut and len(run_state.results) == len(run_state.requests) and not back:
            cut[1].join()  # the link is back
            give_up = time.monotonic() + 120
            while any(load.free_pages < 1024 for load in runtime.load.values()):
                assert time.monotonic() < give_up, {n: load.free_pages for n, load in runtime.load.items()}
                time.sleep(0.05)
            back.append(True)

    (record,) = run(
        _cfg([*TWO_PREFILL, IN_TURN, "cluster.subnet=16"]), tmp_path / "cut", progress=False, hooks=hook
    )
    assert cut and back, "the KV never flowed"
    assert cut[0][1] < 6, "every request had finished before the cut"
    assert record["summary"]["completed"] == 6 and record["summary"]["errors"] == 0
    assert _outputs(record) == _outputs(clean)
    _pages_back(record)


def test_a_nic_cut_mid_transfer_moves_its_kv_to_the_host_s_other_nic(short_tmp, tmp_path, monkeypatch):
    """Two NICs a host, TP 1, each request's KV striped over both: once KV flows on the prefill host's NIC
    1, that NIC goes down for good (the control plane rides NIC 0). Its posts stay in flight; past
    transfer.rail_timeout_s the prefill worker retires that rail's agent and sends them over NIC 0, and the
    decode worker renews its agent on NIC 1 before it counts them. No request fails, each ends with the
    tokens of the same run without the cut, and every page comes back on both sides."""
    monkeypatch.setenv("TMPDIR", str(short_tmp.resolve()))
    two = [*RUN, "cluster.nics_per_host=2", "transfer.rail_timeout_s=1"]
    (clean,) = run(_cfg([*two, "cluster.subnet=34"]), tmp_path / "clean", progress=False)
    cut, last = [], {}

    def cut_nic_1(run_state, runtime):
        hosts = runtime.fleet.launcher.hosts
        sent = hosts.counters(0, nic=1)[0]  # host 0: prefill-0's
        flowing, last["sent"] = sent - last.get("sent", 0) >= FLOWING_BYTES, sent
        if not cut and sent > 200_000 and flowing:
            hosts.set_link(0, up=False, nic=1)
            cut.append((sent, len(run_state.results)))

    (record,) = run(_cfg([*two, "cluster.subnet=35"]), tmp_path / "cut", progress=False, hooks=cut_nic_1)
    assert cut and cut[0][1] < 6, "the KV never flowed on NIC 1, or every request had finished before the cut"
    assert record["summary"]["completed"] == 6 and record["summary"]["errors"] == 0
    assert _outputs(record) == _outputs(clean)
    _pages_back(record)
    summary = record["summary"]
    assert summary["rail_failovers"]["prefill-0"] >= 1 and summary["agents_renewed"]["decode-0"] >= 1
    prefill = next(w for w in record["workers"] if w["role"] == "prefill")
    assert prefill["nic_tx_bytes"][0] > 0.5 * record["summary"]["transfer_bytes"]  # NIC 0 took it over
