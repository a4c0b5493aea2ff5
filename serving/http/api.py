"""The OpenAI API over a Runtime (serving.http.server serves it): the server's config, request
checking and tokenizing, errors in OpenAI's shape (responses' usage and logprobs: shapes.py; its
Prometheus metrics: metrics.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import ipaddress
import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import msgspec

from engine.sequence import (
    MIN_TOP_P,
    SamplingParams,
)
from serving.http.errors import STATUS, ApiError
from serving.http.fields import (
    CHAT_FIELDS,
    COMPILED_CHARS,
    COMPLETION_FIELDS,
    UNSUPPORTED_UNLESS,
    cache_salt_of,
    extras,
    messages_of,
    number,
    sampling_fields,
    structured_of,
    temperature_of,
)
from serving.http.metrics import Metrics
from serving.http.server_config import ServerConfig
from serving.http.shapes import LogprobShapes
from serving.messages import ErrorKind, Result, Submit
from serving.runtime import Ended, Event, Runtime

log = logging.getLogger(__name__)


INLINE_BYTES = 16 * 1024  # bodies and completion prompts up to this size are parsed on the event loop
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request looks for its client's disconnect
MAX_TOP_K = (1 << 31) - 1
# include_usage: a last chunk with the usage; vLLM's continuous_usage_stats and OpenAI's
# include_obfuscation (random padding against length side channels) are taken and not acted on
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats", "include_obfuscation"}


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
        first = msgspec.structs.replace(self.submit, completions=self.n)
        out = [first]
        for i in range(1, self.n):
            seed = None if first.sampling.seed is None else (first.sampling.seed + i) % (1 << 63)
            sampling = dataclasses.replace(first.sampling, seed=seed)
            out.append(
                msgspec.structs.replace(
                    first,
                    request_id=f"{first.request_id}#{i}",
                    sampling=sampling,
                    after=first.request_id,
                    completions=1,
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
        request_log=None,
    ):
        """templates, grammars: the sandboxes (serving.http.sandbox.Sandbox) chat templates render
        and grammars compile in (grammars None: the model has no tokenizer, so no structured output);
        request_log: the file server.request_log writes to (Metrics)."""
        self.runtime, self.tokenizer, self.model_name = runtime, tokenizer, model_name
        self.max_position, self.api_key = max_position, api_key
        self.config = config or ServerConfig(api_key=api_key)
        self.max_prompt_chars = self.config.max_prompt_chars or 16 * max_position
        self.templates, self.grammars = templates, grammars
        self.compiled: OrderedDict[tuple[str, str], str] = OrderedDict()  # spec's key -> its grammar
        self.compiled_chars = self.compiles = 0
        self.metrics = Metrics(runtime, request_log)
        self.metrics.sandboxes(templates, grammars, lambda: self.compiles)
        self.logprobs = LogprobShapes(tokenizer)
        self.stopping = False  # set when the server drains before it stops: new requests get 503
        self._held: Counter[str] = Counter()  # completions in flight by client (max_sequences_per_client)
        self._held_lock = threading.Lock()  # results come on the runtime's thread
        # the Host names served (a browser page on another site cannot forge one: DNS rebinding)
        cfg = self.config
        self.hosts = {
            "localhost",
            "127.0.0.1",
            "::1",
            cfg.host.lower(),
            *(h.lower() for h in cfg.allowed_hosts),
        }
        self.any_host = "*" in self.hosts or (cfg.host in ("0.0.0.0", "::") and not cfg.allowed_hosts)
        self._proxies = [ipaddress.ip_network(p, strict=False) for p in cfg.trusted_proxies]
        self._secret = secrets.token_bytes(32)  # client digests (client_of)

    # -- who asks

    def client_of(self, peer: str, headers, body) -> tuple[str, ...]:
        """The client a request is for (engine/fair.py): its sender, the address a trusted proxy says
        is behind it (server.client_header's last entry) or else the peer's own address; then, when the
        request names one, its user (user, else safety_identifier, else the bearer key it sends). Each
        as a digest under this server's own secret: no address, name or key leaves the server."""
        sender = peer
        if self._trusted(peer):
            forwarded = (headers.get(self.config.client_header) or "").rsplit(",", 1)[-1].strip()
            sender = forwarded[:64] or peer
        user = None
        if isinstance(body, dict):
            user = next(
                (body[k] for k in ("user", "safety_identifier") if isinstance(body.get(k), str)), None
            )
        key = headers.get("authorization", "")
        if user is None and key.startswith("Bearer ") and self.api_key is None:  # a gateway's own users
            user = "key:" + key
        names = [sender] if user is None else [sender, user]
        return tuple(hashlib.blake2b(n.encode(), key=self._secret, digest_size=8).hexdigest() for n in names)

    def _trusted(self, peer: str) -> bool:
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False
        return any(address in net for net in self._proxies)

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
        if allowed is CHAT_FIELDS:
            extras(body)
        model = body.get("model")
        if model != self.model_name:
            raise ApiError(
                400, f"model {model!r} is not served here; this server serves {self.model_name!r}", "model"
            )

    async def prepare(self, body, chat: bool, client: str = "?") -> Prepared:
        """The parts of a request that run code of a model file or grow with a client's input without a
        bound, each in its sandbox: the chat template, and the structured-output spec's conversion and
        compile (once per spec: compiled grammars are kept by the spec's canonical form)."""
        if not isinstance(body, dict):
            return Prepared()  # parse() says what is wrong
        self.check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        text = await self._render(body.get("messages"), client) if chat else None
        found = structured_of(body)
        if found is None:
            return Prepared(text)
        spec, param = found
        return Prepared(text, spec, await self._compile(spec, param, client))

    async def _render(self, messages, client: str) -> str:
        from serving.http.sandbox import SandboxError, Task

        messages = messages_of(messages)
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        if not self.tokenizer.chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
        task = Task(self.config.template_timeout_s, messages)
        try:
            return await self.templates.run(task, client)
        except SandboxError as e:  # the template is the model's (untrusted): its failures are the request's
            raise ApiError(400, f"the chat template refused these messages: {e}", "messages") from e

    async def _compile(self, spec, param: str, client: str) -> str:
        from serving.http.sandbox import SandboxError, Task

        if self.grammars is None:
            raise ApiError(400, "structured output needs a tokenizer and this model has none", param)
        key = spec.key
        if key in self.compiled:  # compiled for an earlier request (whitespace and all aside)
            self.compiled.move_to_end(key)
            return self.compiled[key]
        self.compiles += 1
        try:
            task = Task(self.config.grammar_timeout_s, spec=spec.wire())
            grammar = await self.grammars.run(task, client)
        except SandboxError as e:
            limits = "server.grammar_timeout_s, server.grammar_max_bytes"
            raise ApiError(400, f"{param}: {e} ({limits})", param) from e
        self.compiled[key] = grammar
        self.compiled_chars += len(grammar)
        while self.compiled_chars > COMPILED_CHARS and len(self.compiled) > 1:
            self.compiled_chars -= len(self.compiled.popitem(last=False)[1])
        return grammar

    def parse(
        self, body: dict, chat: bool, prepared: Prepared, client: tuple[str, ...] | None = None
    ) -> Parsed:
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
        max_tokens = room if max_tokens is None else number({key: max_tokens}, key, None, 1, integer=True)
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
        if (
            not isinstance(options, dict)
            or not set(options) <= STREAM_OPTIONS
            or not all(isinstance(v, bool | None) for v in options.values())
        ):
            raise ApiError(
                400, f"stream_options may hold {sorted(STREAM_OPTIONS)}, each a boolean", "stream_options"
            )
        seed = body.get("seed")
        if seed is not None:
            seed = number(body, "seed", None, 0, (1 << 63) - 1, integer=True)
        fields = sampling_fields(body, chat, max_tokens, self.tokenizer.vocab_size, prepared.spec)
        try:  # every field was checked above with the API's own message; SamplingParams checks them again
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature_of(body),
                top_p=float(number(body, "top_p", 1.0, MIN_TOP_P, 1)),
                top_k=max(0, number(body, "top_k", 0, -1, MAX_TOP_K, integer=True)),  # -1 or 0: off (vLLM)
                seed=seed,
                stop=tuple(stop),
                ignore_eos=ignore_eos,
                cache_salt=cache_salt_of(body, self.config.cache_isolation),
                client=client or None,
                **fields,
            )
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e), str(e).split(" ", 1)[0].split("[", 1)[0]) from e
        submit = Submit(
            f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
            prompt_ids,
            sampling,
            stream=stream,
            grammar=prepared.grammar,
        )
        n = number(body, "n", 1, 1, self.config.max_n, integer=True)  # server.max_n
        return Parsed(prompt_ids, submit, stream, bool(options.get("include_usage")), n)

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

    def start(
        self, parsed: Parsed, loop: asyncio.AbstractEventLoop, client: str = "?", arrived: float | None = None
    ) -> asyncio.Queue:
        """Submit parsed's completions. With server.max_sequences_per_client set, client (client_of's,
        joined) holds them against that limit until each one's result comes (every completion gets one,
        a cancelled one too); past it, 429."""
        if self.stopping:
            raise ApiError(503, "the server is stopping", kind="service_unavailable")
        if not self.runtime.can_serve:
            raise ApiError(
                503,
                f"no live worker can take requests (exited: {sorted(self.runtime.dead)})",
                kind="service_unavailable",
            )
        limit = self.config.max_sequences_per_client or float("inf")
        with self._held_lock:
            held = self._held[client]
            if held + parsed.n > limit:
                raise ApiError(
                    429,
                    f"this client has {held} completions in flight and asks for {parsed.n} more: at most "
                    f"{limit} at once (server.max_sequences_per_client); retry when some end",
                    "n" if parsed.n > 1 else None,
                    kind="rate_limit_exceeded",
                )
            self._held[client] = held + parsed.n
        events: asyncio.Queue = asyncio.Queue()  # (completion's index, runtime Event)

        def sink_of(index: int, request_id: str):
            def sink(event: Event):  # on the runtime's thread: metrics count every one, cancelled too
                if isinstance(event, Ended):
                    self.metrics.finished(request_id, event.result)
                    self._release(client)
                loop.call_soon_threadsafe(events.put_nowait, (index, event))

            return sink

        for i, submit in enumerate(parsed.completions):
            self.metrics.started(submit.request_id, arrived)
            self.runtime.submit(submit, sink_of(i, submit.request_id))
        return events

    def _release(self, client: str) -> None:
        with self._held_lock:
            self._held[client] -= 1
            if self._held[client] <= 0:
                del self._held[client]

    def cancel(self, parsed: Parsed) -> None:
        """The client went away, or one completion failed: end every completion (their pages free)."""
        for submit in parsed.completions:
            self.runtime.cancel(submit.request_id)

    def finished(self, parsed: Parsed, result: Result) -> None:
        """Raise the ApiError a failed, refused or cancelled request answers with (STATUS)."""
        if result.finish_reason not in ("error", "rejected", "abort"):
            return
        kind = result.error_kind or {"rejected": ErrorKind.REJECTED, "abort": ErrorKind.CANCELLED}.get(
            result.finish_reason, ErrorKind.INTERNAL
        )
        status, error_type, what = STATUS[kind]
        message = f"{what}: {result.error}" if result.error else what
        raise ApiError(status, message, kind=error_type, code=str(kind))
