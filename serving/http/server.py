"""The HTTP front (`python -m experiments.serve [group=option] [key=value]`): an OpenAI-compatible
endpoint over any deployment (colocated, xPyD, any TP), on FastAPI + uvicorn.

It composes the same hydra config as experiments.run (`model/`, `deployment/`, `transfer/`, `kernels`)
plus `server` (host, port, api_key, served_model_name), starts the deployment's workers through the
runtime the main job runs (serving.runtime.start_runtime) and serves:

- POST /v1/completions, POST /v1/chat/completions: streamed (server-sent events) or not; max_tokens
  (max_completion_tokens for chat), temperature, top_p, seed, stop and vLLM's top_k and ignore_eos.
  Tokens flow from the decode (or colocated) worker through the runtime as they are sampled. A client
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
compiles run in killable child processes (serving.http.sandbox), parsing and tokenizing off the
event loop. Ctrl-C or SIGTERM drain it, then stop every worker, the sandboxes and the fork server, and
remove the run's directory before the process exits.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import time
from pathlib import Path

from omegaconf import DictConfig

from serving.config import check_fits_model, runtime_of
from serving.fleet.launcher import start_fork_server, stop_fork_server
from serving.http.api import App, ServerConfig
from serving.http.connections import guarded_h11
from serving.http.routes import make_app
from serving.runtime import start_runtime

log = logging.getLogger(__name__)
__all__ = ["ServerConfig", "listening_socket", "serve"]


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


def open_files_for(connections: int) -> int:
    """Raise this process's open-files limit (soft, up to the hard one) to hold `connections` sockets
    and the workers' besides; returns the limit now. Many machines start at 1,024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 512  # workers' sockets, sandboxes' pipes, logs
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning("open files are limited to %d: fewer than server.max_connections=%d can be open", soft,
                    connections)  # fmt: skip
    return soft


def sandboxes(server: ServerConfig, loaded, max_chars: int):
    """The processes chat templates render in and grammars compile in (none for grammars where the
    model has no tokenizer); their children start when a first task comes, forked from the fork server,
    and the grammars' vocabulary is made then too."""
    from engine.structured import tokenizer_info
    from serving.http.sandbox import MAX_COMPILED_CHARS, Sandbox, Setup

    tok, model = loaded.tokenizer, loaded.config
    n = server.sandbox_processes
    setup = Setup("template", server.template_max_bytes, max_chars, tok.chat_template, tok.bos_token)
    templates = Sandbox(setup, n)
    if tok.tokenizer is None:  # NoTokenizer: token ids only
        return templates, None

    def vocabulary() -> str:
        return tokenizer_info(tok, model.vocab_size, model.eos_token_ids).serialize_json()

    setup = Setup("grammar", server.grammar_max_bytes, MAX_COMPILED_CHARS)
    return templates, Sandbox(setup, n, vocabulary=vocabulary)


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

    start_fork_server(cfg)  # beside the checks below: local workers fork from it
    config = runtime_of(cfg)
    from omegaconf import OmegaConf

    server = ServerConfig(**(OmegaConf.to_container(cfg.server) if cfg.get("server") else {}))
    if len(config.deployments) != 1:
        raise ValueError(
            f"serving takes one deployment; `deployments` lists {[d.name for d in config.deployments]}"
        )
    if config.deployments[0].num_workers == "auto":
        raise ValueError(
            "deployment.num_workers=auto is chosen by simulating a run's requests (experiments.run); a "
            "server has none ahead: give num_workers and threads_per_worker as numbers"
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
    open_files_for(server.max_connections)
    sock = listening_socket(server.host, server.port)
    runtime = start_runtime(config, config.deployments[0], out_dir / "logs")
    log_file = open(out_dir / "requests.jsonl", "a") if server.request_log else None  # noqa: SIM115
    try:
        state = App(
            runtime, tokenizer, name, max_position, server.api_key, server, templates, grammars, log_file
        )
        app = make_app(state)
        host, port = sock.getsockname()[:2]
        url = f"http://{host}:{port}"
        print(f"serving {name} ({config.deployments[0].name}) on {url}", flush=True)
        # written whole, then renamed: a client that waits for the file never reads it half-written
        (out_dir / "server.json.tmp").write_text(json.dumps({"url": url, "model": name}))
        (out_dir / "server.json.tmp").replace(out_dir / "server.json")
        if ready is not None:
            ready(url)
        uvicorn_config = uvicorn.Config(
            app,
            http=guarded_h11(
                server.header_timeout_s, server.max_connections, server.max_connections_per_client
            ),
            log_level="warning",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=server.timeout_keep_alive_s,
            h11_max_incomplete_event_size=64 * 1024,  # request line and headers (h11; httptools: 80 KiB)
        )
        server_class = type("Server", (_Server, uvicorn.Server), {})
        server_class(uvicorn_config, state, server.shutdown_timeout_s).run(sockets=[sock])
    finally:
        runtime.close(timeout_s=server.shutdown_timeout_s)
        if log_file is not None:
            log_file.close()
        for sandbox in (templates, grammars):
            if sandbox is not None:
                sandbox.close()
        sock.close()
        stop_fork_server()  # last: nothing of the server's outlives its pid
