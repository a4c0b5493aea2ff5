"""Per-request metrics, per-run summaries, SLO attainment and goodput; the run folder's files.

results.json, schema "pdkernels.results/1" (stable: fields may be added, never renamed or removed):

- "schema", "config" (the checked RunConfig), "environment" (git commit, package versions, CPU and GPU
  models: `environment()`), "runs": one entry per deployment (and rate) run.
- run: "deployment", "rate" (req/s, or null under fixed concurrency), "concurrency", "summary",
  "requests", "events" ([seconds since start, what happened]: a worker exiting, a role switch),
  "role_moves" ([{worker, from, to, at (s since start), why, seconds (of the worker's time), settle_s}]),
  "workers" ([{name, role, node_id, pid}]: where each worker ran; node_id is a Ray node id or this host's
  name), "timelines" (per worker: name, role (its last), steps [start, end, prefill tokens, decode
  tokens, sequences verifying drafts, prompt chunks [tokens, first position], KV positions the decode
  tokens attend over (summed)], loads [start, end, tier, pages] (KV loaded from below device memory),
  free_pages and num_pages when it stopped); with deployment.num_workers: auto, "layout_choice" (per split
  of the cores, best first: num_workers, threads_per_worker, simulated_attainment_pct,
  simulated_ttft_p90_s, simulated_tpot_p90_s, fit_error_pct; experiments/layout.py).
- summary: "num_requests", "completed", "errors", "rejected" (refused at once by deployment.admission=slo;
  not errors), "duration_s", "throughput_rps",
  "output_tokens_per_s"; for each of "ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s", "transfer_s",
  "prefill_compute_s", "kv_span_s", "kv_exposed_s" a {"p50", "p90", "p99", "mean", "n"};
  "transfer_bytes", "remote_prefills", "local_prefills", "local_prefills_by_load"
  (deployment.local_prefill_by_load), "slo"
  ({"ttft_s", "tpot_s", "attainment"}), "attainment_pct" (of every arrival: a rejected request misses),
  "admitted_attainment_pct" (of those not rejected), "meets_slo", "goodput_rps", "slo_goodput_rps"
  (requests meeting the SLO per second of the run: vLLM's request goodput; also as
  "request_goodput_rps"); per worker
  ({name: count}) "preemptions", "recomputed_prompt_tokens" (computed again there after a preemption)
  and "refetched_tokens" (a decode worker's, fetched again from a prefill worker), "prefix_queries" and
  "prefix_hits" (prompt tokens looked up in its prefix cache, and found), "rail_failovers" (a prefill
  worker's rails taken down, their KV moved to its other NICs) and "agents_renewed" (a decode worker's
  transfer agents renewed after a post to them was stuck); "migrations" (requests that
  went on on another worker after theirs died: deployment.on_worker_death); "kv_tiers" (per tier below
  device memory, host | disk | pool, over the workers: hit_tokens, bytes_in, bytes_out, loads,
  load_mean_s, load_max_s, evictions, dropped (failed a check), skipped (not saved: no free host slot,
  or a failed put), pages), "kv_tier_hits" ({worker: {tier:
  hit tokens}}); "prefix_hit_rate" (cached
  prompt tokens over prompt tokens, the serving worker's cache); multiturn: "by_turn" (per turn index:
  requests, ttft_p50_s, prompt_tokens_mean, new_tokens_mean, cached_tokens_mean, transfer_bytes_mean).
- request: "request_id", "worker", "prefill" (local | remote), "prefill_worker", "prompt_tokens",
  "output_tokens", "arrival_s", "queue_s", "ttft_s", "tpot_s", "e2e_s", "itl_s" (list),
  "output_ids", "output_logprobs" (with workload.sampling.logprobs: per output token its [token,
  log-probability, rank] entries, the sampled token's and the likeliest), "text" (the output detokenized),
  "transfer_bytes", "transfer_s", "prefill_compute_s" (a
  remote prefill's first pass began -> its last returned, on the prefill worker), "kv_span_s" (its first
  KV post -> every write landed), "kv_exposed_s" (its prefill computed -> every write landed: the part of
  the transfer the compute did not hide; transfer.send_mode), "finish_reason",
  "error", "error_kind" (bad_request | rejected | cancelled | worker_lost | deadline | internal),
  "meets_slo", "cached_tokens" (its prompt tokens the serving worker's prefix cache held); multiturn:
  "conversation", "turn", "new_tokens" (its prompt past the previous turn's: that turn's reply and this
  message).

Times are seconds; arrival_s counts from the run's start; queue_s ends when the first forward pass
that computes the request's tokens starts (for a remote prefill: when its first KV write lands); a
request that failed has ttft_s etc. null and never meets the SLO. A run's goodput_rps is its rate when
its attainment meets the SLO target, else 0, and null at a fixed concurrency (no rate): one point of
DistServe's goodput. The document's "goodput_rps" ({deployment: req/s}) holds DistServe's goodput (the
highest rate meeting the target) for each deployment the run measured at two rates or more
(`goodput_search.rates`; a `-m` sweep's goodput.json holds it across its jobs); the printed table says
"needs a rate sweep" where none did, beside vLLM's request goodput, which every run measures.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import os
from pathlib import Path

import numpy as np

from experiments.config import EndpointConfig, RunConfig
from experiments.record import DeploymentRun
from experiments.sim.hardware import cpu_model
from serving.config import SloConfig

SCHEMA = "pdkernels.results/1"
CSV_FIELDS = (
    "request_id", "worker", "prefill", "prefill_worker", "prompt_tokens", "output_tokens", "arrival_s",
    "queue_s", "ttft_s", "tpot_s", "e2e_s", "transfer_bytes", "transfer_s", "prefill_compute_s",
    "kv_span_s", "kv_exposed_s", "finish_reason", "error",
    "error_kind", "meets_slo", "cached_tokens", "conversation", "turn", "new_tokens",
)  # fmt: skip


def request_rows(run: DeploymentRun, slo: SloConfig) -> list[dict]:
    rows, prompt_len = [], {}  # (conversation, turn) -> prompt tokens
    # each request's transfer as its prefill worker saw it: (id, first pass began, first KV post, computed,
    # done)
    streamed = {s[0]: s for t in run.timelines for s in t.sent}
    for req in run.requests:
        res, sent = run.results.get(req.request_id), run.sent.get(req.request_id)
        ok = res is not None and res.error is None and res.token_times and sent is not None
        times = res.token_times if ok else []
        n_out = (res.output_tokens if res.output_tokens is not None else len(res.output_ids)) if res else 0
        ttft = times[0] - sent if ok else None
        # TPOT leaves out one-token requests (as vLLM does): they have no time per output token
        tpot = (times[-1] - times[0]) / (n_out - 1) if ok and n_out > 1 else None
        row = {
            "request_id": req.request_id,
            "worker": res.worker if res else None,
            "prefill": res.prefill if res else None,
            "prefill_worker": res.prefill_worker if res else None,
            "prompt_tokens": len(req.prompt_ids),
            "output_tokens": n_out,
            "arrival_s": (sent - run.start) if sent is not None else None,
            "queue_s": (res.scheduled - sent) if ok and res.scheduled is not None else None,
            "ttft_s": ttft,
            "tpot_s": tpot,
            "e2e_s": times[-1] - sent if ok else None,
            "itl_s": np.diff(times).tolist() if ok else [],
            "output_ids": list(res.output_ids) if res else [],
            "output_logprobs": [[list(e) for e in token] for token in res.logprobs]
            if res and res.logprobs
            else [],
            "text": res.text if res else "",
            "transfer_bytes": res.transfer_bytes if res else 0,
            "cached_tokens": res.cached_tokens if res else 0,
            "transfer_s": res.transfer_s if res else None,
            **_streaming(res, streamed.get(req.request_id)),
            "finish_reason": res.finish_reason if res else "error",
            "error": (res.error if res else "no result") if not ok else None,
            "error_kind": (str(res.error_kind) if res and res.error_kind else None) if not ok else None,
        }
        row["meets_slo"] = bool(ok and ttft <= slo.ttft_s and (tpot is None or tpot <= slo.tpot_s))
        if req.conversation >= 0:  # multiturn: new tokens are the previous reply and this message
            row["conversation"], row["turn"] = req.conversation, req.turn
            before = prompt_len.get((req.conversation, req.turn - 1), 0)
            row["new_tokens"] = len(req.prompt_ids) - before
            prompt_len[req.conversation, req.turn] = len(req.prompt_ids)
        rows.append(row)
    return rows


def _streaming(res, sent) -> dict:
    """A remote prefill's compute on its prefill worker (its first pass began -> its last returned), and
    its KV from the first post and from the prefill's end to the last write landing (both workers'
    perf_counter: one clock on one machine, network namespaces included; across Ray's machines the two
    clocks differ and these are not comparable)."""
    landed = res.kv_landed if res is not None else None
    _, started, first_post, computed, _ = sent if sent is not None and landed is not None else (None,) * 5
    return {
        "prefill_compute_s": computed - started if computed is not None and started is not None else None,
        "kv_span_s": landed - first_post if first_post is not None else None,
        "kv_exposed_s": landed - computed if computed is not None else None,
    }


def by_turn(rows: list[dict]) -> list[dict]:
    """A multiturn run per turn index: requests, TTFT p50, and means of prompt, new, cached tokens and
    KV bytes sent (empty for other workloads)."""
    out = []
    for t in sorted({r["turn"] for r in rows if "turn" in r}):
        done = [r for r in rows if r.get("turn") == t and r["error"] is None]
        out.append(
            {
                "turn": t,
                "requests": len(done),
                "ttft_p50_s": float(np.median([r["ttft_s"] for r in done])) if done else None,
                **{
                    f"{key}_mean": float(np.mean([r[key] for r in done])) if done else None
                    for key in ("prompt_tokens", "new_tokens", "cached_tokens", "transfer_bytes")
                },
            }
        )
    return out


def vllm_bench(record: dict, config: RunConfig, model_id: str) -> dict:
    """One run in the shape of vLLM's `bench serve --save-result --save-detailed` JSON (vLLM 0.32: times in
    ms, mean/median/std and p50/p90/p99 of ttft, tpot, itl and e2el; per request input_lens, output_lens,
    ttfts and itls in seconds, errors), so that plotting scripts written for vLLM's results read ours.
    request_goodput counts the requests per second that meet every SLO (vLLM's --goodput), not
    DistServe's highest rate meeting the attainment target, which results.json keeps as goodput_rps."""
    import datetime

    rows, s = record["requests"], record["summary"]
    done = [r for r in rows if r["error"] is None]
    duration = s["duration_s"]
    backend = "openai" if record.get("endpoint") else "pdkernels"
    out = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": record["deployment"],
        "model_id": model_id,
        "tokenizer_id": model_id,
        "deployment": record["deployment"],
        "num_prompts": len(rows),
        "request_rate": record["rate"] if record["rate"] is not None else "inf",
        "burstiness": 1.0,  # Poisson arrivals (a gamma of shape 1), as vLLM's default
        "max_concurrency": record["concurrency"],
        "duration": duration,
        "completed": len(done),
        "failed": len(rows) - len(done),
        "total_input_tokens": sum(r["prompt_tokens"] for r in done),
        "total_output_tokens": sum(r["output_tokens"] for r in done),
        "request_throughput": len(done) / duration,
        "output_throughput": sum(r["output_tokens"] for r in done) / duration,
        "total_token_throughput": sum(r["prompt_tokens"] + r["output_tokens"] for r in done) / duration,
        "request_goodput": sum(r["meets_slo"] for r in rows) / duration,
    }
    series = {
        "ttft_ms": [r["ttft_s"] for r in done],
        "tpot_ms": [r["tpot_s"] for r in done if r["tpot_s"] is not None],
        "itl_ms": [x for r in done for x in r["itl_s"]],
        "e2el_ms": [r["e2e_s"] for r in done],
    }
    for name, values in series.items():
        ms = np.asarray(values, dtype=float) * 1e3
        for stat, fn in (("mean", np.mean), ("median", np.median), ("std", np.std)):
            out[f"{stat}_{name}"] = float(fn(ms)) if ms.size else None
        for q in (50, 90, 99):
            out[f"p{q}_{name}"] = float(np.percentile(ms, q)) if ms.size else None
    out["input_lens"] = [r["prompt_tokens"] for r in rows]
    out["output_lens"] = [r["output_tokens"] if r["error"] is None else 0 for r in rows]
    out["ttfts"] = [r["ttft_s"] or 0.0 for r in rows]
    out["itls"] = [r["itl_s"] for r in rows]
    out["errors"] = [r["error"] or "" for r in rows]
    return out


def _speculation(run: DeploymentRun) -> dict:
    """Speculative decoding: drafts accepted over drafted, and tokens produced per verify step."""
    results = [r for r in run.results.values() if r.verify_steps]
    drafted, accepted = sum(r.drafted for r in results), sum(r.accepted for r in results)
    steps = sum(r.verify_steps for r in results)
    return {
        "spec_drafted": drafted,
        "spec_acceptance_rate": accepted / drafted if drafted else None,
        "spec_mean_accepted_length": (accepted + steps) / steps if steps else None,
    }


def percentiles(values: list[float]) -> dict:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "n": 0}
    p50, p90, p99 = np.percentile(vals, [50, 90, 99])
    return {
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "mean": float(np.mean(vals)),
        "n": len(vals),
    }


TIER_SUMS = (
    "hit_tokens",
    "bytes_in",
    "bytes_out",
    "loads",
    "load_s",
    "evictions",
    "dropped",
    "skipped",
    "pages",
)


def kv_tiers(run: DeploymentRun) -> dict:
    """Per tier below device memory (host, disk, pool), over the workers' last reports: prompt tokens
    loaded instead of computed, bytes loaded and saved, loads and their mean and longest time, names
    evicted for room, pages dropped by a check, pages held at the end."""
    out: dict[str, dict] = {}
    for t in run.timelines:
        for tier, c in t.kv_tiers.items():
            s = out.setdefault(tier, {k: 0 for k in TIER_SUMS} | {"load_max_s": 0.0})
            for k in TIER_SUMS:
                s[k] += getattr(c, k)
            s["load_max_s"] = max(s["load_max_s"], c.load_max_s)
    for s in out.values():
        total = s.pop("load_s")
        s["load_mean_s"] = total / s["loads"] if s["loads"] else None
    return out


def summarize(run: DeploymentRun, rows: list[dict], slo: SloConfig, rate: float | None) -> dict:
    done = [r for r in rows if r["error"] is None]
    duration = max(run.end - run.start, 1e-9)
    attainment = 100.0 * sum(r["meets_slo"] for r in rows) / max(len(rows), 1)
    meets = attainment >= slo.attainment
    rejected = sum(r["finish_reason"] == "rejected" for r in rows)
    met = sum(r["meets_slo"] for r in rows)
    return {
        "num_requests": len(rows),
        "completed": len(done),
        "errors": len(rows) - len(done) - rejected,
        "rejected": rejected,
        "duration_s": duration,
        "throughput_rps": len(done) / duration,
        "output_tokens_per_s": sum(r["output_tokens"] for r in done) / duration,
        **{
            k: percentiles([r[k] for r in done])
            for k in (
                "ttft_s",
                "tpot_s",
                "e2e_s",
                "queue_s",
                "transfer_s",
                "prefill_compute_s",
                "kv_span_s",
                "kv_exposed_s",
            )
        },
        "itl_s": percentiles([x for r in done for x in r["itl_s"]]),
        "transfer_bytes": sum(r["transfer_bytes"] for r in rows),
        # prompt tokens whose KV the serving (decode or colocated) worker's prefix cache held
        "prefix_hit_rate": sum(r["cached_tokens"] for r in done)
        / max(sum(r["prompt_tokens"] for r in done), 1),
        **_speculation(run),
        # per worker: preemptions, and the tokens whose KV they dropped (recomputed there, or refetched)
        **{
            key: {t.name: getattr(t, field) for t in run.timelines}
            for key, field in (
                ("preemptions", "preemptions"),
                ("recomputed_prompt_tokens", "recomputed_tokens"),
                ("refetched_tokens", "refetched_tokens"),
                ("prefix_queries", "prefix_queries"),  # prompt tokens looked up in its cache, found there
                ("prefix_hits", "prefix_hits"),
                ("rail_failovers", "rail_failovers"),  # rails taken down (transfer/rails.py)
                ("agents_renewed", "agents_renewed"),
            )
        },
        "kv_tiers": kv_tiers(run),
        # per worker and tier: prompt tokens loaded from it (which worker reused what)
        "kv_tier_hits": {
            t.name: {tier: c.hit_tokens for tier, c in t.kv_tiers.items()}
            for t in run.timelines
            if t.kv_tiers
        },
        "migrations": sum(r.migrations for r in run.results.values()),
        **({"by_turn": by_turn(rows)} if any("turn" in r for r in rows) else {}),
        "remote_prefills": sum(r["prefill"] == "remote" for r in rows),
        "local_prefills": sum(r["prefill"] == "local" for r in rows),
        # ... of them, those a decode worker took because the prefill workers' queue was long
        "local_prefills_by_load": sum(
            r["prefill"] == "local" and r["prefill_worker"] == r["worker"] is not None for r in rows
        ),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment": slo.attainment},
        "attainment_pct": attainment,
        "admitted_attainment_pct": 100.0 * met / max(len(rows) - rejected, 1),
        "slo_goodput_rps": met / duration,
        "request_goodput_rps": met / duration,  # vLLM's request goodput (the same as slo_goodput_rps)
        "meets_slo": meets,
        # a point of DistServe's goodput: this rate if it met the attainment target; no rate, no point
        "goodput_rps": None if rate is None else (rate if meets else 0.0),
    }


def label(rec: dict) -> str:
    """A run's name in tables and plots: its deployment, and its clock when it has one (a Poisson rate, or
    a trace replayed on its timestamps)."""
    if rec["rate"] is not None:
        return f"{rec['deployment']} @{rec['rate']:g}/s"
    if rec.get("arrival") == "trace":
        scale = rec.get("trace_scale", 1.0)
        return f"{rec['deployment']} @trace" + (f" x{scale:g}" if scale != 1 else "")
    return rec["deployment"]


def run_record(run: DeploymentRun, config: RunConfig, rate: float | None) -> dict:
    rows = request_rows(run, config.slo)
    w = config.workload
    d = run.deployment
    return {
        "deployment": d.name,
        **(
            {"endpoint": {"url": d.url, "model": d.model or config.model.name}}
            if isinstance(d, EndpointConfig)
            else {}
        ),
        "rate": rate,
        "arrival": w.arrival,  # how requests came: poisson (at rate), concurrency, or trace
        **({"trace_scale": w.trace_scale} if w.arrival == "trace" else {}),
        "concurrency": w.concurrency if w.arrival == "concurrency" else None,
        "summary": summarize(run, rows, config.slo, rate),
        "requests": rows,
        "events": [[t - run.start, what] for t, what in run.events],
        # elastic roles: each move, when it began (s since the start) and what it took of its worker's time
        "role_moves": [{**m, "at": m["at"] - run.start} for m in run.moves],
        "workers": run.workers,
        "timelines": [
            {
                "name": t.name,
                "role": t.role,
                "steps": [[s - run.start, e - run.start, *rest] for s, e, *rest in t.steps],
                "loads": [[s - run.start, e - run.start, *rest] for s, e, *rest in t.loads],
                "free_pages": t.free_pages,
                "num_pages": t.num_pages,
            }
            for t in run.timelines
        ],
    }


def write_results(out_dir: Path, config: RunConfig, records: list[dict]) -> Path:
    """results.json and one CSV per run, each written whole or not at all (a temporary file, renamed):
    called after every deployment, so an interrupted run keeps what it measured."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    doc = {"schema": SCHEMA, "config": config.to_dict(), "environment": environment(), "runs": records}
    doc["goodput_rps"] = swept_goodput(records)  # DistServe's, per deployment swept over rates
    _atomic(path, json.dumps(doc, indent=1))
    for rec in records:
        name = rec["deployment"] + (f"-rate{rec['rate']:g}" if rec["rate"] is not None else "")
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rec["requests"])
        _atomic(out_dir / f"requests-{name}.csv", text.getvalue())
        bench = vllm_bench(rec, config, rec.get("endpoint", {}).get("model", config.model.name))
        _atomic(out_dir / f"bench-{name}.json", json.dumps(bench, indent=1))  # vLLM's bench serve fields
    return path


@functools.lru_cache(maxsize=1)
def environment() -> dict:
    """What a run was measured with: the git commit (and whether the tree had changes), the versions of
    the packages that shape the figures, the CPU and GPU models."""
    import platform
    import subprocess
    from importlib import metadata

    root = Path(__file__).resolve().parents[1]

    def git(*args):
        try:
            return subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return None

    versions = {}
    for package in ("pdkernels", "torch", "triton", "nixl-cu12", "nixl-cu13", "transformers", "numpy"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    cpu = cpu_model(platform.processor() or None)
    from engine.config import cuda_available

    if cuda_available():
        import torch

        gpu = torch.cuda.get_device_name()
    else:
        gpu = None
    return {
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "python": platform.python_version(),
        "versions": versions,
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "gpu": gpu,
    }


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        f.write(text)
    os.replace(tmp, path)


SWEEP = "needs a rate sweep"  # what the table says of DistServe's goodput where no sweep measured it


def swept_goodput(records: list[dict]) -> dict:
    """goodput() of the deployments these records ran at two rates or more (a sweep's; one run at one rate,
    or at a fixed concurrency, does not measure it)."""
    rates: dict[str, set] = {}
    for r in records:
        if r["rate"] is not None:
            rates.setdefault(r["deployment"], set()).add(r["rate"])
    found = goodput(records)
    return {d: found[d] for d, seen in rates.items() if len(seen) > 1}


def goodput(records: list[dict]) -> dict:
    """Per deployment, the highest rate whose run met the SLO attainment target (0 if none did):
    DistServe's goodput, over the rates the records ran at."""
    out: dict[str, float] = {}
    for r in records:
        if r["rate"] is None:
            continue
        best = out.get(r["deployment"], 0.0)
        out[r["deployment"]] = max(best, r["rate"]) if r["summary"]["meets_slo"] else best
    return out
