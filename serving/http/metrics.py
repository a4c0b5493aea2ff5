"""The HTTP server's Prometheus metrics (serving.http.api's App keeps one per server)."""

from __future__ import annotations

import json
import time

from prometheus_client import Gauge

from serving.messages import Result
from serving.runtime import Runtime


class Metrics:
    """Prometheus metrics of one server (its own registry)."""

    def __init__(self, runtime: Runtime, request_log=None):
        """request_log: a text file each finished request's times go to, a JSON line each (or None)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.request_log = request_log

        self.registry = r = CollectorRegistry()
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.requests = Counter(
            "pdk_requests",
            "Finished requests (each of n completions) by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.ttft = Histogram("pdk_time_to_first_token_seconds", "TTFT", buckets=buckets, registry=r)
        self.tpot = Histogram("pdk_time_per_output_token_seconds", "TPOT", buckets=buckets, registry=r)
        self.e2e = Histogram(
            "pdk_e2e_request_latency_seconds", "End-to-end latency", buckets=buckets, registry=r
        )
        self.running = Gauge("pdk_requests_running", "Sequences running, per worker", ["worker"], registry=r)
        self.waiting = Gauge("pdk_requests_waiting", "Sequences queued, per worker", ["worker"], registry=r)
        self.in_flight = Gauge("pdk_requests_in_flight", "Requests the server is answering", registry=r)
        self.routed = Gauge(  # the router's record, read at each scrape: not a Load's age behind
            "pdk_requests_routed", "Requests routed to each worker and not ended yet", ["worker"], registry=r
        )
        self.free_pages = Gauge("pdk_kv_free_pages", "Free KV pages per worker", ["worker"], registry=r)
        self.report_age = Gauge(
            "pdk_worker_report_age_seconds",
            "Seconds since the worker's last message (its gauges here are from its last Load)",
            ["worker"],
            registry=r,
        )
        self.kv_bytes = Counter("pdk_kv_transfer_bytes", "KV bytes written prefill -> decode", registry=r)
        self.transfer_failures = Counter(
            "pdk_transfer_failures", "Requests whose KV transfer failed", registry=r
        )
        self.prefills = Counter("pdk_prefills", "Requests prefilled, by where", ["where"], registry=r)
        self.migrations = Counter(
            "pdk_migrations", "Times a request went on on another worker after its own died", registry=r
        )
        # per worker, from its Load reports (a restarted worker's counts start again from 0)
        self.preemption_counters = {
            "preemptions": Counter(
                "pdk_preemptions", "Sequences preempted (KV dropped), per worker", ["worker"], registry=r
            ),
            "recomputed_tokens": Counter(
                "pdk_recomputed_prompt_tokens",
                "Tokens computed again on a worker after a preemption dropped their KV",
                ["worker"],
                registry=r,
            ),
            "prompt_tokens_after_cancel": Counter(
                "pdk_prompt_tokens_after_cancel",
                "Prompt tokens a prefill worker computed for requests more than one step after their client "
                "went away (work for nobody)",
                ["worker"],
                registry=r,
            ),
            "prefills_cancelled": Counter(
                "pdk_prefills_cancelled",
                "Requests whose client went away while a prefill worker held them (computing or sending)",
                ["worker"],
                registry=r,
            ),
            "rail_failovers": Counter(
                "pdk_rail_failovers",
                "Rails (a rank's NICs) a prefill worker took down, their KV posts moved to its other rails",
                ["worker"],
                registry=r,
            ),
            "agents_renewed": Counter(
                "pdk_transfer_agents_renewed",
                "Transfer agents a decode worker renewed because a post to them was stuck on a rail",
                ["worker"],
                registry=r,
            ),
            "refetched_tokens": Counter(
                "pdk_refetched_tokens",
                "Tokens whose dropped KV a decode worker fetched again from a prefill worker",
                ["worker"],
                registry=r,
            ),
            "prefix_queries": Counter(
                "pdk_prefix_cache_queries",
                "Prompt tokens looked up in a worker's prefix cache",
                ["worker"],
                registry=r,
            ),
            "prefix_hits": Counter(
                "pdk_prefix_cache_hits",
                "Prompt tokens found in a worker's prefix cache (not computed or sent again)",
                ["worker"],
                registry=r,
            ),
        }
        self.cached_pages = Gauge(
            "pdk_prefix_cached_pages", "KV pages a worker's prefix cache names", ["worker"], registry=r
        )
        self._seen: dict[tuple[str, str], int] = {}  # (worker, counter) -> its total at the last scrape
        self._handoff_labels: set[tuple[str, ...]] = set()  # (worker, side, state) of pdk_handoff_requests
        # per worker and tier below device memory (kv_tiers), from its Load reports
        self.tier_counters = {
            key: Counter(f"pdk_kv_tier_{key}", what, ["worker", "tier"], registry=r)
            for key, what in (
                ("hit_tokens", "Prompt tokens loaded from a KV tier instead of computed"),
                ("bytes_in", "Bytes loaded from a KV tier into device pages"),
                ("bytes_out", "Bytes saved into a KV tier"),
                ("loads", "Loads that took pages from a KV tier"),
                ("load_s", "Seconds those loads took, queueing included"),
                ("evictions", "Pages a KV tier dropped for room"),
                ("dropped", "Pages that failed a check (size, namespace, MAC) or a read, recomputed"),
                ("skipped", "Pages not saved into a KV tier: every host slot busy, or the put failed"),
            )
        }
        self.tier_pages = Gauge("pdk_kv_tier_pages", "Pages a KV tier holds", ["worker", "tier"], registry=r)
        # the hand-off's states (transfer/handoff.py), from each worker's Load
        self.handoff = Gauge(
            "pdk_handoff_requests",
            "Disaggregated requests in each hand-off state, per worker and side",
            ["worker", "side", "state"],
            registry=r,
        )
        self.handoff_moves = Counter(
            "pdk_handoff_transitions",
            "Hand-off state moves, per worker and side, by from, to and cause",
            ["worker", "side", "from_state", "to_state", "cause"],
            registry=r,
        )
        self.drafted = Counter("pdk_spec_drafted_tokens", "Speculative tokens proposed", registry=r)
        self.accepted = Counter("pdk_spec_accepted_tokens", "Speculative tokens accepted", registry=r)
        self.verifies = Counter("pdk_spec_verify_steps", "Steps that verified drafts", registry=r)
        self.spec = [0, 0, 0]  # drafted, accepted, verify steps: the ratios below (0 before any draft)
        Gauge(
            "pdk_spec_acceptance_rate", "Accepted over drafted speculative tokens", registry=r
        ).set_function(lambda: self.spec[1] / self.spec[0] if self.spec[0] else 0.0)
        Gauge(
            "pdk_spec_mean_accepted_length", "Tokens a verify step yields (accepted + 1)", registry=r
        ).set_function(lambda: (self.spec[1] + self.spec[2]) / self.spec[2] if self.spec[2] else 0.0)
        self.roles = Gauge(
            "pdk_worker_role", "1 for the role each worker serves now", ["worker", "role"], registry=r
        )
        Gauge(
            "pdk_role_switches", "Workers moved between prefill and decode so far", registry=r
        ).set_function(lambda: len(runtime.moves))
        router = runtime.router
        resent = Gauge(
            "pdk_prefill_resent",
            "Requests prefilled again because their prefill worker died or went silent mid-transfer",
            registry=r,
        )
        resent.set_function(lambda: runtime.prefill_resent)
        Gauge(
            "pdk_admission_refusing_seconds",
            "How long admission=slo has refused every new request (0: it admitted the last one)",
            registry=r,
        ).set_function(lambda: router.refusing or 0.0)
        rejected = Gauge("pdk_admission_rejected", "New requests admission=slo refused so far", registry=r)
        rejected.set_function(lambda: router.rejected)
        Gauge(
            "pdk_admission_probes",
            "Requests admitted while everything else was refused, to measure the deployment again",
            registry=r,
        ).set_function(lambda: router.probes)
        self.runtime = runtime
        self.sent: dict[str, float] = {}

    def sandboxes(self, templates, grammars, compiles) -> None:
        """Gauges of the server's sandboxes (serving.http.sandbox): children killed, specs compiled."""
        killed = Gauge(
            "pdk_sandbox_killed",
            "Sandbox processes killed (past their deadline, their caller gone, or out of memory)",
            ["kind"],
            registry=self.registry,
        )
        for kind, pool in (("template", templates), ("grammar", grammars)):
            if pool is not None:
                killed.labels(kind).set_function(lambda p=pool: p.killed)
        Gauge(
            "pdk_grammar_compiles",
            "Structured-output specs compiled in the sandbox (not found compiled)",
            registry=self.registry,
        ).set_function(compiles)

    def started(self, request_id: str, arrived: float | None = None) -> None:
        """A sequence the workers serve began: a request, or each of its n completions; arrived: when its
        HTTP request came (perf_counter), what its latencies count from (as a client's do)."""
        self.sent[request_id] = time.perf_counter() if arrived is None else arrived
        self.in_flight.inc()

    def first_chunk(self, request_id: str) -> None:
        """A streamed completion's first token is being written to its client (on the event loop): with
        server.request_log, a line of its own says when, from its arrival (what a client times as TTFT;
        the finished row's ttft_s is when the token reached the runtime)."""
        sent = self.sent.get(request_id)
        if self.request_log is not None and sent is not None:
            row = {"id": request_id, "first_chunk_s": time.perf_counter() - sent}
            self.request_log.write(json.dumps(row) + "\n")  # one write: the runtime's thread writes too
            self.request_log.flush()

    def finished(self, request_id: str, result: Result) -> None:
        """Latencies from the token times the runtime took as each token arrived (perf_counter)."""
        now = time.perf_counter()
        sent = self.sent.pop(request_id, now)
        self.in_flight.dec()
        self.requests.labels(result.finish_reason or "unknown").inc()
        self.e2e.observe(now - sent)
        times = result.token_times
        ttft = times[0] - sent if times else None
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
        if self.request_log is not None:
            row = {"id": request_id, "finish": result.finish_reason, "tokens": len(times), "ttft_s": ttft,
                   "tpot_s": tpot, "e2e_s": now - sent}  # fmt: skip
            self.request_log.write(json.dumps(row) + "\n")
            self.request_log.flush()
        self.kv_bytes.inc(result.transfer_bytes)
        self.migrations.inc(result.migrations)
        failed = result.finish_reason == "error" and "transfer" in (result.error or "")
        if failed and result.prefill == "remote":
            self.transfer_failures.inc()
        if result.worker:
            self.prefills.labels(result.prefill).inc()
        self.drafted.inc(result.drafted)
        self.accepted.inc(result.accepted)
        self.verifies.inc(result.verify_steps)
        for i, n in enumerate((result.drafted, result.accepted, result.verify_steps)):
            self.spec[i] += n

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        for name in self.runtime.dead:  # a dead worker's gauges go (a restarted one's Load brings them back)
            for gauge in (self.free_pages, self.running, self.waiting, self.cached_pages, self.report_age):
                try:
                    gauge.remove(name)
                except KeyError:
                    pass
            self._drop_handoff(name)
        self.roles.clear()
        self.routed.clear()
        for name, held in list(self.runtime.router.in_flight.items()):
            if name not in self.runtime.dead:
                self.routed.labels(name).set(len(held))
        for name, role in list(self.runtime.fleet.roles.items()):
            if name not in self.runtime.dead:
                self.roles.labels(name, role).set(1)
        now = time.monotonic()
        for name, heard in list(self.runtime.heard.items()):
            self.report_age.labels(name).set(round(now - heard, 3))
        for name, load in list(self.runtime.load.items()):
            self.free_pages.labels(name).set(load.free_pages)
            self.running.labels(name).set(load.running)
            self.waiting.labels(name).set(load.waiting)
            self.cached_pages.labels(name).set(load.cached_pages)
            for key, counter in self.preemption_counters.items():
                counter.labels(name).inc(self._added(name, key, getattr(load, key)))
            self._drop_handoff(name)  # its side may have changed (a role switch)
            for key, n in load.handoff.items():
                labels = (name, *key.split(".", 1))
                self.handoff.labels(*labels).set(n)
                self._handoff_labels.add(labels)
            for key, total in load.handoff_moves.items():
                self.handoff_moves.labels(name, *key.split("|", 3)).inc(self._added(name, key, total))
            for tier, c in load.kv_tiers.items():
                self.tier_pages.labels(name, tier).set(c.pages)
                for key, counter in self.tier_counters.items():
                    counter.labels(name, tier).inc(self._added(name, f"{tier}.{key}", getattr(c, key)))
        return generate_latest(self.registry)

    def _added(self, name: str, key: str, total: int) -> int:
        """What worker name's running total of a counter (from its Load) added since the last scrape; a
        total below the last one is a restarted worker's (or a new messenger's), counted from 0."""
        seen = self._seen.get((name, key), 0)
        self._seen[name, key] = total
        return total - seen if total >= seen else total

    def _drop_handoff(self, name: str) -> None:
        """Worker name's hand-off gauges go (it died, or its next Load sets them afresh)."""
        for labels in [k for k in self._handoff_labels if k[0] == name]:
            self._handoff_labels.discard(labels)
            self.handoff.remove(*labels)
