"""The KV tiers' targets, measured with the main job (`make bench-tiers`; minutes per run):

    python -m experiments.bench.kv_tiers --out bench_results/tiers [--only none,tiers] [--model ...]
        [--reply-spread 32] [--concurrency 8]

SmolLM2 by default, multiturn (16 conversations x 8 turns, 256-token system prompt, 128-token messages,
64-token replies; --reply-spread N draws each reply's length uniformly from 64 +- N), 2 colocated
workers. Every conversation starts at once (--concurrency N: at most N requests in flight, a turn
waiting for a slot, as the multiturn workload's default of 8) and, with replies of one length, a run
whose conversations all run at once (a full cache) may keep them in lockstep, turn after turn: spread
replies break it.
Each worker's device cache holds 25% of the workload's KV (`small`) or all of it (`full`). Variants:
- none: small, round_robin, no tiers;  tiers: small, round_robin, host + disk + pool;
- full: full, round_robin, no tiers (what the tiers should come close to);
- cache_aware: full, cache_aware, no tiers;  pool: full, round_robin, the pool only (cross-worker reuse);
- restart: as tiers, colocated-1 SIGKILLed once half the requests finished and restarted (its hit rate
  before and after);
- 2p2d: 2 prefill + 2 decode workers with the pool (how much each prefill worker loaded from it);
- 1p2d-sent / 1p2d-loaded / 1p2d-cost: 1 prefill + 2 decode workers, round robin, the pool; a decode
  worker lacking a conversation's history (its last turn went to the other one) is sent it
  (kv_tiers.decode_loads=never), loads it from the pool (always), or picks by cost (cost).
--across-hosts RATE runs each variant on hosts in network namespaces (launcher=netns, as root): a worker a
host, the Mooncake Store pool on one more, every link shaped to RATE, so the pool's pages cross links.
Writes <out>/<variant>/results.json and prints one markdown table. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

CONF = str(Path(__file__).resolve().parents[2] / "conf")
CONVERSATIONS, TURNS, SYSTEM, TURN, REPLY = 16, 8, 256, 128, 64


def workload_pages(page_size: int) -> int:
    """The workload's KV in pages: the system prompt once, then every message and reply."""
    return -(-(SYSTEM + CONVERSATIONS * TURNS * (TURN + REPLY)) // page_size)


def variants(page_size: int, kv_bytes_page: int) -> dict[str, list[str]]:
    pages = workload_pages(page_size)
    small, full = pages // 4, pages + 64
    tiers = [
        f"kv_tiers.host_bytes={pages // 2 * kv_bytes_page}",
        f"kv_tiers.disk_bytes={pages * kv_bytes_page}",
        "kv_tiers.store=mooncake",
        f"kv_tiers.store_bytes={max(2 * pages * kv_bytes_page, 64 << 20)}",
    ]
    pool = [f"kv_tiers.host_bytes={64 * kv_bytes_page}", "kv_tiers.store=mooncake"]
    pool += [f"kv_tiers.store_bytes={max(2 * pages * kv_bytes_page, 64 << 20)}"]
    rr, ca = "deployment.routing=round_robin", "deployment.routing=cache_aware"
    out = {
        "none": [f"model.num_pages={small}", rr],
        "tiers": [f"model.num_pages={small}", rr, *tiers],
        "full": [f"model.num_pages={full}", rr],
        "cache_aware": [f"model.num_pages={full}", ca],
        "pool": [f"model.num_pages={full}", rr, *pool],
        "restart": [f"model.num_pages={small}", rr, *tiers, "launcher.max_restarts=1"],
        "2p2d": [f"model.num_pages={full}", "deployment=1p1d", "deployment.num_prefill=2", *pool]
        + ["deployment.num_decode=2", "deployment.name=2p2d"],
    }
    p1d2 = [f"model.num_pages={full}", "deployment=1p1d", "deployment.num_decode=2", rr, *pool]
    p1d2 += ["deployment.name=1p2d"]
    for name, mode in (("sent", "never"), ("loaded", "always"), ("cost", "cost")):
        out[f"1p2d-{name}"] = [*p1d2, f"kv_tiers.decode_loads={mode}"]
    return out


def _killer(worker: str):
    """A hook that SIGKILLs worker once half the requests finished (once)."""
    done = []

    def hook(run, runtime):
        if not done and len(run.results) >= CONVERSATIONS * TURNS // 2:
            done.append(time.perf_counter())
            runtime.fleet.procs[worker].kill()
            done.append(run.start)

    hook.killed = done
    return hook


def summarize(name: str, record: dict, killed_at: float | None = None) -> dict:
    s = record["summary"]
    row = {
        "variant": name,
        "completed": f"{s['completed']}/{s['num_requests']}",
        "hit_rate": s["prefix_hit_rate"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p90_s": s["ttft_s"]["p90"],
        "duration_s": s["duration_s"],
        "kv_sent_mib": s["transfer_bytes"] / 2**20,
        "tier_hits": {t: c["hit_tokens"] for t, c in s["kv_tiers"].items()},
        "by_worker": s["kv_tier_hits"],
    }
    if killed_at is not None:  # colocated-1's later turns: hit rate before the kill and after
        rows = [r for r in record["requests"] if r["worker"] == "colocated-1" and r["turn"] > 0]
        for side, part in (
            ("before", [r for r in rows if r["arrival_s"] < killed_at]),
            ("after", [r for r in rows if r["arrival_s"] >= killed_at]),
        ):
            prompt = sum(r["prompt_tokens"] for r in part)
            row[f"hit_rate_{side}"] = sum(r["cached_tokens"] for r in part) / prompt if prompt else None
    return row


def main() -> None:
    global CONVERSATIONS, TURNS
    from experiments.run import run

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="", help="comma-separated variants (default: all)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--conversations", type=int, default=CONVERSATIONS)
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--reply-spread", type=int, default=0, help=f"replies of {REPLY} +- this many tokens")
    parser.add_argument("--concurrency", type=int, help="requests in flight (default: every conversation)")
    parser.add_argument(
        "--across-hosts",
        metavar="RATE",
        help="each worker on a host of its own (launcher=netns, root) and the pool on one more, every link "
        "at this tc rate (e.g. 1gbit): the pool's pages cross the links",
    )
    args = parser.parse_args()
    if args.concurrency is not None and args.concurrency < 1:
        parser.error(f"--concurrency must be at least 1 request, got {args.concurrency}")
    if not 0 <= args.reply_spread < REPLY:
        parser.error(f"--reply-spread must be in [0, {REPLY}), got {args.reply_spread}")
    CONVERSATIONS, TURNS = args.conversations, args.turns
    base = [f"model={args.model}", "deployment=colocated", "workload=multiturn", "plots=false"]
    in_flight = args.concurrency or CONVERSATIONS
    base += [f"workload.conversations={CONVERSATIONS}", f"workload.concurrency={in_flight}"]
    base += [f"workload.turns={TURNS}", f"workload.system_prompt_len={SYSTEM}", f"workload.turn_len={TURN}"]
    base += [f"workload.output_len.value={REPLY}", "run_timeout_s=3600", "log_level=WARNING"]
    if args.reply_spread:  # the same mean, so the same workload KV in expectation
        low, high = REPLY - args.reply_spread, REPLY + args.reply_spread
        base += ["workload.output_len.kind=uniform", f"workload.output_len.low={low}"]
        base += [f"workload.output_len.high={high}"]
    with initialize_config_dir(config_dir=CONF, version_base=None):
        probe = compose("config", overrides=base)
    from engine.weights import load_model
    from serving.config import runtime_of

    spec = runtime_of(probe).model  # its dtype resolved (auto: bf16 where this CPU computes in it)
    itemsize = 4 if spec.dtype == "float32" else 2
    kv_bytes_page = spec.page_size * load_model(spec.name, weights=False).config.kv_bytes_per_token(itemsize)
    todo = variants(spec.page_size, kv_bytes_page)
    only = [v for v in args.only.split(",") if v]
    rows = []
    for name, overrides in todo.items():
        if only and name not in only:
            continue
        if args.across_hosts:  # as many hosts as workers, and the pool's (launcher=netns: the last one)
            with initialize_config_dir(config_dir=CONF, version_base=None):
                d = runtime_of(compose("config", overrides=[*base, *overrides])).deployments[0]
            workers = d.num_workers if d.colocated else d.num_prefill + d.num_decode
            overrides = [*overrides, "launcher=netns", f"cluster.hosts={workers + 1}"]
            overrides += [f"cluster.link.rate={args.across_hosts}"]
        with initialize_config_dir(config_dir=CONF, version_base=None):
            cfg = compose("config", overrides=[*base, *overrides])
        hook = _killer("colocated-1") if name == "restart" else None
        out = Path(args.out) / name
        (record,) = run(cfg, out, progress=False, hooks=hook)
        killed = hook.killed[0] - hook.killed[1] if hook is not None and hook.killed else None
        rows.append(summarize(name, record, killed))
        print(json.dumps(rows[-1]), flush=True)
    (Path(args.out) / "summary.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))


def table(rows: list[dict]) -> str:
    out = [
        "| variant | requests | prefix hit % | TTFT p50 / p90 s | tier hit tokens host/disk/pool "
        "| KV sent MiB | run s |"
    ]
    out.append("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        hits = "/".join(str(r["tier_hits"].get(t, "-")) for t in ("host", "disk", "pool"))
        out.append(
            f"| {r['variant']} | {r['completed']} | {100 * r['hit_rate']:.0f} | "
            f"{r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f} | {hits} | {r['kv_sent_mib']:.0f} | "
            f"{r['duration_s']:.0f} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    main()
