"""What crosses between the runtime and its workers: typed messages (transfer.wire), one decoder per side.

Worker -> runtime: Listening (the control addresses a decode worker bound), Ready, Progress (the tokens
and text each step added to a request), Load, Result, Timeline, Failed, and for elastic roles Released,
HandedBack, Switched. Runtime -> worker: Connect (where a prefill worker finds its decode peers), Submit,
Cancel, PeerDead, Stop, and SwitchRole, PeerLeaving. Only the runtime's messages live here: the main job's
requests and its record of a run are experiments/record.py's.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

from engine.role import Role
from engine.sequence import SamplingParams
from transfer.protocol import check_request, check_request_id
from transfer.wire import Codec, Message


class Listening(Message):
    name: str
    addresses: dict[str, str]  # prefill worker -> the address this decode worker bound for it


class Connect(Message):
    addresses: dict[str, str]  # decode worker -> the address it bound for this prefill worker
    # a prefill worker of DP groups: decode worker -> the addresses it bound for groups 1, 2, ...
    groups: dict[str, list[str]] = {}


class Ready(Message):
    name: str
    cache_salt: bytes = b""  # what its prefix cache's page names start from (empty: caching off)
    # its speed, timed on dummy passes as it started (engine LLM.measure_speed; None: not measured): the
    # router predicts from them until its Loads measure real steps
    prefill_tok_s: float | None = None
    decode_step_s: float | None = None


class Submit(Message):
    """A request: its prompt and its engine.SamplingParams, the one declaration of the sampling fields
    (checked where it is built, and again on decode). The worker hands `sampling` to the engine as is."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool = False  # send Progress as tokens come
    # a request migrated from a worker that died: the tokens it generated there (it resumes after them,
    # their KV recomputed), and how many characters of their text the client already has
    output_ids: list[int] = []
    text_sent: int = 0
    prefill_worker: str | None = None  # the router's choice of prefill worker (None: the decode worker's)
    # its grammar compiled by the server's sandbox (xgrammar's serialized CompiledGrammar, for this model's
    # vocabulary): the worker loads it instead of compiling a client's spec on its step loop; None: the
    # worker compiles sampling.structured_outputs itself (the main job's workload, a trusted config)
    grammar: str | None = None
    # n > 1: the server sends one Submit per completion; a later one names the first (its request_id),
    # goes to the same worker and starts once that one's prompt KV is there, sharing its pages
    after: str | None = None
    completions: int = 1  # the first's: how many completions share its prompt (admission prices them all)
    dp_rank: int | None = None  # a worker of DP groups: the router's choice of group (None: the worker's)

    def __post_init__(self):
        check_request(self.request_id, self.prompt_ids)
        if self.after is not None:
            check_request_id(self.after)
        if self.completions < 1:
            raise ValueError(f"Submit.completions must be at least 1, got {self.completions}")
        if self.sampling.n != 1:
            raise ValueError(
                f"Submit.sampling.n must be 1 (one Submit per completion), got {self.sampling.n}"
            )


# per output token: (token id, log-probability, rank) of the picked token, then of the likeliest others
TokenLogprobs = list[tuple[int, float, int]]


class Cancel(Message):
    """End a request now (its client went away); its Result still comes, finish_reason abort."""

    request_id: str
    at: float = 0.0  # time.time() when the client went away (the prefill side counts work done past it)


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
    """Runtime -> an elastic worker: serve `role` (prefill | decode) from now on. A decode worker hands
    its requests back at once (HandedBack: the runtime resumes them elsewhere), lets what is in flight
    settle, then switches; a prefill worker is told only once no decode worker will send it more
    (Released from each), finishes its prefills, then switches. It answers Switched. prefill: the prefill
    workers a new decode worker waits for (their Hello) before it says so."""

    role: Role
    prefill: list[str] = []

    def __post_init__(self):
        self.role = Role.parse(self.role)
        if not self.role.switchable:
            raise ValueError(f"SwitchRole.role must be prefill or decode, got {self.role}")


class PeerLeaving(Message):
    """Runtime -> decode worker: prefill worker `name` is leaving that role: send it nothing new; answer
    Released once nothing of this worker's is in flight there."""

    name: str


class Released(Message):
    """Decode worker -> runtime: nothing of this worker's is in flight on prefill worker `peer`."""

    name: str
    peer: str


class HandedBack(Message):
    """A worker leaving the decode role -> runtime: these requests end here without a Result; the
    runtime resumes each on another decode worker after the tokens it streamed so far."""

    name: str
    request_ids: list[str]


class Switched(Message):
    """An elastic worker now serves `role`; seconds: what the switch took of this worker's time, from
    SwitchRole to now; settle_s of it went to waiting for what was in flight (a prefill worker's step
    that may still write the pages of a handed-back request, its own last prefills)."""

    name: str
    role: Role
    seconds: float
    settle_s: float = 0.0

    def __post_init__(self):
        self.role = Role.parse(self.role)


LOAD_EVERY_S = 0.5  # how often a worker sends its Load


class TierCounters(msgspec.Struct, forbid_unknown_fields=True):
    """One KV tier of a worker, so far (engine.kv.tiers.TierStats, and the pages it holds now)."""

    hit_tokens: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    loads: int = 0
    load_s: float = 0.0
    load_max_s: float = 0.0
    evictions: int = 0
    dropped: int = 0
    skipped: int = 0
    pages: int = 0


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
    kv_tiers: dict[str, TierCounters] = {}  # host, disk, pool (kv_tiers): per tier, so far
    # (stored?, page name) since its last Load: the router's view of its cache (Dynamo's KV events)
    cache_events: list[tuple[bool, bytes]] = []
    # a worker of DP groups (deployment.dp or decode_dp > 1): the same events per group, group 0 first
    # (the router's view of each group's cache; cache_events holds them all)
    group_cache_events: list[list[tuple[bool, bytes]]] = []
    # (tier, stored?, page name) below device memory since its last Load: host, disk, pool (kv_tiers)
    tier_events: list[tuple[str, bool, bytes]] = []
    # so far: prompt tokens computed and the time of the steps that computed them; steps that only
    # decoded, their sequences and time (the router's admission measures the worker's speed by these)
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_seqs: int = 0
    decode_s: float = 0.0
    # so far, a prefill worker's: prompt tokens computed for requests more than one step after their
    # client went away (work for nobody: a cancel that reaches it late, or an abort it does not heed)
    prompt_tokens_after_cancel: int = 0
    prefills_cancelled: int = 0  # requests whose client went away while this prefill worker held them
    # so far: a prefill worker's rails (its ranks' NICs) taken down, their posts moved to other rails; a
    # decode worker's transfer agents renewed because a post to them was stuck (transfer/rails.py)
    rail_failovers: int = 0
    agents_renewed: int = 0
    # its messenger's hand-off (transfer/handoff.py): requests in each state now, "side.state" -> count;
    # and its moves so far, "side|from|to|cause" -> count (a new messenger, after a role switch, from 0)
    handoff: dict[str, int] = {}
    handoff_moves: dict[str, int] = {}


class ErrorKind(StrEnum):
    """Why a request ended without its output, set where it failed (the HTTP status is the API's one
    table of these, serving.http.api.STATUS)."""

    BAD_REQUEST = "bad_request"  # its own fault: a worker refused what it asked
    REJECTED = "rejected"  # admission (deployment.admission=slo) refused it: it would miss its SLO
    CANCELLED = "cancelled"  # its client went away, the server is stopping, or the job was interrupted
    WORKER_LOST = "worker_lost"  # the workers that had it died, went silent or left (none could go on)
    DEADLINE = "deadline"  # not finished in time (the main job's run_timeout_s)
    INTERNAL = "internal"  # a fault of ours (an engine or runtime error)


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
    kv_landed: float | None = None  # perf_counter when every write landed (the prefill side's Sent joins it)
    text: str = ""  # the output detokenized (stop strings cut off)
    output_tokens: int | None = None  # how many, where the ids are not known (an endpoint's usage)
    drafted: int = 0  # speculative decoding: drafts proposed, accepted, verify steps
    accepted: int = 0
    verify_steps: int = 0
    migrations: int = 0  # times its worker died under it and it went on on another (set by the runtime)
    cached_tokens: int = 0  # prompt tokens whose KV its worker's prefix cache held (not computed or sent)
    logprobs: list[TokenLogprobs] | None = None  # Submit.logprobs: one per output token
    # it failed only because its prefill worker died or went silent: the runtime sends it again
    prefill_lost: bool = False
    error_kind: ErrorKind | None = None  # set with error (and for finish_reason abort: cancelled)

    @classmethod
    def failed(
        cls, request_id: str, kind: ErrorKind, error: str | None, worker: str = "", received: float = 0.0
    ) -> Result:
        """A request that ended without output: finish_reason rejected (admission), abort (cancelled)
        or error, its error text and kind."""
        reason = {ErrorKind.REJECTED: "rejected", ErrorKind.CANCELLED: "abort"}.get(kind, "error")
        return cls(request_id, worker, [], received, None, [], reason, error, error_kind=kind)


class Timeline(Message):
    name: str
    role: Role
    # (start, end, prefill tokens, decode tokens with their drafts, sequences verifying drafts, each
    # prompt chunk's [tokens, first position], the KV the decode tokens attend over: the simulator's
    # calibration prices attention by these)
    steps: list[tuple[float, float, int, int, int, list[tuple[int, int]], int]] = []
    preemptions: int = 0  # over the run, as in Load
    recomputed_tokens: int = 0
    refetched_tokens: int = 0
    prefix_queries: int = 0  # as in Load
    prefix_hits: int = 0
    cached_pages: int = 0
    kv_tiers: dict[str, TierCounters] = {}
    prompt_tokens_after_cancel: int = 0  # as in Load
    prefills_cancelled: int = 0
    rail_failovers: int = 0  # as in Load
    agents_renewed: int = 0
    handoff: dict[str, int] = {}  # as in Load, when it stopped
    handoff_moves: dict[str, int] = {}
    # loads from the tiers below device memory: (start, end, tier of most of its pages, pages loaded)
    loads: list[tuple[float, float, str, int]] = []
    # its transfers as a prefill worker (transfer.prefill.Sent: request id, first pass began, first KV post,
    # prefill computed, last write done)
    sent: list[tuple[str, float | None, float | None, float | None, float]] = []
    free_pages: int = -1  # when it stopped, of num_pages (every page free: nothing leaked)
    num_pages: int = -1


class Failed(Message):
    name: str
    error: str


def driver_codec() -> Codec:
    """What the runtime decodes (from its workers)."""
    return Codec(Listening, Ready, Progress, Load, Result, Timeline, Failed, Released, HandedBack, Switched)


def worker_codec() -> Codec:
    """What a worker decodes (from the runtime)."""
    return Codec(Connect, Submit, Cancel, PeerDead, Stop, SwitchRole, PeerLeaving)
