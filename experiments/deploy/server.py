"""The HTTP front (`python -m experiments.serve [group=option] [key=value]`): an OpenAI-compatible
endpoint over any deployment (colocated, xPyD, any TP), on FastAPI + uvicorn.

It composes the same hydra config as experiments.run (`model/`, `deployment/`, `transfer/`, `kernels`)
plus `server` (host, port, api_key, served_model_name), starts the deployment's workers through the
driver (experiments.deploy.fleet.start_fleet) and serves:

- POST /v1/completions, POST /v1/chat/completions: streamed (server-sent events) or not; max_tokens
  (max_completion_tokens for chat), temperature, top_p, seed, stop and vLLM's top_k and ignore_eos.
  Tokens flow from the decode (or colocated) worker through the driver as they are sampled. A client
  that goes away mid-stream cancels its request, which frees its pages on both sides.
- GET /v1/models, GET /health (200 only while every worker is up and admission takes requests),
  GET /metrics (Prometheus text).

Errors have OpenAI's shape ({"error": {"message", "type", "param", "code"}}), never plain text: 400 for
a bad request (naming the field), 401 for a missing or wrong API key, 403 for a foreign Host or Origin,
413/415 for a body too large or not JSON, 503 (with Retry-After) for a request no live worker can take
and while stopping. One request's failure is its own: the runtime's loop and the other requests go on.
A decode or colocated worker that dies, or is silent past peer_timeout_s, hands its requests to another
(DeploymentConfig.on_worker_death: migrate): prompt + the tokens streamed so far, recomputed there; a
request whose prefill worker died mid-transfer is prefilled again by a live one. The server keeps serving
with the workers it has left (GET /health says 503 meanwhile).
It binds 127.0.0.1 unless server.host says otherwise; every request's body, prompt, headers' arrival,
template and grammar time and memory, and numbers are bounded (ServerConfig); chat templates and grammar
compiles run in killable child processes (experiments.deploy.sandbox), parsing and tokenizing off the
event loop. Ctrl-C or SIGTERM drain it, then stop every worker, the sandboxes and the fork server, and
remove the run's directory before the process exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import signal
import socket
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from omegaconf import DictConfig

from experiments.deploy.api import (
    DISCONNECT_POLL_S,
    INLINE_BYTES,
    RETRY_AFTER_S,
    ApiError,
    App,
    Parsed,
    ServerConfig,
    parse_json,
)
from experiments.deploy.config import check_fits_model, runtime_of
from experiments.deploy.connections import guarded_h11
from experiments.deploy.launcher import start_fork_server, stop_fork_server
from experiments.deploy.messages import Result
from experiments.deploy.policy import Router
from experiments.deploy.runtime import Runtime
from experiments.deploy.shapes import finish_reason_of, usage_block

log = logging.getLogger(__name__)
__all__ = ["ServerConfig", "listening_socket", "make_app", "serve"]


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
        return parse_json(raw) if len(raw) <= INLINE_BYTES else await asyncio.to_thread(parse_json, raw)

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
        refusing = state.runtime.router.refusing
        if refusing is not None:  # admission=slo refuses every new request now (it probes meanwhile)
            return JSONResponse(
                {"status": "refusing", "refusing_s": round(refusing, 3)},
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
        sandboxed = chat or (
            isinstance(body, dict) and ("structured_outputs" in body or "response_format" in body)
        )
        work = state.prepare(
            body, chat
        )  # templates and grammars: in the sandboxes, cancelled with the client
        prepared = await (unless_gone(request, work) if sandboxed else work)
        prompt = body.get("prompt") if isinstance(body, dict) and not chat else None
        if isinstance(prompt, list | str) and len(prompt) <= INLINE_BYTES // 4:
            parsed = state.parse(body, chat, prepared)  # a short completion prompt: well under a millisecond
        else:  # rendered chats and long prompts tokenize off the loop
            parsed = await asyncio.to_thread(state.parse, body, chat, prepared)
        loop = asyncio.get_running_loop()
        events = state.start(parsed, loop)
        if parsed.stream:  # a request refused at once (admission, no worker) is an HTTP error, not a stream
            try:
                first = await events.get()  # a completion "routed", or its result at once
            except asyncio.CancelledError:  # the client went away
                state.cancel(parsed)
                raise
            if first[1] == "result":
                fail(parsed, first[2])
            events.put_nowait(first)
            return StreamingResponse(stream(request, parsed, events, chat), media_type="text/event-stream")
        results: dict[int, Result] = {}
        try:
            while len(results) < parsed.n:
                try:
                    index, kind, payload = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():  # the client went away: so does its request
                        state.cancel(parsed)
                        return ApiError(408, "the client went away").response()  # nobody reads it
                    continue
                if kind == "result":
                    fail(parsed, payload)
                    results[index] = payload
        except asyncio.CancelledError:  # the client went away
            state.cancel(parsed)
            raise
        return JSONResponse(complete(parsed, [results[i] for i in range(parsed.n)], chat))

    async def unless_gone(request: Request, work):
        """Await work (a coroutine), cancelled if the client goes away meanwhile (a sandboxed task's
        process is then killed): 408, which nobody reads."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    raise ApiError(408, "the client went away")
        except asyncio.CancelledError:
            task.cancel()
            raise

    def fail(parsed: Parsed, result: Result) -> None:
        """A failed completion fails its request (the ApiError it answers with): the others end too."""
        try:
            state.finished(parsed, result)
        except ApiError:
            if parsed.n > 1:
                state.cancel(parsed)
            raise

    def usage_of(parsed: Parsed, results: list[Result]) -> dict:
        """The prompt counted once, every completion's tokens; cached: what the first one found cached
        (the others share its pages)."""
        return usage_block(
            len(parsed.prompt_ids),
            sum(len(r.output_ids) for r in results),
            sum(r.migrations for r in results),
            results[0].cached_tokens,
        )

    def complete(parsed: Parsed, results: list[Result], chat: bool) -> dict:
        head = {"id": parsed.submit.request_id, "created": parsed.created, "model": state.model_name}
        k, choices = parsed.submit.logprobs, []
        for index, result in enumerate(results):
            reason, logprobs = finish_reason_of(result), None
            if k is not None and result.logprobs is not None:
                shapes = state.logprobs
                logprobs = (
                    shapes.chat(result.logprobs, k) if chat else shapes.completion(result.logprobs, 0)[0]
                )
            if chat:
                message = {"role": "assistant", "content": result.text}
                choices.append(
                    {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}
                )
            else:
                choices.append(
                    {"index": index, "text": result.text, "logprobs": logprobs, "finish_reason": reason}
                )
        usage = usage_of(parsed, results)
        kind = "chat.completion" if chat else "text_completion"
        return {**head, "object": kind, "choices": choices, "usage": usage}

    async def stream(request: Request, parsed: Parsed, events: asyncio.Queue, chat: bool):
        head = {
            "id": parsed.submit.request_id,
            "created": parsed.created,
            "model": state.model_name,
            "object": "chat.completion.chunk" if chat else "text_completion",
        }
        k = parsed.submit.logprobs
        offsets = [0] * parsed.n  # completions: each choice's text offset so far

        def chunk(index: int, text: str | None, reason: str | None, role: bool = False, logprobs=None) -> str:
            block = None
            if k is not None and logprobs is not None:
                if chat:
                    block = state.logprobs.chat(logprobs, k)
                else:
                    block, offsets[index] = state.logprobs.completion(logprobs, offsets[index])
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": index, "delta": delta, "logprobs": block, "finish_reason": reason}
            else:
                choice = {"index": index, "text": text or "", "logprobs": block, "finish_reason": reason}
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

        sent_chars, sent_logprobs = [0] * parsed.n, [0] * parsed.n
        results: dict[int, Result] = {}
        try:
            if chat:
                for index in range(parsed.n):
                    yield chunk(index, None, None, role=True)
            while len(results) < parsed.n:
                index, kind, payload = await events.get()
                if kind == "routed":
                    continue
                if kind == "progress":
                    ids, text, logprobs = payload
                    sent_chars[index] += len(text)
                    sent_logprobs[index] += len(logprobs)
                    if text or logprobs:  # a token whose text a stop string may still claim: its logprobs
                        yield chunk(index, text, None, logprobs=logprobs or None)
                    continue
                result: Result = payload
                results[index] = result
                try:
                    fail(parsed, result)
                except ApiError as e:
                    yield f"data: {json.dumps(e.body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                rest = result.text[sent_chars[index] :]
                logprobs = result.logprobs[sent_logprobs[index] :] if result.logprobs is not None else None
                yield chunk(index, rest, finish_reason_of(result), logprobs=logprobs)
            if parsed.include_usage:
                usage = usage_of(parsed, [results[i] for i in range(parsed.n)])
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if len(results) < parsed.n:  # the client went away (the response was cancelled): free pages
                state.cancel(parsed)

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return api


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening (so a client that reads server.json before uvicorn has
    started waits in the backlog instead of being refused). Its proto is IPPROTO_TCP, not 0: asyncio
    sets TCP_NODELAY only on connections whose socket says it is TCP, and without it a stream's first
    chunk waited behind the client's delayed ACK of the response headers (40 ms on a kept-alive
    connection, measured here)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # uvicorn's default backlog
    return sock


def sandboxes(server: ServerConfig, loaded, max_chars: int):
    """The processes chat templates render in and grammars compile in (none for grammars where the
    model has no tokenizer), started now: their children fork from the fork server meanwhile."""
    from engine.structured import tokenizer_info
    from experiments.deploy.sandbox import MAX_COMPILED_CHARS, Sandbox, Setup

    tok, model = loaded.tokenizer, loaded.config
    n = server.sandbox_processes
    setup = Setup("template", server.template_max_bytes, max_chars, tok.chat_template, tok.bos_token)
    templates = Sandbox(setup, n)
    if tok.tokenizer is None:  # NoTokenizer: token ids only
        return templates, None
    info = tokenizer_info(tok, model.vocab_size, model.eos_token_ids).serialize_json()
    return templates, Sandbox(
        Setup("grammar", server.grammar_max_bytes, MAX_COMPILED_CHARS, tokenizer_info=info), n
    )


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

    from experiments.deploy.fleet import start_fleet

    start_fork_server(cfg)  # beside the checks below: local workers fork from it
    config = runtime_of(cfg)
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
    templates, grammars = sandboxes(server, loaded, server.max_prompt_chars or 16 * max_position)
    del loaded
    logging.getLogger().setLevel(config.log_level)
    name = server.served_model_name or config.model.name
    sock = listening_socket(server.host, server.port)
    fleet = start_fleet(config, config.deployments[0], out_dir / "logs")
    d = config.deployments[0]
    m = config.model
    prefill = [n for n in fleet.procs if fleet.roles[n] == "prefill"]
    router = Router.of(d, fleet.frontends, m.num_pages, m.page_size, fleet.cache_salt, config.slo, prefill)
    runtime = Runtime(fleet, d.on_worker_death, config.transfer.peer_timeout_s, router, d, config.slo)
    try:
        state = App(runtime, tokenizer, name, max_position, server.api_key, server, templates, grammars)
        app = make_app(state)
        host, port = sock.getsockname()[:2]
        url = f"http://{host}:{port}"
        print(f"serving {name} ({config.deployments[0].name}) on {url}", flush=True)
        (out_dir / "server.json").write_text(json.dumps({"url": url, "model": name}))
        if ready is not None:
            ready(url)
        uvicorn_config = uvicorn.Config(
            app,
            http=guarded_h11(server.header_timeout_s, server.max_connections),
            log_level="warning",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=server.timeout_keep_alive_s,
            h11_max_incomplete_event_size=64 * 1024,  # request line and headers (h11; httptools: 80 KiB)
        )
        server_class = type("Server", (_Server, uvicorn.Server), {})
        server_class(uvicorn_config, state, server.shutdown_timeout_s).run(sockets=[sock])
    finally:
        runtime.close(timeout_s=server.shutdown_timeout_s)
        for sandbox in (templates, grammars):
            if sandbox is not None:
                sandbox.close()
        sock.close()
        stop_fork_server()  # last: nothing of the server's outlives its pid
