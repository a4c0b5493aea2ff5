"""Chaos soak (`make soak`, marked slow): the HTTP server on a 2P2D tiny-random deployment for
PDK_CHAOS_S seconds (600 by default) at about 2 requests/s, greedy, half of them streamed, with a random
worker SIGKILLed every 60 s and restarted by the local launcher (launcher.max_restarts). Every request
must end (none hung), at least 99% with exactly the text of a fault-free LLM.generate, no page held on
any worker at the end, and the server's resident memory grown under 5% from the first kill on."""

import json
import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import openai
import pytest

from tests import needs

needs.nixl()

from tests.experiments.serving import _pages_and_ends  # noqa: E402
from tests.experiments.test_serve_hostile import PAGES, _group_gone, _start  # noqa: E402

WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")
RATE, MAX_TOKENS, KILL_EVERY_S = 2.0, 32, 60.0


def _pids(run_dir: Path, name: str) -> list[int]:
    """Every process that served as the worker, in order (a restarted one appends to its log)."""
    return [int(p) for p in re.findall(r" up: .* pid (\d+)", (run_dir / "logs" / f"{name}.log").read_text())]


def _pid(run_dir: Path, name: str) -> int | None:
    """The worker's current pid."""
    pids = _pids(run_dir, name)
    return pids[-1] if pids else None


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ten minutes of traffic and more (the suite's ceiling is 900 s)
def test_chaos_soak_through_the_http_server(tmp_path):
    from engine import LLM, SamplingParams

    duration = float(os.environ.get("PDK_CHAOS_S", 600))
    prompts = [f"Soak {i}: the numbers go {i}, {i + 1}, {i + 2} and then" for i in range(40)]
    reference = LLM("tiny-random")
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.text for o in reference.generate(prompts, params)]
    del reference
    proc, url = _start(
        tmp_path, "deployment=1p1d", "deployment.num_prefill=2", "deployment.num_decode=2",
        "launcher.max_restarts=100",
    )  # fmt: skip
    rng = random.Random(0)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=180)
    outcome: dict[int, str] = {}  # request -> "same" | "different" | the error
    threads: list[threading.Thread] = []
    kills: list[tuple[float, str]] = []

    def one(i: int) -> None:
        p = i % len(prompts)
        kw = dict(model="tiny-random", prompt=prompts[p], max_tokens=MAX_TOKENS, temperature=0)
        kw["extra_body"] = {"ignore_eos": True}
        try:
            if i % 2:
                text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
            else:
                text = client.completions.create(**kw).choices[0].text
            outcome[i] = "same" if text == want[p] else "different"
        except Exception as e:  # counted: the soak's finding
            outcome[i] = repr(e)[:200]

    try:
        start = time.monotonic()
        next_kill, rss_at_first_kill, i = start + KILL_EVERY_S, None, 0
        while time.monotonic() - start < duration:
            t = threading.Thread(target=one, args=(i,), daemon=True)
            t.start()
            threads.append(t)
            i += 1
            if time.monotonic() >= next_kill:
                if rss_at_first_kill is None:
                    rss_at_first_kill = _rss_mib(proc.pid)
                name = rng.choice(WORKERS)
                pid = _pid(tmp_path, name)
                if pid is not None:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        kills.append((time.monotonic() - start, name))
                    except ProcessLookupError:  # still restarting from an earlier kill
                        pass
                next_kill += KILL_EVERY_S
            time.sleep(rng.expovariate(RATE))
        give_up = time.monotonic() + 240
        for t in threads:
            t.join(timeout=max(0.0, give_up - time.monotonic()))
        hung = sum(t.is_alive() for t in threads)
        time.sleep(3)  # the workers' last Load (every second) reaches /metrics
        free, _ = _pages_and_ends(url)
        rss_end = _rss_mib(proc.pid)
        same = sum(v == "same" for v in outcome.values())
        errors = [v for v in outcome.values() if v not in ("same", "different")]
        report = {
            "seconds": round(duration),
            "requests": len(threads),
            "same_text": same,
            "different_text": sum(v == "different" for v in outcome.values()),
            "errors": len(errors),
            "error_samples": errors[:3],
            "hung": hung,
            "kills": kills,
            "restarts": {n: len(_pids(tmp_path, n)) - 1 for n in WORKERS},
            "free_pages": free,
            "server_rss_mib": [round(rss_at_first_kill or rss_end, 1), round(rss_end, 1)],
        }
        print("chaos soak:", json.dumps(report))
        (tmp_path / "chaos.json").write_text(json.dumps(report, indent=1))
        assert hung == 0, report
        assert same >= 0.99 * len(threads), (report, errors[:5])
        assert set(free) == set(WORKERS) and all(v == PAGES for v in free.values()), report
        if rss_at_first_kill is not None:
            assert rss_end < 1.05 * rss_at_first_kill, report
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if not _group_gone(proc.pid, 5):
                os.killpg(proc.pid, signal.SIGKILL)
