"""What crosses between the driver and its workers: typed messages (transfer.wire), one decoder per side.

Worker -> driver: Listening (the control addresses a decode worker bound), Ready, Progress (the tokens
and text each step added to streamed requests), Load, Result, Timeline, Failed, and for elastic roles
Released, HandedBack, Switched. Driver -> worker: Connect (where a prefill worker finds its decode peers),
Submit, Cancel, PeerDead, Stop, and SwitchRole, PeerLeaving. The simulator builds
Results too; it imports these (and DeploymentRun, the record of a run), not process code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from experiments.deploy.config import DeploymentConfig
from transfer.protocol import check_request, check_request_id
from transfer.wire import Codec, Message


@dataclass(frozen=True)
class Request:
    """A request of a run: what the driver sends (experiments.workload makes them)."""

    request_id: str
    arrival_s: float  # offset from the start of the run (poisson); 0 under fixed concurrency
    prompt_ids: list[int] | range  # a range stands in for a simulated request's prompt
    max_tokens: int
    conversation: int = -1  # multiturn: its conversation and turn (0, 1, ...)
    turn: int = 0


class Turns(Protocol):
    """A closed-loop workload (experiments.workload.Conversations): the request that follows a reply."""

    def next(self, request: Request, reply_ids: list[int], now_s: float) -> Request | None: ...


class Listening(Message):
    name: str
    addresses: dict[str, str]  # prefill worker -> the address this decode worker bound for it


class Connect(Message):
    addresses: dict[str, str]  # decode worker -> the address it bound for this prefill worker


class Ready(Message):
    name: str
    cache_salt: bytes = b""  # what its prefix cache's page names start from (empty: caching off)


class Submit(Message):
    """A request and its sampling parameters (the engine's SamplingParams checks them on arrival)."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    ignore_eos: bool = True  # the main job's workloads fix output lengths
    stream: bool = False  # send Progress as tokens come
    # a request migrated from a worker that died: the tokens it generated there (it resumes after them,
    # their KV recomputed), and how many characters of their text the client already has
    output_ids: list[int] = []
    text_sent: int = 0
    prefill_worker: str | None = None  # the router's choice of prefill worker (None: the decode worker's)
    # the rest of engine.SamplingParams, by its names (its checks apply on the worker)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = {}
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    # engine.StructuredOutputs.wire(): (kind, text); only decode and colocated workers build its grammar
    structured_outputs: tuple[str, str] | None = None
    # its grammar compiled by the server's sandbox (xgrammar's serialized CompiledGrammar, for this model's
    # vocabulary): the worker loads it instead of compiling a client's spec on its step loop
    grammar: str | None = None
    # n > 1: the server sends one Submit per completion; a later one names the first (its request_id),
    # goes to the same worker and starts once that one's prompt KV is there, sharing its pages
    after: str | None = None
    cache_salt: str | None = None  # prefix-cache pages are shared only among requests of the same salt

    def __post_init__(self):
        check_request(self.request_id, self.prompt_ids)
        if self.after is not None:
            check_request_id(self.after)


# per output token: (token id, log-probability, rank) of the picked token, then of the likeliest others
TokenLogprobs = list[tuple[int, float, int]]


class Cancel(Message):
    """End a request now (its client went away); its Result still comes, finish_reason abort."""

    request_id: str


class Progress(Message):
    """What one step added to the worker's streamed requests: (request, new token ids, new text, their
    logprobs when the request asks for them, else [])."""

    items: list[tuple[str, list[int], str, list[TokenLogprobs]]]


class PeerDead(Message):
    """A prefill worker exited: its requests end. back_within_s > 0: it is being restarted, so requests
    that would have gone to it wait that long for it (when no other prefill worker is up)."""

    name: str
    back_within_s: float = 0.0
    pid: int = 0  # the process that exited (0: whichever): a restarted one that is already back stays


class Stop(Message):
    pass


class SwitchRole(Message):
    """Driver -> an elastic worker: serve `role` (prefill | decode) from now on. A decode worker hands
    its requests back at once (HandedBack: the driver resumes them elsewhere), lets what is in flight
    settle, then switches; a prefill worker is told only once no decode worker will send it more
    (Released from each), finishes its prefills, then switches. It answers Switched. prefill: the prefill
    workers a new decode worker waits for (their Hello) before it says so."""

    role: str
    prefill: list[str] = []

    def __post_init__(self):
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"SwitchRole.role must be 'prefill' or 'decode', got {self.role!r}")


class PeerLeaving(Message):
    """Driver -> decode worker: prefill worker `name` is leaving that role: send it nothing new; answer
    Released once nothing of this worker's is in flight there."""

    name: str


class Released(Message):
    """Decode worker -> driver: nothing of this worker's is in flight on prefill worker `peer`."""

    name: str
    peer: str


class HandedBack(Message):
    """A worker leaving the decode role -> driver: these requests end here without a Result; the
    driver resumes each on another decode worker after the tokens it streamed so far."""

    name: str
    request_ids: list[str]


class Switched(Message):
    """An elastic worker now serves `role`; seconds: what the switch took of this worker's time, from
    SwitchRole to now; settle_s of it went to waiting for what was in flight (a prefill worker's step
    that may still write the pages of a handed-back request, its own last prefills)."""

    name: str
    role: str
    seconds: float
    settle_s: float = 0.0


LOAD_EVERY_S = 0.5  # how often a worker sends its Load


class Load(Message):
    """A worker's state, every LOAD_EVERY_S (the server's /metrics, the router's cache and speed)."""

    name: str
    free_pages: int
    running: int  # sequences its scheduler runs
    waiting: int  # sequences queued: its scheduler's, waiting for pages, or for their KV to land
    preemptions: int = 0  # so far (engine.LLM.preemption_stats)
    recomputed_tokens: int = 0  # tokens computed again here after a preemption dropped their KV
    refetched_tokens: int = 0  # tokens whose KV a preemption dropped, fetched again from prefill
    prefix_queries: int = 0  # prompt tokens looked up in its prefix cache, and found there (so far)
    prefix_hits: int = 0
    cached_pages: int = 0  # pages its prefix cache names now
    # (stored?, page name) since its last Load: the router's view of its cache (Dynamo's KV events)
    cache_events: list[tuple[bool, bytes]] = []
    # so far: prompt tokens computed and the time of the steps that computed them; steps that only
    # decoded, their sequences and time (the router's admission measures the worker's speed by these)
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_seqs: int = 0
    decode_s: float = 0.0


class Result(Message):
    request_id: str
    worker: str
    output_ids: list[int]
    received: float  # perf_counter when the worker took the request
    scheduled: float | None  # first in a batch on this worker (local prefill or decode)
    token_times: list[float]
    finish_reason: str | None
    error: str | None
    prefill: str = "local"  # local | remote
    prefill_worker: str | None = None
    transfer_bytes: int = 0
    transfer_s: float | None = None  # PrefillRequest sent -> every write landed
    text: str = ""  # the output detokenized (stop strings cut off)
    output_tokens: int | None = None  # how many, where the ids are not known (an endpoint's usage)
    drafted: int = 0  # speculative decoding: drafts proposed, accepted, verify steps
    accepted: int = 0
    verify_steps: int = 0
    migrations: int = 0  # times its worker died under it and it went on on another (set by the driver)
    cached_tokens: int = 0  # prompt tokens whose KV its worker's prefix cache held (not computed or sent)
    logprobs: list[TokenLogprobs] | None = None  # Submit.logprobs: one per output token
    # it failed only because its prefill worker died or went silent: the runtime sends it again
    prefill_lost: bool = False


class Timeline(Message):
    name: str
    role: str
    # (start, end, prefill tokens, decode tokens with their drafts, sequences verifying drafts)
    steps: list[tuple[float, float, int, int, int]] = []
    preemptions: int = 0  # over the run, as in Load
    recomputed_tokens: int = 0
    refetched_tokens: int = 0
    prefix_queries: int = 0  # as in Load
    prefix_hits: int = 0
    cached_pages: int = 0
    free_pages: int = -1  # when it stopped, of num_pages (every page free: nothing leaked)
    num_pages: int = -1


class Failed(Message):
    name: str
    error: str


def driver_codec() -> Codec:
    """What the driver decodes (from its workers)."""
    return Codec(Listening, Ready, Progress, Load, Result, Timeline, Failed, Released, HandedBack, Switched)


def worker_codec() -> Codec:
    """What a worker decodes (from the driver)."""
    return Codec(Connect, Submit, Cancel, PeerDead, Stop, SwitchRole, PeerLeaving)


@dataclass
class DeploymentRun:
    """The record of one deployment's run: what the driver, the load client and the simulator produce
    and experiments.metrics reads."""

    deployment: DeploymentConfig
    requests: list[Request]
    sent: dict[str, float] = field(default_factory=dict)  # perf_counter when each request was routed
    results: dict[str, Result] = field(default_factory=dict)
    timelines: list[Timeline] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)  # (perf_counter, what happened)
    moves: list[dict] = field(default_factory=list)  # elastic roles: each worker moved (fleet.Elastic)
    start: float = 0.0
    end: float = 0.0
    interrupted: bool = False  # stopped by SIGTERM or Ctrl-C: unfinished requests are recorded as errors
    workers: list[dict] = field(default_factory=list)  # {name, role, node_id, pid} of each worker
    turns: Turns | None = None  # a multiturn workload: where each reply's next turn comes from

    def follow(self, request: Request, reply_ids: list[int], now: float) -> Request | None:
        """A multiturn workload's next turn after request's reply (ended at perf_counter now), added to
        requests; None when there is none (another workload, or the conversation is over)."""
        if self.turns is None:
            return None
        nxt = self.turns.next(request, reply_ids, now - self.start)
        if nxt is not None:
            self.requests.append(nxt)
        return nxt
