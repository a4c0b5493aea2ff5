"""The HTTP front as an attacker on the same host and a careless client use it (issue: nothing lost,
nothing wedged): each request's failure stays its own, bodies and prompts are bounded and parsed off the
event loop, clients that go away cancel their requests, cross-site requests are refused, every error has
OpenAI's JSON shape, and SIGTERM stops everything, a frozen worker too."""

import http.client
import json
import os
import signal
import threading
import time

import openai
import pytest

from tests.experiments.hostile import (
    OK,
    PAGES,
    _error,
    _group_gone,
    _post,
    _raw,
    _start,
    _still_serving,
    _until_in_flight,
    _until_pages_back,
)
from tests.experiments.serving import _long_stream, _metrics, _pages_and_ends, _stopped


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    proc, url = _start(
        tmp,
        "deployment=1p1d",
        "server.max_body_bytes=1000000",
        "server.template_timeout_s=1",
        # the hostile pattern's window: a stream on the decode worker must gain tokens while it compiles.
        # Under the full suite one such stream once got none for 2.3 s (cause not found: the sandbox child
        # runs at nice 10-19, waited on off the event loop); a freeze for the whole compile still fails
        "server.grammar_timeout_s=4",
    )
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    if not _group_gone(proc.pid, 15):
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("processes of the server's group outlived it")


def test_a_field_the_wire_cannot_carry_fails_alone(server):
    """top_k or seed of 2**64 beside requests in flight: a 400 naming the field; the others finish.
    Each runs 160 steps (eos ignored; six fit the 256 pages of 4) to overlap the others by a wide
    margin: at 60 tokens the first once ended before the sixth began, under the full suite."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    results = []

    def long_one(stream: bool):
        kw = dict(
            model="tiny-random",
            prompt="Long:",
            max_tokens=160,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        if stream:
            results.append("".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)))
        else:
            results.append(client.completions.create(**kw).choices[0].finish_reason)

    threads = [threading.Thread(target=long_one, args=(i % 2 == 0,)) for i in range(6)]
    for t in threads:
        t.start()
    _until_in_flight(server, 6)
    for field, value in (("top_k", 2**64), ("seed", 2**64), ("max_tokens", 2**64), ("top_k", -(2**70))):
        err = _error(_post(server, json.dumps(dict(OK, temperature=1.0, **{field: value}))))
        assert err["param"] == field and err["type"] == "invalid_request_error", err
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 6 and all(r for r in results), results  # every one finished, none failed


def test_a_huge_body_is_refused_early_and_health_answers_meanwhile(server):
    """A 20 MB body (declared, and streamed chunked with no length): 413 before it is read whole, while
    /health answers."""
    big = json.dumps(dict(OK, prompt="x" * 20_000_000)).encode()
    seen = []

    def upload():
        seen.append(_post(server, big))

    t = threading.Thread(target=upload)
    t.start()
    for _ in range(5):
        status, _, _ = _raw(server, "GET", "/health", timeout=5)  # answers while the upload runs
        assert status == 200
    t.join(timeout=60)
    status, headers, body = seen[0]
    assert status == 413 and "max_body_bytes" in json.loads(body)["error"]["message"]

    def chunks():
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    host, port = server.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            body=chunks(),
            headers={"Content-Type": "application/json"},
            encode_chunked=True,
        )
        resp = conn.getresponse()
        assert resp.status == 413
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed while the rest was still being sent: refused all the same
    finally:
        conn.close()
    _still_serving(server)


def test_a_prompt_past_the_character_cap_is_refused_before_tokenizing(server):
    err = _error(_post(server, json.dumps(dict(OK, prompt="ab " * 300_000))))  # 900 KB: under the body cap
    assert err["param"] == "prompt" and "max_prompt_chars" in err["message"]
    chat = {"model": "tiny-random", "messages": [{"role": "user", "content": "ab " * 300_000}]}
    status, headers, body = _raw(
        server,
        "POST",
        "/v1/chat/completions",
        json.dumps(chat).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 400 and json.loads(body)["error"]["param"] == "messages"


@pytest.mark.parametrize(
    "body, param",
    [
        ('{"model": "tiny-random", "prompt": "Hi", "temperature": NaN}', None),
        ('{"model": "tiny-random", "prompt": "Hi", "top_p": Infinity}', None),
        ('{"model": "tiny-random", "prompt": "Hi", "temperature": 1e999}', "temperature"),
        ("[" * 100_000 + "]" * 100_000, None),
        ('{"model": "tiny-random", "prompt": "Hi", "max_tokens": ' + "9" * 5000 + "}", None),
        ('{"model": "tiny-random", "prompt": "\\ud800"}', None),
        ('{"model": "tiny-random", "prompt": "Hi", "max_tokens": 4', None),
        ("[]", None),
    ],
    ids=[
        "nan",
        "infinity",
        "overflowing-float",
        "deep-nesting",
        "5000-digits",
        "lone-surrogate",
        "truncated",
        "array",
    ],
)
def test_every_bad_body_is_a_400_in_openais_shape(server, body, param):
    err = _error(_post(server, body))
    assert err["type"] == "invalid_request_error" and err["message"], err
    if param is not None:
        assert err["param"] == param
    _still_serving(server)


def test_cross_site_requests_are_refused(server):
    """A web page can POST text/plain without a preflight, and DNS rebinding sends a foreign Host."""
    status, _, body = _post(server, json.dumps(OK), **{"Content-Type": "text/plain"})
    assert status == 415 and json.loads(body)["error"]["type"] == "invalid_request_error"
    err = _error(_post(server, json.dumps(OK), Host="evil.example:8000"))
    assert err["param"] == "host"
    err = _error(_post(server, json.dumps(OK), Origin="https://evil.example"))
    assert err["param"] == "origin"
    status, _, _ = _raw(server, "GET", "/metrics", headers={"Host": "rebind.example"})
    assert status == 403
    _still_serving(server)


def test_a_non_streamed_request_whose_client_goes_away_is_cancelled(server):
    """The client sends a 1,000-token request for 3 completions and closes its socket: all three end
    (abort) and every page is back on both workers, instead of running to their end."""
    stopped_before = _stopped(_pages_and_ends(server)[1])
    host, port = server.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps(dict(OK, prompt="Long:", max_tokens=1000, ignore_eos=True, n=3))
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    _until_in_flight(server, 3)  # its 3 completions are with the workers
    conn.sock.close()  # gone, without reading the answer
    give_up = time.monotonic() + 20
    while time.monotonic() < give_up:
        free, ended = _pages_and_ends(server)
        if len(free) == 2 and set(free.values()) == {PAGES} and _stopped(ended) > stopped_before:
            break
        time.sleep(0.2)
    assert free == {w: PAGES for w in free} and len(free) == 2, free
    assert _stopped(ended) == stopped_before + 3, ended


def _stream_beside(url: str, hostile) -> tuple[int, object]:
    """(tokens a greedy stream received while hostile() ran, what hostile() returned): the stream is
    running (its first token came) before hostile() starts, and runs on after it ends."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    started, stop, arrivals = threading.Event(), threading.Event(), []

    def stream():
        # 1,000 tokens (the server's context holds 1,020) took 2-3 s on an AVX-512 EPYC, about as long as a
        # refused grammar: a stream may end while the grammar runs (its tokens till then count)
        with _long_stream(client, "Stream on:") as chunks:  # closed on leaving: the server cancels it
            for _ in chunks:
                arrivals.append(time.monotonic())
                started.set()
                if stop.is_set():
                    break

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60), "the stream did not start"
    before, began = len(arrivals), time.monotonic()
    out = hostile()
    during, ended = len(arrivals) - before, time.monotonic()
    stop.set()
    t.join(timeout=120)
    _until_pages_back(url)  # its pages too: the next test starts with every page free
    if during == 0:  # what the stream did around it, for the failure's message
        print(f"no token during {ended - began:.2f} s: {before} before, the last at "
              f"{arrivals[-1] - began:+.2f} s, {len(arrivals)} in all")  # fmt: skip
    return during, out


HOSTILE_SPECS = {  # 137 bytes that froze every stream on the decode worker for 21.6 s
    "pattern": {"json": {"type": "string", "pattern": "[a-z]{0,20000}"}},
    "nested": {"json": json.loads('{"items":' * 600 + "{}" + "}" * 600)},  # stalled a worker 6.3 s
}


@pytest.mark.parametrize("name", sorted(HOSTILE_SPECS))
def test_a_hostile_grammar_is_refused_in_its_sandbox_while_streams_go_on(server, name):
    """The spec converts and compiles in the server's sandbox (a process killed past
    server.grammar_timeout_s), never on a worker's step loop: a 400 naming the field, and a stream on
    the decode worker kept receiving tokens all the while."""
    body = dict(OK, structured_outputs=HOSTILE_SPECS[name])
    during, answer = _stream_beside(server, lambda: _post(server, json.dumps(body)))
    status, _, raw = answer
    err = json.loads(raw)["error"]
    if name == "pattern":  # 23 s to convert here before the sandbox: now stopped at 4 s
        assert status == 400 and err["param"] == "structured_outputs", err
        assert "grammar_timeout_s" in err["message"], err
    else:  # either within the limits (then it was compiled in the sandbox, not the worker) or refused
        assert status in (200, 400), raw[:300]
    assert during > 0  # the stream was not frozen while it compiled
    _still_serving(server)


def test_the_same_schema_with_other_whitespace_compiles_once(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    before = _metrics(server)[("pdk_grammar_compiles", ())]
    for indent in (None, 2, 8):
        text = json.dumps({"model": "tiny-random", "prompt": "Hi", "max_tokens": 16,
                           "structured_outputs": {"json": schema}}, indent=indent)  # fmt: skip
        status, _, raw = _post(server, text)
        assert status == 200, raw[:300]
    compiled = _metrics(server)[("pdk_grammar_compiles", ())] - before
    assert compiled == 1  # the server's cache keys on the canonical form


def test_the_prefix_cache_is_no_oracle_across_cache_salts(server):
    """A cache-timing oracle: a prefix another tenant cached answered 15x faster, and cached_tokens said so.
    With different cache_salts nothing is shared, on the decode worker (cached_tokens 0) and on the
    prefill worker (its prefix-cache hits do not grow); the same salt still finds its prefix."""
    prompt = "A prefix that one tenant sends and another probes for. " * 12

    def ask(salt: str) -> int:
        status, _, raw = _post(server, json.dumps(dict(OK, prompt=prompt, max_tokens=2, cache_salt=salt)))
        assert status == 200, raw[:300]
        return json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]

    def prefill_counts() -> tuple[float, float]:
        m, worker = _metrics(server), (("worker", "prefill-0"),)
        return m.get(("pdk_prefix_cache_queries_total", worker), 0), m.get(
            ("pdk_prefix_cache_hits_total", worker), 0
        )

    def after_prefill(queries: float) -> tuple[float, float]:
        """The prefill worker's counters once a Load reports the prefill just asked of it."""
        give_up = time.monotonic() + 60
        while (counts := prefill_counts())[0] <= queries:
            assert time.monotonic() < give_up, "no Load of the prefill worker came"
            time.sleep(0.1)
        return counts

    queries, hits = prefill_counts()
    assert ask("tenant-a") == 0
    queries, hits_a = after_prefill(queries)
    assert ask("tenant-b") == 0  # another tenant: nothing found on the decode worker
    _, hits_b = after_prefill(queries)
    assert hits_b == hits_a  # nor on the prefill worker (no faster first token to time)
    assert ask("tenant-a") > 0  # its own prefix is found
    err = _error(_post(server, json.dumps(dict(OK, cache_salt=""))))
    assert err["param"] == "cache_salt"
