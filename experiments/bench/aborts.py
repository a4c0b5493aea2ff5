"""Abort storms (`make bench-aborts`): clients that leave at random moments of a disaggregated request,
against our server, and what they leave behind.

python -m experiments.bench.aborts --out DIR [--deployments 1p1d,1p2d] [--requests 300] [--concurrency 32]
    [--prompt-words 700] [--freeze-s 10] [--seed 0] [--model tiny-random]

For each deployment (1P1D, and 1P2D: a prefill worker and two decode workers; the KV tiers on,
kv_tiers.host_bytes=64MiB; prompts prefilled in passes of 256 tokens) a server (`python -m
experiments.serve`) first answers a clean batch (8 greedy completions, one at a time, streamed: their
texts and TTFT), then a storm of `requests` long prompts (about 1,000 tokens of English words) at
`concurrency` clients, each leaving at a random moment: during prefill (its stream's read times out
within 0.7-1 of the first token's expected time: the median of the storm's last 32 first tokens, most of
it queueing), about the transfer (within 0.9-1.1 of it), right after the first token, mid-stream (after
2-30 tokens), a non-streamed request whose client times out (0.2-3 s), or at the end (a tenth of them
read all 64 tokens). Halfway through, once, the first decode worker is frozen (SIGSTOP) for `freeze_s`
seconds. Then the clean batch again.

It reports, per deployment: the storm's requests that ended (every client call returned; must be all);
those whose client left while the prefill worker held them (computing or sending their KV:
pdk_prefills_cancelled); the seconds from the last client leaving until every page on every worker is
free (the workers' Loads, every 0.5 s: the time of the first Load that shows it); the prompt tokens
prefill workers computed more than one step after their client left (pdk_prompt_tokens_after_cancel);
and the clean batch after against before: identical texts, TTFT p50. DIR gets aborts.json and each
server's folder (its logs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from experiments.bench.compat import MODEL, Server

DEPLOYMENTS = {  # name -> the server's deployment and overrides
    "1p1d": ("1p1d", ()),
    "1p2d": ("1p1d", ("deployment.num_decode=2",)),
}
# the tiers on; prompts prefilled in 256-token passes (4 a prompt): a cancel mid-prefill has passes left
# to skip, which late_tokens counts when it does not (a prompt of one pass is never computed late)
SETTINGS = ("kv_tiers.host_bytes=64MiB", "deployment.chunk_size=256")
NUM_PAGES = 1024  # per worker (model.num_pages): a storm's prompts of 1,000 tokens need room
LEAVES = ("prefill", "transfer", "first_token", "mid_stream", "timeout", "end")
WEIGHTS = (2, 2, 2, 2, 1, 1)  # a tenth read to the end
OUTPUT_TOKENS = 64
CLEAN = 8
FREE_WITHIN_S = 120.0  # a bound only pages that never come back reach


def _words(n: int, rng: random.Random) -> str:
    from pydoc_data.topics import topics

    words = re.findall(r"[A-Za-z]+", " ".join(topics.values()))
    start = rng.randrange(len(words) - n)
    return " ".join(words[start : start + n])


def _metrics(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def _free_since(url: str, pages: int) -> float | None:
    """When every worker's last Load showed all its pages free (time.monotonic(), the Load's send time:
    now less its age), or None while some are held."""
    m = _metrics(url)
    free = {dict(k[1])["worker"]: v for k, v in m.items() if k[0] == "pdk_kv_free_pages"}
    age = {dict(k[1])["worker"]: v for k, v in m.items() if k[0] == "pdk_worker_report_age_seconds"}
    if not free or any(v < pages for v in free.values()):
        return None
    return time.monotonic() - max(age.get(w, 0.0) for w in free)


class Client:
    def __init__(self, url: str, model: str = MODEL):
        import openai

        self.url, self.model = url, model
        self._openai = openai
        self.ttfts: list[float] = []  # the storm's first tokens so far (s): when to leave "during prefill"

    def expected_ttft(self, default: float) -> float:
        """A storm request's first token, as the last 32 that came took (default before any came)."""
        recent = self.ttfts[-32:]
        return statistics.median(recent) if recent else default

    def _client(self, timeout: float):
        return self._openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=timeout)

    def clean(self, prompt: str) -> tuple[str, float]:
        """A greedy streamed completion, read whole: its text and TTFT (s)."""
        start, ttft, text = time.perf_counter(), None, []
        kw = dict(model=self.model, prompt=prompt, max_tokens=16, temperature=0, stream=True)
        for chunk in self._client(600).completions.create(**kw):
            if chunk.choices and chunk.choices[0].text:
                ttft = ttft or time.perf_counter() - start
                text.append(chunk.choices[0].text)
        return "".join(text), ttft

    def leave(self, prompt: str, how: str, expected_ttft: float, rng: random.Random) -> str:
        """One storm request whose client leaves as `how` says (prefill, transfer: at a share of
        expected_ttft); what became of it."""
        kw = dict(model=self.model, prompt=prompt, max_tokens=OUTPUT_TOKENS, temperature=0)
        extra = {"ignore_eos": True}
        try:
            if how == "timeout":
                self._client(rng.uniform(0.2, 3.0)).completions.create(extra_body=extra, **kw)
                return "finished"
            wait = {"prefill": rng.uniform(0.7, 1.0), "transfer": rng.uniform(0.9, 1.1)}.get(how)
            timeout = expected_ttft * wait if wait is not None else 600
            start = time.perf_counter()
            stream = self._client(timeout).completions.create(stream=True, extra_body=extra, **kw)
            keep = {"first_token": 1, "mid_stream": rng.randint(2, 30)}.get(how)
            for n, _ in enumerate(stream, start=1):
                if n == 1:
                    self.ttfts.append(time.perf_counter() - start)
                if keep is not None and n >= keep:
                    stream.close()  # the client goes away
                    return "left"
            return "finished"
        except (self._openai.APITimeoutError, self._openai.APIConnectionError):
            return "left"
        except self._openai.APIStatusError as e:
            return f"status {e.status_code}"
        except self._openai.APIError:  # an error event mid-stream (a worker lost: the freeze)
            return "error in stream"


def _pid(run_dir: Path, worker: str) -> int:
    """A worker's pid, from the line its log starts serving with."""
    return int(re.search(r" up: .* pid (\d+)", (run_dir / "logs" / f"{worker}.log").read_text()).group(1))


def storm(
    server: Server,
    requests: int,
    concurrency: int,
    prompt_words: int,
    freeze_s: float,
    seed: int,
    pages: int = NUM_PAGES,
) -> dict:
    """The clean batch, the storm (with its freeze), the clean batch again: the figures."""
    rng = random.Random(seed)
    client = Client(server.url)
    clean = [_words(prompt_words // 2, rng) for _ in range(CLEAN)]
    before = [client.clean(p) for p in clean]
    alone = 2 * statistics.median(t for _, t in before)  # until the storm's own first tokens come
    plan = [
        (_words(prompt_words, rng), rng.choices(LEAVES, WEIGHTS)[0], random.Random(seed + i))
        for i in range(requests)
    ]
    outcomes: dict[str, int] = {}
    started = threading.Semaphore(0)
    frozen = []

    def freeze() -> None:
        for _ in range(requests // 2):
            started.acquire()
        pid = _pid(server.dir, "decode-0")
        os.kill(pid, signal.SIGSTOP)
        frozen.append(time.monotonic())
        time.sleep(freeze_s)
        os.kill(pid, signal.SIGCONT)

    def one(item) -> str:
        prompt, how, r = item
        started.release()
        return client.leave(prompt, how, client.expected_ttft(alone), r)

    freezer = threading.Thread(target=freeze, daemon=True) if freeze_s > 0 else None
    if freezer is not None:
        freezer.start()
    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, plan))
    last_left = time.monotonic()
    if freezer is not None:
        freezer.join()
        last_left = max(last_left, frozen[0] + freeze_s)  # the freeze ends after the last client, at worst
    for r in results:
        outcomes[r] = outcomes.get(r, 0) + 1
    free_at = None
    give_up = time.monotonic() + FREE_WITHIN_S
    while free_at is None and time.monotonic() < give_up:
        free_at = _free_since(server.url, pages)
        time.sleep(0.05)
    time.sleep(1.0)  # the prefill workers' last Loads (their counters) after the pages came back
    m = _metrics(server.url)
    give_up = time.monotonic() + FREE_WITHIN_S
    while any(v for k, v in m.items() if k[0] == "pdk_handoff_requests") and time.monotonic() < give_up:
        time.sleep(0.1)  # a Load that still counted a request in a state: the next one
        m = _metrics(server.url)
    wasted = sum(v for k, v in m.items() if k[0] == "pdk_prompt_tokens_after_cancel_total")
    cut = sum(v for k, v in m.items() if k[0] == "pdk_prefills_cancelled_total")
    held = sum(v for k, v in m.items() if k[0] == "pdk_handoff_requests")  # in any hand-off state now
    ends = {}  # the hand-off's ways out, per side (transfer/handoff.py): "side to_state (cause)" -> count
    for k, v in m.items():
        if k[0] == "pdk_handoff_transitions_total" and v:
            labels = dict(k[1])
            if labels["to_state"] in ("decoding", "recomputing", "freed", "sent", "ended"):
                key = f"{labels['side']} {labels['to_state']} ({labels['cause']})"
                ends[key] = ends.get(key, 0) + int(v)
    after = [client.clean(p) for p in clean]
    return {
        "requests": requests,
        "ended": len(results),
        "outcomes": outcomes,
        "leaves": {h: sum(1 for _, how, _ in plan if how == h) for h in LEAVES},
        "storm_s": round(last_left - t0, 2),
        "pages_free_after_s": None if free_at is None else round(max(0.0, free_at - last_left), 2),
        "prompt_tokens_after_cancel": int(wasted),
        "cancelled_at_prefill": int(cut),  # requests whose client left while the prefill worker held them
        "handoff_held_after": int(held),  # requests in a hand-off state once every page was free (0)
        "handoff_ends": dict(sorted(ends.items(), key=lambda kv: -kv[1])),
        "texts_identical": [t for t, _ in before] == [t for t, _ in after],
        "ttft_before_ms": round(1000 * statistics.median(t for _, t in before), 1),
        "ttft_after_ms": round(1000 * statistics.median(t for _, t in after), 1),
    }


def main(argv=None) -> int:
    from experiments.sim.hardware import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deployments", default="1p1d,1p2d")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=700)
    ap.add_argument("--freeze-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="tiny-random")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name in args.deployments.split(","):
        deployment, overrides = DEPLOYMENTS[name]
        extra = (*overrides, *SETTINGS, f"model.num_pages={NUM_PAGES}")
        server = Server(deployment, args.out, args.model, extra, name=name)
        try:
            rows[name] = storm(
                server, args.requests, args.concurrency, args.prompt_words, args.freeze_s, args.seed
            )
        finally:
            server.close()
        print(name, json.dumps(rows[name]), flush=True)
    meta = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.out / "aborts.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\n{meta['machine']}")
    columns = (
        "deployment", "ended/requests", "cancelled at prefill", "pages free after last client (s)",
        "prompt tokens after cancel", "held in a hand-off state after", "clean texts identical",
        "clean TTFT p50 before -> after ms",
    )  # fmt: skip
    print(" | ".join(columns))
    for name, r in rows.items():
        cells = (name, f"{r['ended']}/{r['requests']}", r["cancelled_at_prefill"], r["pages_free_after_s"],
                 r["prompt_tokens_after_cancel"], r["handoff_held_after"], r["texts_identical"],
                 f"{r['ttft_before_ms']} -> {r['ttft_after_ms']}")  # fmt: skip
        print(" | ".join(str(c) for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
