"""The HTTP front (`python -m experiments.serve [group=option] [key=value]`): an OpenAI-compatible
endpoint over any deployment (colocated, xPyD, any TP), on FastAPI + uvicorn.

It composes the same hydra config as experiments.run (`model/`, `deployment/`, `transfer/`, `kernels`)
plus `server` (host, port, api_key, served_model_name), starts the deployment's workers through the
driver (experiments.deploy.driver.start_fleet) and serves:

- POST /v1/completions, POST /v1/chat/completions: streamed (server-sent events) or not; max_tokens
  (max_completion_tokens for chat), temperature, top_p, seed, stop and vLLM's top_k and ignore_eos.
  Tokens flow from the decode (or colocated) worker through the driver as they are sampled. A client
  that goes away mid-stream cancels its request, which frees its pages on both sides.
- GET /v1/models, GET /health (200 only while every worker is up), GET /metrics (Prometheus text).

Errors have OpenAI's shape ({"error": {"message", "type", "param", "code"}}), never plain text: 400 for
a bad request (naming the field), 401 for a missing or wrong API key, 403 for a foreign Host or Origin,
413/415 for a body too large or not JSON, 503 (with Retry-After) for a request no live worker can take
and while stopping. One request's failure is its own: the runtime's loop and the other requests go on.
A decode or colocated worker that dies hands its requests to another (DeploymentConfig.on_worker_death:
migrate): prompt + the tokens streamed so far, recomputed there. The server keeps serving with the
workers it has left (GET /health says 503 meanwhile, and for a worker silent past peer_timeout_s).
It binds 127.0.0.1 unless server.host says otherwise; every request's body, prompt, template time and
numbers are bounded (ServerConfig); parsing, tokenizing and templating run off the event loop. Ctrl-C
or SIGTERM drain it, then stop every worker and remove the run's directory before the process exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import queue
import secrets
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from omegaconf import DictConfig

from experiments.config import check_fits_model, from_cfg
from experiments.deploy.messages import Cancel, Failed, Load, Progress, Result, Submit

WAIT_MS = 20  # the runtime's longest sleep on its sockets: how often it looks for dead workers
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (printed)
    api_key: str | None = None  # when set, every request needs "Authorization: Bearer <key>"
    served_model_name: str | None = None  # default: the model's name
    public_health: bool = False  # GET /health without the API key (for load balancers)
    max_body_bytes: int = 4 << 20  # a larger request body is refused (413) before it is read whole
    max_prompt_chars: int | None = None  # characters of prompt or messages (None: 16 per context token)
    body_timeout_s: float = 30.0  # the whole body must arrive within this (408)
    template_timeout_s: float = 2.0  # a chat template rendering longer is stopped (400)
    timeout_keep_alive_s: float = 5.0  # an idle kept-alive connection is closed after this
    shutdown_timeout_s: float = 5.0  # SIGTERM/Ctrl-C: requests in flight may finish this long (new: 503)
    # Host headers served besides this machine's loopback names and the bound address ("*": any)
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any); none by default

    def __post_init__(self):
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"server.port={self.port!r} is not allowed: an integer in [0, 65536)")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("server.api_key must be a non-empty string or null")
        for key in ("max_body_bytes", "max_prompt_chars"):
            value = getattr(self, key)
            if (value is not None or key == "max_body_bytes") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"server.{key}={value!r} is not allowed: an integer >= 1")
        for key in ("body_timeout_s", "template_timeout_s", "timeout_keep_alive_s", "shutdown_timeout_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e6:
                raise ValueError(f"server.{key}={value!r} is not allowed: a number of seconds > 0")
        for key in ("allowed_hosts", "cors_origins"):
            value = getattr(self, key)
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"server.{key}={value!r} is not allowed: a list of non-empty strings")
            object.__setattr__(self, key, tuple(value))
        if not isinstance(self.public_health, bool):
            raise ValueError(f"server.public_health={self.public_health!r} is not allowed: true or false")


# ---- the driver side: one thread owns the workers' socket ---------------------------------------------


class Runtime:
    """A served deployment: its workers (a Fleet), the router, and the thread that talks to them.

    submit() and cancel() may be called from any thread; each request's sink(kind, message) is called
    on the runtime's thread with ("progress", (token ids, text)) for streamed requests and finally
    ("result", Result)."""

    def __init__(self, fleet, on_worker_death: str = "migrate", silent_after_s: float = 10.0):
        """on_worker_death: DeploymentConfig's (migrate | fail); silent_after_s: a worker not heard from
        for this long (frozen, or cut off) makes the deployment unhealthy (GET /health 503)."""
        import zmq

        self.fleet, self.on_worker_death, self.silent_after_s = fleet, on_worker_death, silent_after_s
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        # a byte down this pipe wakes the runtime's poll for a new command; otherwise it sleeps until a
        # worker's message or WAIT_MS (a thread waking every millisecond lands on a worker's core and
        # slows its steps)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._poller = zmq.Poller()
        self._poller.register(fleet.sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self.sinks: dict[str, object] = {}
        self.in_flight = {n: set() for n in fleet.frontends}
        self.owner: dict[str, str] = {}  # request -> the worker it went to
        self.load: dict[str, Load] = {}
        self.requests: dict[str, Submit] = {}  # request -> what it was submitted with
        self.streamed: dict[str, list] = {}  # streamed request -> [token ids, characters, token times] sent
        self.migrated: dict[str, tuple[int, list[float]]] = {}  # -> (migrations, token times before)
        # worker -> when it last sent anything (time.monotonic); from now on for each: one that never
        # speaks again is silent after silent_after_s
        self.heard: dict[str, float] = dict.fromkeys(fleet.procs, time.monotonic())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="runtime", daemon=True)
        self._thread.start()

    @property
    def dead(self) -> set[str]:
        """Workers down (a restarting one until it is back)."""
        return self.fleet.dead

    @property
    def silent(self) -> list[str]:
        """Workers up but not heard from for silent_after_s (a frozen process)."""
        now = time.monotonic()
        return [
            n for n, t in list(self.heard.items()) if n not in self.dead and now - t > self.silent_after_s
        ]

    @property
    def healthy(self) -> bool:
        """Every worker up and talking (GET /health)."""
        return not self.dead and not self.silent and self._thread.is_alive()

    @property
    def can_serve(self) -> bool:
        """Some decode or colocated worker is up: a degraded deployment serves with the workers it has."""
        return self._thread.is_alive() and any(n not in self.dead for n in self.in_flight)

    def submit(self, msg: Submit, sink) -> None:
        self.commands.put(("submit", msg, sink))
        os.write(self._wake_w, b"s")

    def cancel(self, request_id: str) -> None:
        self.commands.put(("cancel", request_id, None))
        os.write(self._wake_w, b"c")

    def cancel_all(self) -> None:
        """Cancel every request in flight (a stop whose drain time ran out)."""
        self.commands.put(("cancel_all", None, None))
        os.write(self._wake_w, b"c")

    @property
    def num_in_flight(self) -> int:
        return len(self.sinks)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread, then every worker (Stop; killed after timeout_s) and the run's directory."""
        self._stop.set()
        os.write(self._wake_w, b"q")
        self._thread.join(timeout=30)
        self.fleet.stop(timeout_s=timeout_s)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception:  # never leave requests hanging: fail them and keep going
                log.exception("runtime loop")
                for rid in list(self.sinks):
                    self._finish(Result(rid, "", [], 0.0, None, [], "error", "internal error in the server"))

    def _turn(self) -> None:
        while True:
            try:
                kind, arg, sink = self.commands.get_nowait()
            except queue.Empty:
                break
            try:
                if kind == "submit":
                    self._route(arg, sink)
                elif kind == "cancel_all":
                    for rid, owner in list(self.owner.items()):
                        self.fleet.send(owner, Cancel(rid))
                elif arg in self.owner:
                    self.fleet.send(self.owner[arg], Cancel(arg))
            except Exception as e:  # one request's failure is its own: the loop and the others go on
                log.exception("runtime: %s of a request failed", kind)
                if kind == "submit":
                    self._fail_one(arg.request_id, sink, f"the server could not route it: {e!r}")
        if self._wake_r in dict(self._poller.poll(WAIT_MS)):
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        now = time.monotonic()
        for name, msg in self.fleet.receive():
            self.heard[name] = now
            if isinstance(msg, Progress):
                for rid, ids, text in msg.items:
                    sink = self.sinks.get(rid)
                    if sink is not None and self.owner.get(rid) == name:
                        sent = self.streamed.setdefault(rid, [[], 0, []])
                        sent[0] += ids
                        sent[1] += len(text)
                        sent[2] += [time.perf_counter()] * len(ids)
                        sink("progress", (ids, text))
            elif isinstance(msg, Result):
                if self.owner.get(msg.request_id) == name:  # not a late one from before a migration
                    self._finish(msg)
            elif isinstance(msg, Load):
                self.load[name] = msg
            elif isinstance(msg, Failed):
                log.error("worker %s failed:\n%s", name, msg.error)
        for name, _ in self.fleet.deaths():  # a dead prefill worker's decode peers end its requests
            self.load.pop(name, None)
            self.heard.pop(name, None)
            for rid in list(self.in_flight.get(name, ())):
                if not (self.on_worker_death == "migrate" and self._migrate(rid, name)):
                    self._finish(Result(rid, name, [], 0.0, None, [], "error", f"worker {name} exited"))

    def _migrate(self, request_id: str, dead: str) -> bool:
        """Resubmit a dead worker's request to the least loaded live one: its prompt and the tokens it
        streamed so far (their KV is recomputed there), so the client's stream goes on. False when no
        worker can take it."""
        msg = self.requests.get(request_id)
        live = [n for n in self.in_flight if n not in self.dead]
        sent = self.streamed.get(request_id, [[], 0, []])
        if msg is None or not live or len(sent[0]) >= msg.max_tokens:
            return False
        resumed = msgspec.structs.replace(msg, output_ids=list(sent[0]), text_sent=sent[1])
        self.in_flight[dead].discard(request_id)
        target = min(live, key=lambda n: len(self.in_flight[n]))
        self.owner[request_id] = target
        self.in_flight[target].add(request_id)
        count = self.migrated.get(request_id, (0, []))[0] + 1
        self.migrated[request_id] = (count, list(sent[2]))
        log.warning(
            "request %s: worker %s died; it goes on on %s (%d tokens so far)",
            request_id,
            dead,
            target,
            len(sent[0]),
        )
        return self.fleet.send(target, resumed)

    def _route(self, msg: Submit, sink) -> None:
        live = [n for n in self.in_flight if n not in self.dead]
        if not live:
            sink("result", Result(msg.request_id, "", [], 0.0, None, [], "error", "no live worker"))
            return
        target = min(live, key=lambda n: len(self.in_flight[n]))
        self.sinks[msg.request_id] = sink
        self.requests[msg.request_id] = msg
        self.owner[msg.request_id] = target
        self.in_flight[target].add(msg.request_id)
        if not self.fleet.send(target, msg):
            self._finish(
                Result(msg.request_id, target, [], 0.0, None, [], "error", f"worker {target} is gone")
            )

    def _fail_one(self, request_id: str, sink, error: str) -> None:
        """End one request with an error; if a worker has it, cancel it there (its pages come back)."""
        owner = self.owner.get(request_id)
        if owner is not None:
            try:
                self.fleet.send(owner, Cancel(request_id))
            except Exception:
                log.exception("runtime: cancelling %s", request_id)
        self.sinks.setdefault(request_id, sink)
        self._finish(Result(request_id, owner or "", [], 0.0, None, [], "error", error))

    def _finish(self, result: Result) -> None:
        self.requests.pop(result.request_id, None)
        self.streamed.pop(result.request_id, None)
        migrated = self.migrated.pop(result.request_id, None)
        if migrated is not None:  # its tokens from before: the worker it went on on timed only its own
            result.migrations, before = migrated
            result.token_times = before + list(result.token_times)
        sink = self.sinks.pop(result.request_id, None)
        worker = self.owner.pop(result.request_id, None)
        if worker in self.in_flight:
            self.in_flight[worker].discard(result.request_id)
        if sink is not None:
            sink("result", result)


# ---- the HTTP side ------------------------------------------------------------------------------------


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or (
            "authentication_error"
            if status == 401
            else "invalid_request_error"
            if 400 <= status < 500
            else "service_unavailable"
            if status == 503
            else "server_error"
        )

    def body(self) -> dict:
        code = {401: "invalid_api_key", 503: "service_unavailable"}.get(self.status)
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


INLINE_BYTES = 16 * 1024  # bodies and completion prompts up to this size are parsed on the event loop
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request looks for its client's disconnect
RETRY_AFTER_S = 1  # what a 503 (overload, no live worker, stopping) tells the client to wait
MAX_TOP_K = (1 << 31) - 1


COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "ignore_eos",
    "stream",
    "stream_options",
    "n",
    "user",
}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
UNSUPPORTED_UNLESS = {
    "n": (None, 1),
    "logprobs": (None, False),
    "echo": (None, False),
    "top_logprobs": (None,),
}


def _number(body: dict, key: str, default, low=None, high=None, integer=False, low_open=False):
    value = body.get(key, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ApiError(400, f"{key} must be {'an integer' if integer else 'a number'}, got {value!r}", key)
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"{key} must be a finite number, got {value!r}", key)
    if low is not None and (value <= low if low_open else value < low):
        raise ApiError(400, f"{key} must be {'>' if low_open else '>='} {low}, got {value!r}", key)
    if high is not None and value > high:
        raise ApiError(400, f"{key} must be <= {high}, got {value!r}", key)
    return value


@dataclass
class Parsed:
    prompt_ids: list[int]
    submit: Submit
    stream: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))


class App:
    """The OpenAI API over a Runtime: request checking, tokenization, streaming, errors and metrics."""

    def __init__(
        self,
        runtime: Runtime,
        tokenizer,
        model_name: str,
        max_position: int,
        api_key: str | None,
        config: ServerConfig | None = None,
    ):
        self.runtime, self.tokenizer, self.model_name = runtime, tokenizer, model_name
        self.max_position, self.api_key = max_position, api_key
        self.config = config or ServerConfig(api_key=api_key)
        self.max_prompt_chars = self.config.max_prompt_chars or 16 * max_position
        self.metrics = Metrics(runtime)
        self.stopping = False  # set when the server drains before it stops: new requests get 503

    # -- checking requests

    def check_fields(self, body, allowed: set[str]) -> None:
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        for key, value in body.items():
            if key in UNSUPPORTED_UNLESS:
                if value not in UNSUPPORTED_UNLESS[key]:
                    raise ApiError(
                        400, f"{key}={value!r} is not supported (allowed: {UNSUPPORTED_UNLESS[key]})", key
                    )
            elif key not in allowed:
                raise ApiError(400, f"unsupported field {key!r}; supported: {sorted(allowed)}", key)
        model = body.get("model")
        if model != self.model_name:
            raise ApiError(
                400, f"model {model!r} is not served here; this server serves {self.model_name!r}", "model"
            )

    def parse(self, body: dict, chat: bool) -> Parsed:
        self.check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        if chat:
            prompt_ids = self._chat_prompt(body.get("messages"))
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
            key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        else:
            prompt_ids = self._completion_prompt(body.get("prompt"))
            max_tokens, key = body.get("max_tokens", 16), "max_tokens"
        room = self.max_position - len(prompt_ids)
        if room < 1:
            raise ApiError(
                400,
                f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.max_position}",
                "messages" if chat else "prompt",
            )
        max_tokens = room if max_tokens is None else _number({key: max_tokens}, key, None, 1, integer=True)
        if len(prompt_ids) + max_tokens > self.max_position:
            raise ApiError(
                400,
                f"{key}={max_tokens} with a {len(prompt_ids)}-token prompt exceeds this model's "
                f"context of {self.max_position} tokens",
                key,
            )
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise ApiError(400, "stop must be a non-empty string or a list of at most 4 of them", "stop")
        ignore_eos = body.get("ignore_eos", False)
        stream = body.get("stream", False)
        for key2, value in (("ignore_eos", ignore_eos), ("stream", stream)):
            if not isinstance(value, bool):
                raise ApiError(400, f"{key2} must be a boolean, got {value!r}", key2)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise ApiError(400, "stream_options may hold include_usage (a boolean)", "stream_options")
        seed = body.get("seed")
        if seed is not None:
            seed = _number(body, "seed", None, 0, (1 << 63) - 1, integer=True)
        submit = Submit(
            f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
            prompt_ids,
            max_tokens,
            temperature=float(_number(body, "temperature", 1.0, 0, 2)),
            top_p=float(_number(body, "top_p", 1.0, 0, 1, low_open=True)),
            top_k=max(0, _number(body, "top_k", 0, -1, MAX_TOP_K, integer=True)),  # -1 or 0: off (vLLM)
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
            stream=stream,
        )
        return Parsed(prompt_ids, submit, stream, bool(options.get("include_usage")))

    def _completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "prompt must not be empty", "prompt")
            self._check_chars(len(prompt), "prompt")
            return self.tokenizer.encode(prompt)
        vocab = self.tokenizer.vocab_size
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            if not all(0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
            return list(prompt)
        raise ApiError(
            400, "prompt must be a non-empty string or list of token ids (one prompt per request)", "prompt"
        )

    def _chat_prompt(self, messages) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages")
        for m in messages:
            if not (
                isinstance(m, dict)
                and m.get("role") in ("system", "user", "assistant")
                and isinstance(m.get("content"), str)
            ):
                raise ApiError(
                    400, "each message must be {role: system|user|assistant, content: string}", "messages"
                )
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": m["role"], "content": m["content"]} for m in messages],
                timeout_s=self.config.template_timeout_s,
            )
        except (
            Exception
        ) as e:  # the template is the model's (untrusted, sandboxed): its errors are the request's
            raise ApiError(400, f"the chat template refused these messages: {e}", "messages") from e
        ids = self.tokenizer.encode(text) if isinstance(text, str) else []
        if not ids:
            raise ApiError(400, "the model's chat template rendered these messages to nothing", "messages")
        return ids

    def _check_chars(self, n: int, param: str) -> None:
        if n > self.max_prompt_chars:
            raise ApiError(
                400,
                f"{param} has {n} characters; at most {self.max_prompt_chars} are taken "
                "(server.max_prompt_chars)",
                param,
            )

    # -- running requests

    def start(self, parsed: Parsed, loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
        if self.stopping:
            raise ApiError(503, "the server is stopping", kind="service_unavailable")
        if not self.runtime.can_serve:
            raise ApiError(
                503,
                f"no live worker can take requests (exited: {sorted(self.runtime.dead)})",
                kind="service_unavailable",
            )
        events: asyncio.Queue = asyncio.Queue()

        def sink(kind, payload):  # on the runtime's thread: metrics count every request, cancelled too
            if kind == "result":
                self.metrics.finished(parsed, payload)
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

        self.metrics.started(parsed)
        self.runtime.submit(parsed.submit, sink)
        return events

    def finished(self, parsed: Parsed, result: Result) -> None:
        """Raise the ApiError a failed or cancelled request answers with."""
        if result.finish_reason == "abort":  # cancelled: its client went away, or the server is stopping
            raise ApiError(503, "the request was cancelled before it finished (the server is stopping)")
        if result.finish_reason == "error":
            signs = ("exited", "no live worker", "no live prefill worker", "is gone", "silent for")
            gone = any(w in (result.error or "") for w in signs)
            status = 503 if gone else 500  # a worker died under it: the deployment, not the request
            raise ApiError(
                status,
                f"the request failed: {result.error}",
                kind="service_unavailable" if status == 503 else "server_error",
            )


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _parse_json(raw: bytes) -> dict:
    """A request body's JSON, or a 400 that says why not."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError as e:
        raise ApiError(400, "the request body is nested too deeply") from e
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, NaN, an integer past 4,300 digits
        raise ApiError(400, f"the request body is not JSON this server takes: {e}") from e
    try:  # a lone surrogate ("\\ud800") parses, but is no text: refuse it here, not in the tokenizer
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        raise ApiError(400, "the request body holds a lone surrogate (not valid Unicode text)") from e
    return body


def _usage(prompt: int, completion: int, migrations: int = 0) -> dict:
    """OpenAI's usage block; a request that went on on another worker after its own died says how often
    (a sampled one's tokens after it are drawn afresh, not where its seed's stream had got to)."""
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return {**usage, "migrations": migrations} if migrations else usage


def _finish_reason(result: Result) -> str:
    return "length" if result.finish_reason == "length" else "stop"


class Metrics:
    """Prometheus metrics of one server (its own registry)."""

    def __init__(self, runtime: Runtime):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.requests = Counter(
            "pdk_requests", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.ttft = Histogram("pdk_time_to_first_token_seconds", "TTFT", buckets=buckets, registry=r)
        self.tpot = Histogram("pdk_time_per_output_token_seconds", "TPOT", buckets=buckets, registry=r)
        self.e2e = Histogram(
            "pdk_e2e_request_latency_seconds", "End-to-end latency", buckets=buckets, registry=r
        )
        self.running = Gauge("pdk_requests_running", "Sequences running, per worker", ["worker"], registry=r)
        self.waiting = Gauge("pdk_requests_waiting", "Sequences queued, per worker", ["worker"], registry=r)
        self.in_flight = Gauge("pdk_requests_in_flight", "Requests the server is answering", registry=r)
        self.free_pages = Gauge("pdk_kv_free_pages", "Free KV pages per worker", ["worker"], registry=r)
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
            "refetched_tokens": Counter(
                "pdk_refetched_tokens",
                "Tokens whose dropped KV a decode worker fetched again from a prefill worker",
                ["worker"],
                registry=r,
            ),
        }
        self._preemption_seen: dict[tuple[str, str], int] = {}
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
        self.runtime = runtime
        self.sent: dict[str, float] = {}

    def started(self, parsed: Parsed) -> None:
        self.sent[parsed.submit.request_id] = time.perf_counter()
        self.in_flight.inc()

    def finished(self, parsed: Parsed, result: Result) -> None:
        """Latencies from the worker's token times (perf_counter: one clock for every process here)."""
        rid, now = parsed.submit.request_id, time.perf_counter()
        sent = self.sent.pop(rid, now)
        self.in_flight.dec()
        self.requests.labels(result.finish_reason or "unknown").inc()
        self.e2e.observe(now - sent)
        times = result.token_times
        if times:
            self.ttft.observe(times[0] - sent)
            if len(times) > 1:
                self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))
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
            for gauge in (self.free_pages, self.running, self.waiting):
                try:
                    gauge.remove(name)
                except KeyError:
                    pass
        for name, load in list(self.runtime.load.items()):
            self.free_pages.labels(name).set(load.free_pages)
            self.running.labels(name).set(load.running)
            self.waiting.labels(name).set(load.waiting)
            for key, counter in self.preemption_counters.items():
                now, seen = getattr(load, key), self._preemption_seen.get((name, key), 0)
                counter.labels(name).inc(now - seen if now >= seen else now)  # < seen: restarted
                self._preemption_seen[name, key] = now
        return generate_latest(self.registry)


def make_app(state: App) -> FastAPI:
    api = FastAPI(title="pdkernels", docs_url=None, redoc_url=None, openapi_url=None)
    cfg = state.config
    if cfg.cors_origins:  # browsers may call from these origins (preflight and headers)
        from starlette.middleware.cors import CORSMiddleware

        api.add_middleware(
            CORSMiddleware,
            allow_origins=list(cfg.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type"],
        )
    hosts = {"localhost", "127.0.0.1", "::1", cfg.host.lower(), *(h.lower() for h in cfg.allowed_hosts)}
    any_host = "*" in hosts or (cfg.host in ("0.0.0.0", "::") and not cfg.allowed_hosts)

    @api.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response()

    @api.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):  # never plain text, never a traceback
        log.exception("unhandled error answering %s", request.url.path)
        return ApiError(500, "internal error in the server").response()

    def guard(request: Request, key: bool = True) -> None:
        """Who may call: the Host a browser page on another site cannot forge into ours (DNS
        rebinding), no Origin but the allowed ones (cross-site requests), and the API key."""
        host = (request.headers.get("host") or "").lower()
        name = host[1 : host.index("]")] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
        if not any_host and name not in hosts:
            raise ApiError(403, f"Host {host!r} is not served here (server.allowed_hosts)", "host")
        origin = request.headers.get("origin")
        if origin is not None and origin not in cfg.cors_origins and "*" not in cfg.cors_origins:
            raise ApiError(
                403, f"requests from origin {origin!r} are refused (server.cors_origins)", "origin"
            )
        if key:
            authorize(request)

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)")

    async def body_of(request: Request) -> dict:
        """The JSON body: application/json, at most max_body_bytes (refused before it is read whole),
        within body_timeout_s, parsed off the event loop; NaN, infinities, nesting past the parser's
        depth, integers past 4,300 digits and lone surrogates are 400s."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise ApiError(415, f"Content-Type must be application/json, got {kind or 'none'!r}")
        limit = cfg.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise ApiError(413, f"the request body is over {limit} bytes (server.max_body_bytes)")
        chunks, size = [], 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"the request body is over {limit} bytes (server.max_body_bytes)")
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), cfg.body_timeout_s)
        except TimeoutError as e:
            raise ApiError(408, f"the request body did not arrive within {cfg.body_timeout_s} s") from e
        raw = b"".join(chunks)  # a small body parses in microseconds: on the loop, without a thread hop
        return _parse_json(raw) if len(raw) <= INLINE_BYTES else await asyncio.to_thread(_parse_json, raw)

    @api.get("/health")
    async def health(request: Request):
        guard(request, key=not cfg.public_health)
        if state.stopping:
            raise ApiError(503, "the server is stopping")
        if not state.runtime.healthy:
            return JSONResponse(
                {"status": "degraded", "dead": sorted(state.runtime.dead), "silent": state.runtime.silent},
                status_code=503,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return {"status": "ok"}

    @api.get("/metrics")
    async def metrics(request: Request):
        guard(request)
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @api.get("/v1/models")
    async def models(request: Request):
        guard(request)
        card = {
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdkernels",
            "max_model_len": state.max_position,
        }
        return {"object": "list", "data": [card]}

    async def generate(request: Request, chat: bool):
        guard(request)
        body = await body_of(request)
        prompt = body.get("prompt") if isinstance(body, dict) and not chat else None
        if isinstance(prompt, list | str) and len(prompt) <= INLINE_BYTES // 4:
            parsed = state.parse(body, chat)  # a short completion prompt: well under a millisecond
        else:  # chat templates (untrusted, time-limited) and long prompts: off the loop
            parsed = await asyncio.to_thread(state.parse, body, chat)
        loop = asyncio.get_running_loop()
        events = state.start(parsed, loop)
        if parsed.stream:
            return StreamingResponse(stream(request, parsed, events, chat), media_type="text/event-stream")
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():  # the client went away: so does its request
                        state.runtime.cancel(parsed.submit.request_id)
                        return ApiError(408, "the client went away").response()  # nobody reads it
                    continue
                if kind == "result":
                    break
        except asyncio.CancelledError:  # the client went away
            state.runtime.cancel(parsed.submit.request_id)
            raise
        state.finished(parsed, payload)
        return JSONResponse(complete(parsed, payload, chat))

    def complete(parsed: Parsed, result: Result, chat: bool) -> dict:
        head = {"id": parsed.submit.request_id, "created": parsed.created, "model": state.model_name}
        usage = _usage(len(parsed.prompt_ids), len(result.output_ids), result.migrations)
        reason = _finish_reason(result)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "logprobs": None,
                "finish_reason": reason,
            }
            return {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": reason}
        return {**head, "object": "text_completion", "choices": [choice], "usage": usage}

    async def stream(request: Request, parsed: Parsed, events: asyncio.Queue, chat: bool):
        head = {
            "id": parsed.submit.request_id,
            "created": parsed.created,
            "model": state.model_name,
            "object": "chat.completion.chunk" if chat else "text_completion",
        }

        def chunk(text: str | None, reason: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

        sent_chars, done = 0, False
        try:
            if chat:
                yield chunk(None, None, role=True)
            while True:
                kind, payload = await events.get()
                if kind == "progress":
                    ids, text = payload
                    sent_chars += len(text)
                    if text:
                        yield chunk(text, None)
                    continue
                result: Result = payload
                done = True
                try:
                    state.finished(parsed, result)
                except ApiError as e:
                    yield f"data: {json.dumps(e.body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                rest = result.text[sent_chars:]
                yield chunk(rest, _finish_reason(result))
                if parsed.include_usage:
                    usage = _usage(len(parsed.prompt_ids), len(result.output_ids), result.migrations)
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:
            if not done:  # the client went away (the response was cancelled): free its pages
                state.runtime.cancel(parsed.submit.request_id)

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return api


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound. Its proto is IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on
    connections whose socket says it is TCP, and without it a stream's first chunk waited behind the
    client's delayed ACK of the response headers (40 ms on a kept-alive connection, measured here)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class _Server:
    """Made a subclass of uvicorn.Server in serve() (uvicorn is imported there): a drain on SIGTERM or
    Ctrl-C. New requests get 503 while the ones in flight finish, for up to shutdown_timeout_s; those
    still running are then cancelled (their pages freed on the workers) and uvicorn shuts down. Unlike
    uvicorn's own handler, the signal is not raised again afterwards, so serve() stops every worker and
    removes the run's directory before the process exits. A second signal stops at once."""

    def __init__(self, config, state: App, timeout_s: float):
        super().__init__(config)
        self.state, self.timeout_s, self.drain_until = state, timeout_s, None

    def handle_exit(self, sig, frame) -> None:
        if self.drain_until is not None:  # a second signal: stop now
            self.state.runtime.cancel_all()
            self.should_exit = True
            self.force_exit = self.force_exit or sig == signal.SIGINT
            return
        log.warning(
            "stopping: new requests get 503; %d in flight get %s s",
            self.state.runtime.num_in_flight,
            self.timeout_s,
        )
        self.state.stopping = True
        self.drain_until = time.monotonic() + self.timeout_s

    async def on_tick(self, counter: int) -> bool:
        if self.drain_until is not None and not self.should_exit:
            if self.state.runtime.num_in_flight == 0 or time.monotonic() > self.drain_until:
                self.state.runtime.cancel_all()
                self.should_exit = True
        return await super().on_tick(counter)


def serve(cfg: DictConfig, out_dir: Path, ready=None) -> None:
    """Start the deployment and the HTTP server; returns once the server is stopped (Ctrl-C, SIGTERM)."""
    import uvicorn

    from experiments.deploy.driver import start_fleet

    config = from_cfg(cfg)
    from omegaconf import OmegaConf

    server = ServerConfig(**(OmegaConf.to_container(cfg.server) if cfg.get("server") else {}))
    if len(config.deployments) != 1:
        raise ValueError(
            f"serving takes one deployment; `deployments` lists {[d.name for d in config.deployments]}"
        )
    loaded = check_fits_model(config)
    # the context a request may fill: the model's, and the KV one worker holds (less a CUDA-graph page)
    pages = config.model.num_pages - 1
    tokenizer, max_position = (
        loaded.tokenizer,
        min(loaded.config.max_position, pages * config.model.page_size),
    )
    del loaded
    logging.getLogger().setLevel(config.log_level)
    name = server.served_model_name or config.model.name
    sock = listening_socket(server.host, server.port)
    fleet = start_fleet(config, config.deployments[0], out_dir / "logs")
    d = config.deployments[0]
    runtime = Runtime(fleet, d.on_worker_death, config.transfer.peer_timeout_s)
    try:
        state = App(runtime, tokenizer, name, max_position, server.api_key, server)
        app = make_app(state)
        host, port = sock.getsockname()[:2]
        url = f"http://{host}:{port}"
        print(f"serving {name} ({config.deployments[0].name}) on {url}", flush=True)
        (out_dir / "server.json").write_text(json.dumps({"url": url, "model": name}))
        if ready is not None:
            ready(url)
        uvicorn_config = uvicorn.Config(
            app,
            log_level="warning",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=server.timeout_keep_alive_s,
            h11_max_incomplete_event_size=64 * 1024,  # request line and headers (h11; httptools: 80 KiB)
        )
        server_class = type("Server", (_Server, uvicorn.Server), {})
        server_class(uvicorn_config, state, server.shutdown_timeout_s).run(sockets=[sock])
    finally:
        runtime.close(timeout_s=server.shutdown_timeout_s)
        sock.close()
