"""What the hostile-client tests share: a server in its own session and TMPDIR, raw HTTP, and waits."""

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.experiments.serving import _metrics, _pages_and_ends

PAGES = 256  # tiny-random's pages per worker


ROOT = Path(__file__).resolve().parents[2]


def _start(tmp: Path, *overrides: str, model: str = "tiny-random") -> tuple[subprocess.Popen, str]:
    """A server in its own session and with its own TMPDIR (what a stop must leave empty)."""
    (tmp / "tmp").mkdir(parents=True, exist_ok=True)  # or the short_tmp fixture's link
    args = [sys.executable, "-m", "experiments.serve", f"model={model}", "server.port=0", "plots=false"]
    args += [*overrides, f"hydra.run.dir={tmp}"]
    env = dict(os.environ, TMPDIR=str((tmp / "tmp").resolve()))
    out = open(tmp / "server.out", "w")  # a file, not a pipe nobody reads: a full pipe would block it
    proc = subprocess.Popen(
        args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    out.close()
    give_up = time.monotonic() + 120
    while not (tmp / "server.json").exists():
        if proc.poll() is not None or time.monotonic() > give_up:
            with contextlib.suppress(ProcessLookupError):  # it may have exited: say why, not this
                os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"the server did not start:\n{(tmp / 'server.out').read_text()[-5000:]}")
        time.sleep(0.2)
    return proc, json.loads((tmp / "server.json").read_text())["url"]


def _group(pgid: int) -> list[str]:
    """The command lines of the live processes in a process group (a zombie has exited: init reaps it)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except (OSError, IndexError, ValueError):
            pass
    return out


def _group_gone(pgid: int, within_s: float) -> bool:
    give_up = time.monotonic() + within_s
    while _group(pgid):
        if time.monotonic() > give_up:
            return False
        time.sleep(0.1)
    return True


def _raw(
    url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None, timeout=30
):
    """(status, headers, body) of one request on a fresh connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def _post(url: str, body: bytes | str, **headers):
    body = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    return _raw(url, "POST", "/v1/completions", body, {"Content-Type": "application/json", **headers})


OK = {"model": "tiny-random", "prompt": "Hi", "max_tokens": 4, "temperature": 0}


def _error(status_body) -> dict:
    status, headers, body = status_body
    assert headers.get("content-type", "").startswith("application/json"), (status, body[:200])
    return json.loads(body)["error"]


def _until_gauge(url: str, key: tuple, at_least: float, within_s: float, never: str) -> None:
    """Wait until the server's /metrics sample key (name, labels) reaches at_least: the state a test acts
    in (never: the failure's message, past within_s)."""
    give_up = time.monotonic() + within_s
    while _metrics(url).get(key, 0) < at_least:
        assert time.monotonic() < give_up, never
        time.sleep(0.05)


def _until_in_flight(url: str, n: int, within_s: float = 60) -> None:
    """Wait until the server answers at least n requests (its gauge), which the test acts beside."""
    _until_gauge(
        url, ("pdk_requests_in_flight", ()), n, within_s, f"{n} requests never were in flight together"
    )


def _until_pages_back(url: str, within_s: float = 30) -> None:
    """Wait until every worker's pages are free again (a request seen holding some has ended: the gauge
    is a Load old, so it cannot tell that one just admitted holds none yet)."""
    give_up = time.monotonic() + within_s
    while True:
        free, _ = _pages_and_ends(url)
        if len(free) == 2 and set(free.values()) == {PAGES}:
            return
        assert time.monotonic() < give_up, f"pages still held: {free}"
        time.sleep(0.1)


def _still_serving(url: str) -> None:
    status, _, body = _post(url, json.dumps(OK))
    assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] == "length", body
