"""`server.*`: what experiments.serve's OpenAI-compatible endpoint binds, who may use it, and the bounds on
every request (serving/http/api.py enforces them). A module of its own so that the config's schema
(experiments/schema.py) reads it without importing the server.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # the address it binds: loopback unless you mean to expose it
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
    # open at once; at it the idlest kept-alive connection is closed to let a new one in, and only when
    # none is idle is a new connection answered 503 and closed (the server raises its open-files limit)
    max_connections: int = 2048
    # of those, from one client address (the rest stay for others): a benchmark at concurrency 256 holds
    # 256 from one host, and a gateway all of its users'
    max_connections_per_client: int = 512
    # Clients are told apart by the address behind a trusted proxy (its client_header), else the peer's
    # address; and within it by the request's user (or safety_identifier, or the bearer key it sends).
    # Workers admit each client's sequences by its share of what runs (engine/fair.py): a client over its
    # share waits its turn, it is not refused
    trusted_proxies: tuple[str, ...] = ()  # addresses (or networks: 10.0.0.0/8) whose client_header counts
    client_header: str = "x-forwarded-for"  # its last entry is the client's address (as the proxy saw it)
    # a hard limit (off by default): completions in flight from one client (n counts n); past it, 429
    max_sequences_per_client: int | None = None
    shutdown_timeout_s: float = 5.0  # SIGTERM/Ctrl-C: requests in flight may finish this long (new: 503)
    # Host headers served besides this machine's loopback names and the bound address ("*": any)
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any); none by default
    max_n: int = 16  # the most completions one request may ask for (n)
    # whose requests share prefix-cache pages: none (all with the same cache_salt, none given: all), user
    # (the request's `user` is part of its salt), salt (only requests that give the same cache_salt)
    cache_isolation: str = "none"
    # each finished request's times (TTFT from its HTTP request's arrival, TPOT) as a JSON line in the run
    # folder's requests.jsonl: what a client's own figures are held against (make compat); it grows
    request_log: bool = False

    def __post_init__(self):
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"server.port={self.port!r} is not allowed: an integer in [0, 65536)")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("server.api_key must be a non-empty string or null")
        for key in ("max_body_bytes", "max_prompt_chars", "max_n", "template_max_bytes", "grammar_max_bytes",
                    "sandbox_processes", "max_connections", "max_connections_per_client",
                    "max_sequences_per_client"):  # fmt: skip
            value = getattr(self, key)
            if (value is not None or key not in ("max_prompt_chars", "max_sequences_per_client")) and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"server.{key}={value!r} is not allowed: an integer >= 1")
        for key in ("body_timeout_s", "template_timeout_s", "grammar_timeout_s", "timeout_keep_alive_s",
                    "header_timeout_s", "shutdown_timeout_s"):  # fmt: skip
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e6:
                raise ValueError(f"server.{key}={value!r} is not allowed: a number of seconds > 0")
        for key in ("allowed_hosts", "cors_origins", "trusted_proxies"):
            value = getattr(self, key)
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"server.{key}={value!r} is not allowed: a list of non-empty strings")
            object.__setattr__(self, key, tuple(value))
        for proxy in self.trusted_proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                what = "not an address or network (10.0.0.5, 10.0.0.0/8)"
                raise ValueError(f"server.trusted_proxies holds {proxy!r}: {what}") from None
        header = self.client_header
        if not isinstance(header, str) or not header or not header.replace("-", "").isalnum():
            what = "a header name (x-forwarded-for)"
            raise ValueError(f"server.client_header={header!r} is not allowed: {what}")
        object.__setattr__(self, "client_header", header.lower())
        if self.cache_isolation not in CACHE_ISOLATION:
            raise ValueError(
                f"server.cache_isolation={self.cache_isolation!r} is not allowed: one of {CACHE_ISOLATION}"
            )
        for key in ("public_health", "request_log"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"server.{key}={getattr(self, key)!r} is not allowed: true or false")


CACHE_ISOLATION = ("none", "user", "salt")
