"""Servers of their own: a worker that dies, admission that refuses, workers that move between roles
while clients stream, and the socket options every connection gets."""

import asyncio
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest

from engine import SamplingParams
from tests.experiments.serving import (
    KEY,
    PROMPTS,
    ROOT,
    _long_stream,
    _metrics,
    _start,
    _stop,
)


def test_a_dead_worker_gives_503_and_the_server_serves_with_the_rest(tmp_path):
    """on_worker_death=fail: kill one of two colocated workers mid-stream: its request ends with a 503
    error event, /health
    turns 503, and the next requests are served by the live worker."""

    proc, url = _start(
        tmp_path, "deployment=colocated", "deployment.num_workers=2", "deployment.on_worker_death=fail"
    )
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        pids = {}
        for name in ("colocated-0", "colocated-1"):
            log = (tmp_path / "logs" / f"{name}.log").read_text()
            pids[name] = int(re.search(r" up: .* pid (\d+)", log).group(1))
        stream = _long_stream(client, "Doomed:")
        next(iter(stream))  # it is running on one of the two (the least loaded: colocated-0)
        os.kill(pids["colocated-0"], signal.SIGKILL)
        with pytest.raises(openai.APIError) as err:
            for _ in stream:
                pass
        assert "colocated-0 exited" in str(err.value)
        give_up = time.monotonic() + 10
        while time.monotonic() < give_up:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=10)
            except urllib.error.HTTPError as e:
                assert e.code == 503
                break
            time.sleep(0.2)
        else:
            raise AssertionError("/health did not turn 503")
        for _ in range(3):  # served by colocated-1
            out = client.completions.create(
                model="tiny-random", prompt="Still here", max_tokens=4, temperature=0
            )
            assert out.choices[0].finish_reason == "length"
    finally:
        _stop(proc)


def _children(pid: int) -> list[int]:
    """The pids whose parent is pid (from /proc)."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
        except (OSError, IndexError, ValueError):
            pass
    return out


@pytest.mark.slow  # make test-all: a dead worker's streams go on elsewhere is make test's
def test_a_dp_worker_whose_other_engine_dies_hands_its_stream_on(tmp_path):
    """deployment.dp=2: the process of one colocated worker's second DP engine is killed mid-stream: that
    worker fails (its engine cannot step again, nothing waits on it), the stream goes on on the other
    worker and ends as it would have, and the server serves on."""
    from tests.experiments.hostile import _start as start_logged

    overrides = ("deployment.dp=2", "deployment=colocated", "deployment.num_workers=2")
    proc, url = start_logged(tmp_path, *overrides, model="tiny-random-deepseek")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        kw = dict(model="tiny-random-deepseek", prompt="Long:", max_tokens=120, temperature=0)
        want = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
        log = (tmp_path / "logs" / "colocated-0.log").read_text()
        worker = int(re.search(r"colocated-0 up: .* pid (\d+)", log).group(1))
        (engine,) = [c for c in _children(worker) if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
        stream = client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True})
        text = next(iter(stream)).choices[0].text  # it runs (on colocated-0: both were idle)
        os.kill(engine, signal.SIGKILL)
        text += "".join(c.choices[0].text for c in stream)
        assert text == want  # migrated with its tokens so far, greedy: the same text
        assert _metrics(url)[("pdk_migrations_total", ())] == 1
        out = client.completions.create(model="tiny-random-deepseek", prompt="Still", max_tokens=4)
        assert out.choices[0].finish_reason == "length"
        assert "DP engine 1" in (tmp_path / "logs" / "colocated-0.log").read_text()
    finally:
        _stop(proc)


def test_the_servers_connections_send_without_nagle():
    """Each accepted connection has TCP_NODELAY (asyncio sets it on TCP sockets only: the listening
    socket must say IPPROTO_TCP), so a token's chunk never waits for the client's delayed ACK."""
    import socket as so

    from serving.http.server import listening_socket

    async def accepted_nodelay() -> int:
        sock = listening_socket("127.0.0.1", 0)
        seen = asyncio.get_running_loop().create_future()

        def connected(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(so.IPPROTO_TCP, so.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(connected, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        value = await asyncio.wait_for(seen, 10)
        writer.close()
        server.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0


def test_admission_refuses_with_503_and_retry_after_streamed_or_not(tmp_path):
    """deployment.admission=slo with a TTFT bound no prompt can meet: requests are refused at once from
    the first (each worker timed its speed as it started), a stream too (503 with Retry-After before any
    event), counted in /metrics, and the server stays up. While it refuses everything it still admits one
    request per probe interval (it cannot lock itself out), and GET /health says that it is refusing."""
    proc, url = _start(tmp_path, "deployment=colocated", "deployment.admission=slo", "slo.ttft_s=0.000001")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        refused, probes, give_up = 0, 0, time.monotonic() + 120
        for stream in (False, True):  # until one of each is refused
            while True:
                assert time.monotonic() < give_up, "no request was refused"
                try:
                    out = client.completions.create(
                        model="tiny-random", prompt="Refused", max_tokens=2, temperature=0, stream=stream
                    )
                    list(out) if stream else None
                    probes += refused > 0  # admitted after a refusal: a probe
                except openai.APIStatusError as err:
                    assert err.status_code == 503
                    assert err.response.headers["retry-after"]
                    assert "predicted TTFT" in str(err) and "slo.ttft_s" in str(err)
                    refused += 1
                    break
        metrics = _metrics(url)
        assert metrics[("pdk_requests_total", (("finish_reason", "rejected"),))] == refused
        assert metrics[("pdk_admission_rejected", ())] == refused
        assert metrics[("pdk_admission_probes", ())] >= probes
        with pytest.raises(urllib.error.HTTPError) as err:  # the last request was refused: it refuses
            urllib.request.urlopen(f"{url}/health", timeout=10)
        assert err.value.code == 503 and json.loads(err.value.read())["status"] == "refusing"
        assert client.models.list().data  # still serving
    finally:
        _stop(proc)


def test_an_elastic_server_moves_workers_between_roles_while_clients_stream(tmp_path, reference):
    """1 prefill + 2 decode workers with scripted switches (decode-1 turns prefill 1 s after the server
    is up, prefill-0 turns decode at 2 s) while three clients keep asking: every answer is LLM.generate's
    greedy text, none fails, and /metrics shows where the roles ended."""
    import threading

    proc, url = _start(
        tmp_path,
        "deployment=1p1d",
        "deployment.num_decode=2",
        "deployment.planner.switches=[[1, decode-1, prefill], [2, prefill-0, decode]]",
    )
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        # past both switches (3.5 s) and until more than 10 answers came (a slow CPU needs longer for them)
        answers, errors, stop, give_up = [], [], time.monotonic() + 3.5, time.monotonic() + 60

        def ask(k: int) -> None:
            i = 0
            while time.monotonic() < stop or (len(answers) <= 10 and time.monotonic() < give_up):
                prompt = f"{PROMPTS[(k + i) % len(PROMPTS)]} {k}"
                try:
                    kw = dict(model="tiny-random", prompt=prompt, max_tokens=48, temperature=0)
                    if i % 2:  # streamed
                        text = "".join(
                            c.choices[0].text for c in client.completions.create(**kw, stream=True)
                        )
                    else:
                        text = client.completions.create(**kw).choices[0].text
                    answers.append((prompt, text))
                except Exception as e:  # noqa: BLE001 (any failure is the test's)
                    errors.append(repr(e))
                i += 1

        threads = [threading.Thread(target=ask, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        assert len(answers) > 10
        params = SamplingParams(max_tokens=48, temperature=0)
        expected = {
            p: o.text
            for p, o in zip(
                sorted({p for p, _ in answers}),
                reference.generate(sorted({p for p, _ in answers}), params),
                strict=True,
            )
        }
        assert all(text == expected[p] for p, text in answers)
        m = _metrics(url)
        roles = {k[1]: v for k, v in m.items() if k[0] == "pdk_worker_role"}
        assert roles == {
            (("role", "decode"), ("worker", "decode-0")): 1,
            (("role", "prefill"), ("worker", "decode-1")): 1,
            (("role", "decode"), ("worker", "prefill-0")): 1,
        }, roles
        assert m[("pdk_role_switches", ())] == 2
    finally:
        _stop(proc)


def test_the_load_client_measures_a_server_by_url_beside_an_in_process_run(tmp_path):
    """experiment-style: the same workload through our server's URL (kind: endpoint) and in-process;
    the endpoint's row has every request, its token counts, and vLLM's bench fields beside results.json."""
    proc, url = _start(tmp_path / "server", "deployment=colocated", f"server.api_key={KEY}")
    try:
        _measure_by_url(url, tmp_path / "run")
    finally:
        _stop(proc)


def _measure_by_url(url, tmp_path):
    from hydra import compose, initialize_config_dir

    from experiments.run import run

    endpoint = f'{{name: http, kind: endpoint, url: "{url}/v1", api_key: {KEY}}}'
    overrides = ["model=tiny-random", "workload.num_requests=8", "workload.arrival=concurrency"]
    overrides += ["workload.concurrency=4", "workload.output_len.value=6", "workload.prompt_len.value=20"]
    overrides += [
        "plots=false",
        f"deployments=[{{name: inproc, kind: colocated, num_workers: 1}},{endpoint}]",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=overrides)
    records = run(cfg, tmp_path, progress=False)
    by_name = {r["deployment"]: r for r in records}
    http = by_name["http"]
    assert http["summary"]["completed"] == 8 and http["endpoint"]["url"] == f"{url}/v1"
    assert all(r["output_tokens"] == 6 and r["ttft_s"] > 0 and r["tpot_s"] > 0 for r in http["requests"])
    assert all(len(r["itl_s"]) == 5 for r in http["requests"])  # one chunk per token
    # one workload, the main job's runtime in process and the server's over HTTP: the same greedy texts
    texts = {name: {r["request_id"]: r["text"] for r in rec["requests"]} for name, rec in by_name.items()}
    # (a reply of tokens without text, which random weights can sample, is "" on both sides)
    assert texts["http"] == texts["inproc"] and any(texts["http"].values()), texts
    bench = json.loads((tmp_path / "bench-http.json").read_text())
    assert bench["completed"] == 8 and bench["total_output_tokens"] == 48 and bench["max_concurrency"] == 4
    assert bench["median_ttft_ms"] > 0 and bench["p99_itl_ms"] > 0 and bench["model_id"] == "tiny-random"
    assert json.loads((tmp_path / "bench-inproc.json").read_text())["completed"] == 8
    env = json.loads((tmp_path / "results.json").read_text())["environment"]
    assert env["versions"]["torch"] and env["cpu"] and len(env["git_commit"] or "x" * 40) == 40
