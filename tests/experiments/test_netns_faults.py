"""Faults on a link that KV really crosses (launcher=netns): the requests end with the text a run without
the fault gives, every page comes back on both sides, and nothing hangs."""

import os
import threading

import pytest

from experiments.run import run
from tests import needs
from tests.experiments.runs import _cfg, _outputs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)")
needs.nixl()

RUN = [
    "model=tiny-random", "deployment=1p1d", "launcher=netns", "cluster.link.rate=20mbit",
    "workload.num_requests=6", "workload.arrival=concurrency", "workload.concurrency=2",
    "workload.prompt_len.value=600", "workload.output_len.value=8", "plots=false",
    "start_timeout_s=120", "run_timeout_s=300",
]  # fmt: skip
DOWN_S = 2.0


def _pages_back(record) -> None:
    for t in record["timelines"]:
        assert t["free_pages"] == t["num_pages"], (t["name"], t["free_pages"], t["num_pages"])


@pytest.mark.parametrize("loss_pct", [1, 5])
def test_random_loss_on_every_link_loses_no_token(short_tmp, tmp_path, monkeypatch, loss_pct):
    """1% and 5% of packets dropped on each NIC's link both ways (KV, control plane and heartbeats
    alike): TCP retransmits, and every request ends with the tokens of a run without loss."""
    monkeypatch.setenv("TMPDIR", str(short_tmp.resolve()))
    (clean,) = run(_cfg([*RUN, "cluster.subnet=10"]), tmp_path / "clean", progress=False)
    lossy = [*RUN, f"cluster.subnet={11 + (loss_pct > 1)}", f"cluster.link.loss_pct={loss_pct}"]
    (record,) = run(_cfg(lossy), tmp_path / "lossy", progress=False)
    assert record["summary"]["completed"] == 6 and record["summary"]["errors"] == 0
    assert _outputs(record) == _outputs(clean)
    prefill = next(w for w in record["workers"] if w["role"] == "prefill")
    assert prefill["nic_tx_bytes"][0] >= record["summary"]["transfer_bytes"]  # the KV crossed the lossy link
    clean_prefill = next(w for w in clean["workers"] if w["role"] == "prefill")
    assert prefill["tcp_retransmits"] > clean_prefill["tcp_retransmits"]  # and lost some of it on the way
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
