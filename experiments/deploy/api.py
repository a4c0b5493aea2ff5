"""The OpenAI API over a Runtime (experiments.deploy.server serves it): the server's config, request
checking and tokenizing, errors in OpenAI's shape (responses' usage and logprobs: shapes.py; its
Prometheus metrics: metrics.py)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
from fastapi.responses import JSONResponse

from engine.sequence import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, MIN_TEMPERATURE, MIN_TOP_P
from experiments.deploy.messages import Result, Submit
from experiments.deploy.metrics import Metrics
from experiments.deploy.runtime import Runtime
from experiments.deploy.shapes import LogprobShapes

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
    template_timeout_s: float = 2.0  # a chat template rendering longer is killed (400)
    template_max_bytes: int = 256 << 20  # memory a chat template's rendering may take (400 past it)
    grammar_timeout_s: float = 5.0  # a structured-output spec compiling longer is killed (400)
    grammar_max_bytes: int = 1 << 30  # memory its conversion and compile may take (400 past it)
    sandbox_processes: int = 2  # processes rendering templates, and as many compiling grammars
    timeout_keep_alive_s: float = 5.0  # an idle kept-alive connection is closed after this
    header_timeout_s: float = 10.0  # a request line and headers must arrive within this, else it closes
    max_connections: int = 512  # open at once; past it, a new connection gets 503 and is closed
    shutdown_timeout_s: float = 5.0  # SIGTERM/Ctrl-C: requests in flight may finish this long (new: 503)
    # Host headers served besides this machine's loopback names and the bound address ("*": any)
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any); none by default
    max_n: int = 16  # the most completions one request may ask for (n)
    # whose requests share prefix-cache pages: none (all with the same cache_salt, none given: all), user
    # (the request's `user` is part of its salt), salt (only requests that give the same cache_salt)
    cache_isolation: str = "none"

    def __post_init__(self):
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"server.port={self.port!r} is not allowed: an integer in [0, 65536)")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("server.api_key must be a non-empty string or null")
        for key in ("max_body_bytes", "max_prompt_chars", "max_n", "template_max_bytes", "grammar_max_bytes",
                    "sandbox_processes", "max_connections"):  # fmt: skip
            value = getattr(self, key)
            if (value is not None or key != "max_prompt_chars") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"server.{key}={value!r} is not allowed: an integer >= 1")
        for key in ("body_timeout_s", "template_timeout_s", "grammar_timeout_s", "timeout_keep_alive_s",
                    "header_timeout_s", "shutdown_timeout_s"):  # fmt: skip
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e6:
                raise ValueError(f"server.{key}={value!r} is not allowed: a number of seconds > 0")
        for key in ("allowed_hosts", "cors_origins"):
            value = getattr(self, key)
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"server.{key}={value!r} is not allowed: a list of non-empty strings")
            object.__setattr__(self, key, tuple(value))
        if self.cache_isolation not in CACHE_ISOLATION:
            raise ValueError(
                f"server.cache_isolation={self.cache_isolation!r} is not allowed: one of {CACHE_ISOLATION}"
            )
        if not isinstance(self.public_health, bool):
            raise ValueError(f"server.public_health={self.public_health!r} is not allowed: true or false")


CACHE_ISOLATION = ("none", "user", "salt")


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
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logit_bias",
    "stop_token_ids",
    "include_stop_str_in_output",
    "structured_outputs",
    "cache_salt",
}
COMPLETION_FIELDS = COMMON | {"prompt", "echo"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format"}
UNSUPPORTED_UNLESS = {
    "echo": (None, False),
}
MAX_TOP_LOGPROBS = {True: 20, False: 5}  # chat's top_logprobs, completions' logprobs (OpenAI's bounds)
MAX_TOKEN_LIST = 1024  # entries of logit_bias or stop_token_ids
MAX_SALT_CHARS = 256  # of cache_salt and user
COMPILED_CHARS = 256 << 20  # compiled grammars the server keeps, by their serialized length


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


def _temperature(body: dict) -> float:
    """0 (greedy) or [MIN_TEMPERATURE, 2] (OpenAI's top): below the floor the sampler's logits overflow."""
    value = float(_number(body, "temperature", 1.0, 0, 2))
    if 0 < value < MIN_TEMPERATURE:
        raise ApiError(
            400, f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, 2], got {value!r}", "temperature"
        )
    return value


@dataclass
class Prepared:
    """What the sandboxes made of a request (App.prepare): its chat rendered by the model's template, and
    its structured-output spec with the grammar compiled for it (xgrammar's serialized form)."""

    text: str | None = None
    spec: object = None  # engine.StructuredOutputs
    grammar: str | None = None


@dataclass
class Parsed:
    prompt_ids: list[int]
    submit: Submit
    stream: bool
    include_usage: bool
    n: int = 1  # completions
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def completions(self) -> list[Submit]:
        """One Submit per completion: the first is the request's own; completion i is '<id>#i', seeded
        seed + i, and names the first (Submit.after): it goes to the same worker and shares its prompt."""
        first = self.submit
        out = [first]
        for i in range(1, self.n):
            seed = None if first.seed is None else (first.seed + i) % (1 << 63)
            out.append(
                msgspec.structs.replace(
                    first, request_id=f"{first.request_id}#{i}", seed=seed, after=first.request_id
                )
            )
        return out


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
        templates=None,
        grammars=None,
    ):
        """templates, grammars: the sandboxes (experiments.deploy.sandbox.Sandbox) chat templates render
        and grammars compile in (grammars None: the model has no tokenizer, so no structured output)."""
        self.runtime, self.tokenizer, self.model_name = runtime, tokenizer, model_name
        self.max_position, self.api_key = max_position, api_key
        self.config = config or ServerConfig(api_key=api_key)
        self.max_prompt_chars = self.config.max_prompt_chars or 16 * max_position
        self.templates, self.grammars = templates, grammars
        self.compiled: OrderedDict[tuple[str, str], str] = OrderedDict()  # spec's key -> its grammar
        self.compiled_chars = self.compiles = 0
        self.metrics = Metrics(runtime)
        self.metrics.sandboxes(templates, grammars, lambda: self.compiles)
        self.logprobs = LogprobShapes(tokenizer)
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

    async def prepare(self, body, chat: bool) -> Prepared:
        """The parts of a request that run code of a model file or grow with a client's input without a
        bound, each in its sandbox: the chat template, and the structured-output spec's conversion and
        compile (once per spec: compiled grammars are kept by the spec's canonical form)."""
        if not isinstance(body, dict):
            return Prepared()  # parse() says what is wrong
        self.check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        text = await self._render(body.get("messages")) if chat else None
        found = _structured(body)
        if found is None:
            return Prepared(text)
        spec, param = found
        return Prepared(text, spec, await self._compile(spec, param))

    async def _render(self, messages) -> str:
        from experiments.deploy.sandbox import SandboxError, Task

        _check_messages(messages)
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        if not self.tokenizer.chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
        task = Task(
            self.config.template_timeout_s, [{"role": m["role"], "content": m["content"]} for m in messages]
        )
        try:
            return await self.templates.run(task)
        except SandboxError as e:  # the template is the model's (untrusted): its failures are the request's
            raise ApiError(400, f"the chat template refused these messages: {e}", "messages") from e

    async def _compile(self, spec, param: str) -> str:
        from experiments.deploy.sandbox import SandboxError, Task

        if self.grammars is None:
            raise ApiError(400, "structured output needs a tokenizer and this model has none", param)
        key = spec.key
        if key in self.compiled:  # compiled for an earlier request (whitespace and all aside)
            self.compiled.move_to_end(key)
            return self.compiled[key]
        self.compiles += 1
        try:
            grammar = await self.grammars.run(Task(self.config.grammar_timeout_s, spec=spec.wire()))
        except SandboxError as e:
            limits = "server.grammar_timeout_s, server.grammar_max_bytes"
            raise ApiError(400, f"{param}: {e} ({limits})", param) from e
        self.compiled[key] = grammar
        self.compiled_chars += len(grammar)
        while self.compiled_chars > COMPILED_CHARS and len(self.compiled) > 1:
            self.compiled_chars -= len(self.compiled.popitem(last=False)[1])
        return grammar

    def parse(self, body: dict, chat: bool, prepared: Prepared) -> Parsed:
        self.check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        if chat:
            prompt_ids = self._chat_prompt(prepared.text)
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
            temperature=_temperature(body),
            top_p=float(_number(body, "top_p", 1.0, MIN_TOP_P, 1)),
            top_k=max(0, _number(body, "top_k", 0, -1, MAX_TOP_K, integer=True)),  # -1 or 0: off (vLLM)
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
            stream=stream,
            cache_salt=cache_salt_of(body, self.config.cache_isolation),
            **self._sampling(body, chat, max_tokens, prepared),
        )
        n = _number(body, "n", 1, 1, self.config.max_n, integer=True)  # server.max_n
        return Parsed(prompt_ids, submit, stream, bool(options.get("include_usage")), n)

    def _sampling(self, body: dict, chat: bool, max_tokens: int, prepared: Prepared) -> dict:
        """vLLM's further sampling fields and logprobs, checked, as Submit's keyword arguments."""
        vocab = self.tokenizer.vocab_size
        out = {
            "presence_penalty": float(_number(body, "presence_penalty", 0.0, -2, 2)),
            "frequency_penalty": float(_number(body, "frequency_penalty", 0.0, -2, 2)),
            "repetition_penalty": float(
                _number(body, "repetition_penalty", 1.0, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
            ),
            "min_p": float(_number(body, "min_p", 0.0, 0, 1)),
            "min_tokens": _number(body, "min_tokens", 0, 0, max_tokens, integer=True),
        }
        bias = body.get("logit_bias") or {}
        if not isinstance(bias, dict) or len(bias) > MAX_TOKEN_LIST:
            raise ApiError(
                400,
                f"logit_bias must map at most {MAX_TOKEN_LIST} token ids to biases in [-100, 100]",
                "logit_bias",
            )
        out["logit_bias"] = {}
        for key, value in bias.items():
            ascii_digits = isinstance(key, str) and key.isascii() and key.isdigit()  # "²", "٥": no
            token = int(key) if ascii_digits and len(key) < 10 else -1
            if not 0 <= token < vocab:
                raise ApiError(
                    400, f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}", "logit_bias"
                )
            out["logit_bias"][token] = float(_number({"logit_bias": value}, "logit_bias", 0.0, -100, 100))
        ids = body.get("stop_token_ids") or []
        if (
            not isinstance(ids, list)
            or len(ids) > MAX_TOKEN_LIST
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids)
        ):
            raise ApiError(
                400,
                f"stop_token_ids must be a list of at most {MAX_TOKEN_LIST} token ids in [0, {vocab})",
                "stop_token_ids",
            )
        out["stop_token_ids"] = list(ids)
        keep = body.get("include_stop_str_in_output", False)
        if not isinstance(keep, bool):
            raise ApiError(
                400,
                f"include_stop_str_in_output must be a boolean, got {keep!r}",
                "include_stop_str_in_output",
            )
        out["include_stop_str_in_output"] = keep
        # chat: logprobs (a boolean) and top_logprobs (0-20); completions: logprobs (0-5)
        most = MAX_TOP_LOGPROBS[chat]
        if chat:
            wanted = body.get("logprobs", False)
            if wanted is not None and not isinstance(wanted, bool):
                raise ApiError(400, f"logprobs must be a boolean, got {wanted!r}", "logprobs")
            top = _number(body, "top_logprobs", None, 0, most, integer=True)
            if top is not None and not wanted:
                raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            out["logprobs"] = (top or 0) if wanted else None
        else:
            out["logprobs"] = _number(body, "logprobs", None, 0, most, integer=True)
        spec = prepared.spec
        out["structured_outputs"] = spec.wire() if spec is not None else None
        out["grammar"] = prepared.grammar
        return out

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

    def _chat_prompt(self, text: str | None) -> list[int]:
        """The rendered chat's tokens (its length was checked in the sandbox: at most max_prompt_chars)."""
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
        events: asyncio.Queue = asyncio.Queue()  # (completion's index, kind, payload)

        def sink_of(index: int, request_id: str):
            def sink(kind, payload):  # on the runtime's thread: metrics count every one, cancelled too
                if kind == "result":
                    self.metrics.finished(request_id, payload)
                loop.call_soon_threadsafe(events.put_nowait, (index, kind, payload))

            return sink

        for i, submit in enumerate(parsed.completions):
            self.metrics.started(submit.request_id)
            self.runtime.submit(submit, sink_of(i, submit.request_id))
        return events

    def cancel(self, parsed: Parsed) -> None:
        """The client went away, or one completion failed: end every completion (their pages free)."""
        for submit in parsed.completions:
            self.runtime.cancel(submit.request_id)

    def finished(self, parsed: Parsed, result: Result) -> None:
        """Raise the ApiError a failed or cancelled request answers with."""
        if result.finish_reason == "rejected":  # deployment.admission=slo: it would miss the SLO anyway
            raise ApiError(503, f"the request was refused: {result.error}", kind="service_unavailable")
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


def cache_salt_of(body: dict, isolation: str) -> str | None:
    """The salt a request's prefix-cache pages are named with (server.cache_isolation): requests of
    different salts share no page, so none can find or time a prefix another one computed, and
    usage.prompt_tokens_details.cached_tokens counts only its own salt's pages."""
    salt, user = body.get("cache_salt"), body.get("user")
    for key, value in (("cache_salt", salt), ("user", user)):
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= MAX_SALT_CHARS):
            raise ApiError(400, f"{key} must be a string of 1-{MAX_SALT_CHARS} characters", key)
    if isolation == "user" and user is not None:
        return hashlib.sha256(json.dumps([user, salt]).encode()).hexdigest()  # unambiguous, 64 chars
    if isolation == "salt" and salt is None:
        return secrets.token_hex(16)  # no salt given: it shares nothing
    return salt


def _check_messages(messages) -> None:
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


def _structured(body: dict):
    """(engine.StructuredOutputs, the field it came from) from chat's response_format or vLLM's
    structured_outputs (either, not both), or None; its grammar is built in the sandbox (App._compile)."""
    from engine.structured import KINDS, StructuredOutputs

    fmt, extra = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and extra is not None:
        raise ApiError(400, "give response_format or structured_outputs, not both", "structured_outputs")
    if fmt is not None:
        param, kind = "response_format", fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            kwargs = {"json_object": True}
        elif kind == "json_schema" and isinstance(fmt.get("json_schema"), dict):
            kwargs = {"json": fmt["json_schema"].get("schema", {})}
        else:
            raise ApiError(
                400,
                "response_format must be {type: text | json_object} or {type: json_schema, json_schema: "
                "{name, schema}}",
                param,
            )
    elif extra is not None:
        param = "structured_outputs"
        if not isinstance(extra, dict) or len(extra) != 1 or next(iter(extra)) not in KINDS:
            raise ApiError(400, f"structured_outputs must be an object with exactly one of {KINDS}", param)
        kwargs = dict(extra)
    else:
        return None
    try:
        spec = StructuredOutputs(**kwargs)
    except (TypeError, ValueError) as e:
        raise ApiError(400, str(e), param) from e
    return spec, param


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> dict:
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
