"""Hostile clients' measurements against a running server (docs/results/security-and-faults.md):

    python scripts/hostile_measure.py URL victim    # a short request's TTFT alone and beside 3 long streams
    python scripts/hostile_measure.py URL grammar   # a stream's inter-token latency quiet and beside a
                                                    # 137-byte structured_outputs pattern that takes 45 s
    python scripts/hostile_measure.py URL health MODEL  # /health latency while hostile chat templates run
                                                    # (a server of tests/experiments/test_serve_hostile.py's
                                                    # _hostile_model folder)

Prints one JSON line. Only talks to URL (a server on this machine).
"""

import json
import sys
import threading
import time
import urllib.error
import urllib.request

import openai


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Probe:
    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)

    def ttft(self) -> float:
        start = time.perf_counter()
        kw = dict(model=self.model, prompt="Victim: hello", max_tokens=4, temperature=0, stream=True)
        for chunk in self.client.completions.create(**kw):
            if chunk.choices and chunk.choices[0].text:
                break
        return time.perf_counter() - start

    def long_stream(self, started: threading.Semaphore, stop: threading.Event, times: list, n: int) -> None:
        kw = dict(model=self.model, prompt="Long output:", max_tokens=n, temperature=0, stream=True)
        for i, _ in enumerate(self.client.completions.create(extra_body={"ignore_eos": True}, **kw)):
            times.append(time.perf_counter())
            if i == 0:
                started.release()
            if stop.is_set():
                break

    def post(self, path: str, body: dict) -> tuple[int, float]:
        start = time.perf_counter()
        req = urllib.request.Request(
            f"{self.url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            urllib.request.urlopen(req, timeout=120).read()
            code = 200
        except urllib.error.HTTPError as e:
            code = e.code
        return code, round(time.perf_counter() - start, 3)

    def victim(self) -> dict:
        """Three 900-token streams start; once one has its first token, five short requests in a row."""
        quiet = [self.ttft() for _ in range(5)]
        started, stop = threading.Semaphore(0), threading.Event()
        streams = [threading.Thread(target=self.long_stream, args=(started, stop, [], 900)) for _ in range(3)]
        for t in streams:
            t.start()
        started.acquire()
        loaded = [self.ttft() for _ in range(5)]
        stop.set()
        for t in streams:
            t.join()
        return {
            "quiet_ttft_ms": [round(x * 1e3, 1) for x in quiet],
            "loaded_ttft_ms": [round(x * 1e3, 1) for x in loaded],
        }

    def grammar(self) -> dict:
        def itl(hostile: bool):
            started, stop, times = threading.Semaphore(0), threading.Event(), []
            t = threading.Thread(target=self.long_stream, args=(started, stop, times, 400))
            t.start()
            started.acquire()
            answer = None
            if hostile:
                spec = {"json": {"type": "string", "pattern": "[a-z]{0,20000}"}}
                body = {"model": self.model, "prompt": "Hi", "max_tokens": 4, "structured_outputs": spec}
                answer = self.post("/v1/completions", body)
            else:
                time.sleep(3)
            stop.set()
            t.join()
            gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
            ms = [round(x * 1e3, 2) for x in (_pct(gaps, 0.5), _pct(gaps, 0.99), max(gaps))]
            return {"itl_p50_p99_max_ms": ms, "answer": answer}

        return {"quiet": itl(False), "hostile": itl(True)}

    def health(self) -> dict:
        out = {}
        for attack in ("pow", "mul", "loop", "big"):
            answer, latencies = [], []
            body = {"model": self.model, "messages": [{"role": "user", "content": attack}], "max_tokens": 2}
            t = threading.Thread(
                target=lambda b=body, out=answer: out.append(self.post("/v1/chat/completions", b))
            )
            t.start()
            while t.is_alive():
                start = time.perf_counter()
                urllib.request.urlopen(f"{self.url}/health", timeout=60).read()
                latencies.append(time.perf_counter() - start)
            t.join()
            worst = round(max(latencies) * 1e3, 1) if latencies else None
            out[attack] = {"answer": answer[0], "health_calls": len(latencies), "health_max_ms": worst}
        return out


if __name__ == "__main__":
    url, what = sys.argv[1], sys.argv[2]
    probe = Probe(url, sys.argv[3] if len(sys.argv) > 3 else "tiny-random")
    print(json.dumps(getattr(probe, what)()))
