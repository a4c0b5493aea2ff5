"""What the server's end-to-end tests share: starting and stopping `python -m experiments.serve`, its
clients, and reading its /metrics."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

from tests.heads import echo_head

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-123"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
FRONT_HAS_TORCH: dict[str, bool] = {}  # a server's url -> whether its own process had torch once it was up


def _start(tmp: Path, *overrides: str) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, "-m", "experiments.serve", "model=tiny-random", "server.port=0", "plots=false"]
    args += [*overrides, f"hydra.run.dir={tmp}"]
    proc = subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True
    )
    give_up = time.monotonic() + 600  # a bound only a broken start reaches, beside busy loops too
    while not (tmp / "server.json").exists():
        if proc.poll() is not None or time.monotonic() > give_up:
            proc.kill()
            raise RuntimeError(f"the server did not start:\n{proc.stdout.read()}")
        time.sleep(0.2)
    return proc, json.loads((tmp / "server.json").read_text())["url"]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM; then nothing of its process group may be left (workers, TP ranks)."""
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    give_up = time.monotonic() + 15
    while time.monotonic() < give_up:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("processes of the server's group were still running 15 s after it exited")


def _client(server, **kw):
    kind, url = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY if kind == "colocated" else "none", **kw)


def _async_client(server):
    kind, url = server
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY if kind == "colocated" else "none")


def _metrics(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    text = urllib.request.urlopen(request, timeout=10).read().decode()  # the key: ignored when none is set
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def _long_stream(client, prompt: str, n: int = 1, max_tokens: int = 1000):
    """A greedy stream of 1,000 tokens (eos ignored): one that is still running when the test acts."""
    return client.completions.create(
        model="tiny-random",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        n=n,
        extra_body={"ignore_eos": True},
    )


def _pages_and_ends(url: str) -> tuple[dict, dict]:
    metrics = _metrics(url)
    free = {k[1][0][1]: v for k, v in metrics.items() if k[0] == "pdk_kv_free_pages"}
    ended = {k[1][0][1]: v for k, v in metrics.items() if k[0] == "pdk_requests_total"}
    return free, ended


def _stopped(ended: dict) -> float:
    return ended.get("abort", 0) + ended.get("error", 0)


def server_per_deployment(request, tmp_path_factory):
    """A server per deployment; the colocated one requires an API key, the 1P1D one's decode worker
    speculates with an MTP head fed by the hand-off (greedy text is the same: lossless)."""
    tmp = tmp_path_factory.mktemp(request.param)
    overrides = [f"deployment={request.param}"]
    if request.param == "colocated":
        overrides.append(f"server.api_key={KEY}")
    else:
        head = echo_head(tmp / "echo.safetensors")
        overrides.append(
            f"deployment.speculative={{method: mtp, num_speculative_tokens: 2, model: '{head}'}}"
        )
    proc, url = _start(tmp, *overrides)
    FRONT_HAS_TORCH[url] = "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()
    yield request.param, url
    _stop(proc)


def _uploading(url: str, source: str = "127.0.0.1") -> socket.socket:
    """A request whose body its client has begun and not finished: in flight (not idle) from when the
    server asks for the body (100 Continue) until server.body_timeout_s."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60, source_address=(source, 0))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: 100\r\nExpect: 100-continue\r\n\r\n".encode())
    assert sock.recv(4096).startswith(b"HTTP/1.1 100 ")
    sock.sendall(b'{"model": ')
    return sock
