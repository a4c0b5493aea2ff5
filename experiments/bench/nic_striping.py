"""One request's KV over 1, 2 and 4 NICs a host at the same per-NIC rate, and a NIC cut mid-transfer.

    python -m experiments.bench.nic_striping [--rate 100mbit] [--prompt 2000] [--requests 3]
        [--nics 1 2 4] [--model tiny-random] [--out DIR] [--cut]

Runs the main job (deployment=1p1d, launcher=netns: root) once per NIC count, the prefill worker of one
TP rank with an agent on each of its host's NICs (transfer/agents.py: a rail each), requests one at a
time with `transfer.send_mode=request` (a request's pages are posted together once its prefill is
computed, so the span from its first post to its last write landing is the wire's, not the compute's).
Prints, per NIC count, the KV bytes of a request over that span (median of the requests), its ratio to
one NIC's, and each NIC's share of the bytes its host sent (the veths' counters). With --cut, one more
run of two NICs in which the prefill host's NIC 1 goes down for good once it has sent a quarter of the
first request's KV: each request's KV rate, whether it completed, and the rails taken down.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def measure(
    nics: int, rate: str, prompt: int, requests: int, model: str, out: Path, subnet: int, cut_at: int = 0
) -> dict:
    """A run of `nics` NICs a host; cut_at > 0: NIC 1 of the prefill host goes down for good once it has
    sent that many bytes."""
    from engine.role import Role
    from experiments.run import run

    cut = []

    def cut_nic_1(run_state, runtime):
        hosts = runtime.fleet.launcher.hosts
        if not cut and hosts.counters(0, nic=1)[0] > cut_at:
            hosts.set_link(0, up=False, nic=1)
            cut.append(len(run_state.results))

    overrides = [
        f"model={model}", "deployment=1p1d", "launcher=netns", f"cluster.nics_per_host={nics}",
        f"cluster.link.rate={rate}", f"cluster.subnet={subnet}", "transfer.send_mode=request",
        f"workload.num_requests={requests}", "workload.arrival=concurrency", "workload.concurrency=1",
        f"workload.prompt_len.value={prompt}", "workload.output_len.value=2", "plots=false",
        f"model.num_pages={prompt // 2 + 64}",  # pages of 4 tokens or more: two prompts' worth
        "start_timeout_s=600", "run_timeout_s=600",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("config", overrides=overrides)
    hooks = cut_nic_1 if cut_at else None
    (record,) = run(cfg, out / f"nics-{nics}{'-cut' if cut_at else ''}", progress=False, hooks=hooks)
    rows = [r for r in record["requests"] if r["kv_span_s"]]
    if cut_at:
        return {
            "completed": record["summary"]["completed"],
            "errors": record["summary"]["errors"],
            "cut_after": cut[0] if cut else None,
            "rates": [r["transfer_bytes"] / r["kv_span_s"] for r in rows],
            "failovers": sum(record["summary"]["rail_failovers"].values()),
            "renewed": sum(record["summary"]["agents_renewed"].values()),
        }
    prefill = next(w for w in record["workers"] if w["role"] == Role.PREFILL)
    sent = prefill["nic_tx_bytes"]
    return {
        "nics": nics,
        "completed": record["summary"]["completed"],
        "bytes": statistics.median(r["transfer_bytes"] for r in rows),
        "rate": statistics.median(r["transfer_bytes"] / r["kv_span_s"] for r in rows),
        "shares": [b / sum(sent) for b in sent],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", default="100mbit", help="each NIC's link rate (tc)")
    parser.add_argument("--prompt", type=int, default=2000, help="prompt tokens a request")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--nics", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--out", type=Path, default=None, help="the runs' folders (default: a temporary one)")
    parser.add_argument("--cut", action="store_true", help="and a run of two NICs with NIC 1 cut")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="nic-striping-"))
    results = [
        measure(n, args.rate, args.prompt, args.requests, args.model, out, 30 + i)
        for i, n in enumerate(args.nics)
    ]
    base = results[0]["rate"]
    print(f"model {args.model}, {args.prompt}-token prompts, {args.rate} a NIC, runs in {out}")
    print(
        "| NICs | requests | KV a request MiB | KV MB/s (first post -> landed) | x one NIC | NICs' shares |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    for r in results:
        shares = " / ".join(f"{s:.2f}" for s in r["shares"])
        print(
            f"| {r['nics']} | {r['completed']} | {r['bytes'] / 2**20:.2f} | {r['rate'] / 1e6:.2f} | "
            f"{r['rate'] / base:.2f} | {shares} |"
        )
    if args.cut:
        kv = results[0]["bytes"]
        c = measure(2, args.rate, args.prompt, args.requests, args.model, out, 29, cut_at=int(kv / 4))
        rates = " / ".join(f"{r / 1e6:.2f}" for r in c["rates"])
        print(
            f"NIC 1 cut after {c['cut_after']} of {args.requests} requests had finished: {c['completed']} "
            f"completed, {c['errors']} errors, {c['failovers']} rails taken down, {c['renewed']} decode "
            f"agents renewed; each request's KV MB/s (first post -> landed): {rates}"
        )


if __name__ == "__main__":
    main()
