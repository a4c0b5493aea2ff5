"""The HTTP routes of the OpenAI-compatible server, as module-level handlers over the App that
make_app() puts in the FastAPI app's state (request.app.state.pdk): who may call (guard), the body's
arrival and JSON (body_of), and each route. serving.http.server starts the deployment and serves
these; serving.http.api checks each request and talks to the Runtime."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from serving.http.api import DISCONNECT_POLL_S, INLINE_BYTES, App, Parsed
from serving.http.connections import ARRIVED
from serving.http.errors import RETRY_AFTER_S, ApiError
from serving.http.fields import parse_json
from serving.http.shapes import finish_reason_of, usage_block
from serving.messages import Result
from serving.runtime import Ended, Routed, Streamed

log = logging.getLogger(__name__)


def make_app(state: App) -> FastAPI:
    """The FastAPI app serving state: its CORS origins, error handlers and routes."""
    api = FastAPI(title="pdkernels", docs_url=None, redoc_url=None, openapi_url=None)
    api.state.pdk = state
    cfg = state.config
    if cfg.cors_origins:  # browsers may call from these origins (preflight and headers)
        from starlette.middleware.cors import CORSMiddleware

        api.add_middleware(
            CORSMiddleware,
            allow_origins=list(cfg.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type"],
        )
    api.add_exception_handler(ApiError, _api_error)
    api.add_exception_handler(Exception, _internal)
    api.add_api_route("/health", health, methods=["GET"])
    api.add_api_route("/metrics", metrics, methods=["GET"])
    api.add_api_route("/v1/models", models, methods=["GET"])
    api.add_api_route("/v1/completions", completions, methods=["POST"])
    api.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    return api


async def _api_error(request: Request, e: ApiError):
    return e.response()


async def _internal(request: Request, e: Exception):  # never plain text, never a traceback
    log.exception("unhandled error answering %s", request.url.path)
    return ApiError(500, "internal error in the server").response()


async def completions(request: Request):
    return await generate(request, chat=False)


async def chat_completions(request: Request):
    return await generate(request, chat=True)


def guard(state: App, request: Request, key: bool = True) -> None:
    """Who may call: the Host a browser page on another site cannot forge into ours (DNS
    rebinding), no Origin but the allowed ones (cross-site requests), and the API key."""
    cfg = state.config
    host = (request.headers.get("host") or "").lower()
    name = host[1 : host.index("]")] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
    if not state.any_host and name not in state.hosts:
        raise ApiError(403, f"Host {host!r} is not served here (server.allowed_hosts)", "host")
    origin = request.headers.get("origin")
    if origin is not None and origin not in cfg.cors_origins and "*" not in cfg.cors_origins:
        raise ApiError(403, f"requests from origin {origin!r} are refused (server.cors_origins)", "origin")
    if key:
        authorize(state, request)


def authorize(state: App, request: Request) -> None:
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
        raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)")


async def body_of(state: App, request: Request) -> dict:
    """The JSON body: application/json, at most max_body_bytes (refused before it is read whole),
    within body_timeout_s, parsed off the event loop; NaN, infinities, nesting past the parser's
    depth, integers past 4,300 digits and lone surrogates are 400s."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(415, f"Content-Type must be application/json, got {kind or 'none'!r}")
    cfg = state.config
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


async def health(request: Request):
    state = request.app.state.pdk
    guard(state, request, key=not state.config.public_health)
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


async def metrics(request: Request):
    state = request.app.state.pdk
    guard(state, request)
    return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")


async def models(request: Request):
    state = request.app.state.pdk
    guard(state, request)
    card = {
        "id": state.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "pdkernels",
        "max_model_len": state.max_position,
    }
    return {"object": "list", "data": [card]}


def arrived_at(request: Request) -> float:
    """When the request began to arrive (perf_counter): its first bytes, or its connection's opening for a
    connection's first request (the protocol's stamp, serving.http.connections), what a client's
    own latencies count from; the handler's start where no stamp is (a test's app)."""
    return request.scope.get("state", {}).get(ARRIVED) or time.perf_counter()


async def generate(request: Request, chat: bool):
    arrived = arrived_at(request)  # what its latencies count from, as a client's do
    state = request.app.state.pdk
    guard(state, request)
    body = await body_of(state, request)
    sandboxed = chat or (
        isinstance(body, dict) and ("structured_outputs" in body or "response_format" in body)
    )
    # who it is for: its share of what all share (workers' admission, the sandboxes)
    client = state.client_of(request.client.host if request.client else "?", request.headers, body)
    work = state.prepare(body, chat, "/".join(client))  # templates, grammars: in the sandboxes
    prepared = await (unless_gone(request, work) if sandboxed else work)
    prompt = body.get("prompt") if isinstance(body, dict) and not chat else None
    if isinstance(prompt, list | str) and len(prompt) <= INLINE_BYTES // 4:
        parsed = state.parse(body, chat, prepared, client)  # a short completion prompt: under a millisecond
    else:  # rendered chats and long prompts tokenize off the loop
        parsed = await asyncio.to_thread(state.parse, body, chat, prepared, client)
    loop = asyncio.get_running_loop()
    events = state.start(parsed, loop, "/".join(client), arrived)
    if parsed.stream:  # a request refused at once (admission, no worker) is an HTTP error, not a stream
        try:
            first = await events.get()  # a completion Routed, or Ended at once
        except asyncio.CancelledError:  # the client went away
            state.cancel(parsed)
            raise
        if isinstance(first[1], Ended):
            fail(state, parsed, first[1].result)
        events.put_nowait(first)
        return StreamingResponse(stream(state, parsed, events, chat), media_type="text/event-stream")
    results: dict[int, Result] = {}
    try:
        while len(results) < parsed.n:
            try:
                index, event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():  # the client went away: so does its request
                    state.cancel(parsed)
                    return ApiError(408, "the client went away").response()  # nobody reads it
                continue
            if isinstance(event, Ended):
                fail(state, parsed, event.result)
                results[index] = event.result
    except asyncio.CancelledError:  # the client went away
        state.cancel(parsed)
        raise
    return JSONResponse(complete(state, parsed, [results[i] for i in range(parsed.n)], chat))


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


def fail(state: App, parsed: Parsed, result: Result) -> None:
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


def complete(state: App, parsed: Parsed, results: list[Result], chat: bool) -> dict:
    head = {"id": parsed.submit.request_id, "created": parsed.created, "model": state.model_name}
    k, choices = parsed.submit.sampling.logprobs, []
    for index, result in enumerate(results):
        reason, logprobs = finish_reason_of(result), None
        if k is not None and result.logprobs is not None:
            shapes = state.logprobs
            logprobs = shapes.chat(result.logprobs, k) if chat else shapes.completion(result.logprobs, 0)[0]
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


async def stream(state: App, parsed: Parsed, events: asyncio.Queue, chat: bool):
    head = {
        "id": parsed.submit.request_id,
        "created": parsed.created,
        "model": state.model_name,
        "object": "chat.completion.chunk" if chat else "text_completion",
    }
    k = parsed.submit.sampling.logprobs
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
    # chat: a choice's role chunk goes just before its first token's, as vLLM's does (sent at once, it
    # was the first chunk a client saw, and vLLM's benchmark read it as the first token: TTFT too short)
    role = [chat] * parsed.n
    first = [True] * parsed.n  # a choice's first token not yet written (Metrics.first_chunk)
    submits = [s.request_id for s in parsed.completions]
    try:
        while len(results) < parsed.n:
            index, event = await events.get()
            if isinstance(event, Routed):
                continue
            if isinstance(event, Streamed):
                ids, text, logprobs = event.ids, event.text, event.logprobs
                sent_chars[index] += len(text)
                sent_logprobs[index] += len(logprobs)
                # a chunk per step that made tokens, its text empty while a stop string may still claim
                # it or its bytes end mid-character (as vLLM's): a client times every token by it
                if ids or text or logprobs:
                    if first[index]:
                        first[index] = False
                        state.metrics.first_chunk(submits[index])
                    if role[index]:
                        role[index] = False
                        yield chunk(index, None, None, role=True)
                    yield chunk(index, text, None, logprobs=logprobs or None)
                continue
            result: Result = event.result
            results[index] = result
            try:
                fail(state, parsed, result)
            except ApiError as e:
                yield f"data: {json.dumps(e.body())}\n\n"
                yield "data: [DONE]\n\n"
                return
            if role[index]:
                role[index] = False
                yield chunk(index, None, None, role=True)
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
