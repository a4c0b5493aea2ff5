"""The prefill side of the KV messenger: stream each layer's pages as soon as the layer is done.

The engine calls `on_batch` before every forward pass (which chunks, which pages) and `on_prefilled`
after a request's last chunk. A sender thread then waits on the layer counter and posts layer l's
writes for the batch the moment counter[0, l] reaches that pass, while the forward pass goes on with
later layers (`transfer.send_mode=layer`; `chunk` waits for the pass's last layer and posts every layer
at once, `request` holds a request's pages until its last chunk is computed: the baselines the streaming
is measured against). A page is posted once, when it is full (or, at the end, when it is the last page),
so no page is ever written twice; pages the decode side already holds (`skip_pages`, its prefix cache)
are never written. `done_log` keeps, per finished request, when its first pass began, when its first KV
post went out, when its prefill was computed and when its last write finished: what the run's results
join with the decode side's landing time to tell how much of the transfer the compute hid.

All backend calls happen on the sender thread; the engine's thread only reads flags in `poll`, which also
frees finished requests' pages and answers aborts.

Each TP rank's KV goes out through an agent of its own (transfer/agents.py: its region only, on its
NIC; an agent on each where the rank has several NICs), so a post is one (this side's agent, the decode
side's agent) pair's writes with its own notification; the decode side counts them all. A rank pair's
writes are striped over the rails (NICs) both sides share, each rail's share following the rate its
agent's posts have been finishing at (transfer/rails.py). A rail whose posts stop finishing (its NIC
down, on either side) is failed over: its agent is retired (closed with what it had not sent), its
posts go again over the rank's other rails, each notification naming the decode agent the stuck post
went to (which the decode side renews before it counts the post, so a write still in the network's
buffers cannot land once the request is released), and a successor agent starts on that NIC once a
back-off is over and the NIC takes it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

from transfer.agents import RankAgents, context_region, pairs, route
from transfer.backends import Backend, TransferError, WriteOp
from transfer.backends.base import as_ops
from transfer.config import TransferConfig
from transfer.handoff import PREFILL_MOVES, Cause, Handoff, PrefillState
from transfer.plan import ShardSpec, plan_array
from transfer.protocol import Abort, Accepted, Ended, Hello, Notif, Posted, PrefillRequest
from transfer.rails import Rails, parts_of

log = logging.getLogger(__name__)
State = PrefillState
# the sender thread's wait between looks at the layer counter and at posts in flight: about a
# POLLS_PER_LAYER-th of the time a layer has been taking, within [POLL_S, MAX_POLL_S]. Where the pass runs
# on the CPU this thread shares its core and the GIL, and each look (its reaping drives UCX's progress)
# takes from the pass; fewer looks starve UCX's TCP progress where the link is as slow as the compute
# (docs/results/multi-machine.md measures both). On a GPU a layer takes under a millisecond and the floor
# holds
POLL_S, MAX_POLL_S, POLLS_PER_LAYER = 5e-4, 4e-3, 8
IDLE_WAIT_S = 0.05  # with nothing in flight, the sender thread waits this long for a job (or close)
LOG_LIMIT = 4096  # entries kept in post_log / done_log (diagnostics, not per-request state)


class PrefillEngine(Protocol):
    # compute their KV; client: who it is for (names of the decode side's; the engine's fair share)
    def start(self, request_id: str, prompt_ids: list[int], cache_salt: str = "", client=()) -> None: ...

    def pages(self, request_id: str) -> list[int]: ...

    def stop(self, request_id: str) -> None: ...  # compute no more for it (pages stay until release)

    def release(self, request_id: str) -> None: ...  # free its pages


class Sent(NamedTuple):
    """A finished request's KV transfer, as this side saw it (perf_counter times)."""

    request_id: str
    started: float | None  # the first forward pass with its tokens began (None: it computed nothing)
    first_post: float | None  # its first KV post went out (None: every page was skipped)
    computed: float | None  # the forward pass that computed its last chunk returned
    done: float  # its last write (the context) finished


@dataclass
class _Post:
    """A post in flight: what it carries, so that it can go again over another rail."""

    src: int  # this side's agent
    dst: int  # the decode side's agent (its index in the request's dst_metadata)
    peer: str  # the name this side's agent knows that one by
    handle: object
    nbytes: int
    ops: object  # WriteOps (an array [n, 5], or a list of WriteOp)
    notif: Notif


@dataclass
class _Transfer:
    req: PrefillRequest
    channel: object  # its control channel
    sent_pages: int = 0  # pages [0, sent_pages) are posted (or queued to be)
    in_flight: list[_Post] = field(default_factory=list)  # its posts in flight (the sender thread's)
    dead: set = field(default_factory=set)  # (our agent, their agent) pairs a post of it failed on
    stuck: set = field(default_factory=set)  # decode agents a stuck post of it went to (Ended names them)
    posts: int = 0  # posts made, numbering each notification
    context_posted: bool = False
    done_at: float | None = None  # perf_counter when every write had finished
    finished: dict = field(default_factory=dict)  # decode agent -> numbers of the posts that finished there
    started: float | None = None  # perf_counter when the first pass with its tokens began
    first_post: float | None = None  # perf_counter of its first KV post
    computed: float | None = None  # perf_counter when its last chunk's forward pass returned
    held: tuple[int, int, list[int]] | None = None  # send_mode=request: pages [i0, i1) of these, not posted
    aborted: str | None = None
    error: str | None = None
    stop_cause: Cause = Cause.ERROR  # why it stopped (aborted's or error's): the hand-off's move
    # (pass number, time.time() as it began, prompt tokens) of each forward pass that computed some of it
    passes: list[tuple[int, float, int]] = field(default_factory=list)
    cancelled_at: float = 0.0  # its Abort's: when its client went away


def _key(msg: PrefillRequest | Abort) -> tuple[str, int]:
    """What names one transfer on this side (the hand-off's key): an id may be here twice, seq once."""
    return msg.request_id, msg.seq


def late_tokens(passes: list[tuple[int, float, int]], cancelled_at: float) -> int:
    """Prompt tokens computed for a request more than one step after its client went away: those of the
    passes that began after cancelled_at, the first of them excepted (a cancel takes a step to arrive)."""
    after = [(n, tokens) for n, at, tokens in passes if at > cancelled_at]
    first = min((n for n, _ in after), default=None)
    return sum(tokens for n, tokens in after if n != first)


def _remember(kept: OrderedDict, key, value) -> None:
    """Keep key -> value, the oldest going past LOG_LIMIT entries."""
    kept[key] = value
    while len(kept) > LOG_LIMIT:
        kept.popitem(last=False)


class PrefillMessenger:
    def __init__(
        self,
        engine: PrefillEngine,
        backend: Backend | list[Backend],  # one agent per TP rank, or one for every rank (transfer.agents)
        spec: ShardSpec,
        kv_regions: list[Tensor],
        counter: Tensor,  # polled by the sender thread: host memory (see pdkernels.out_proj.host_view)
        hidden_size: int,
        config: TransferConfig | None = None,
        # where the KV crosses in another dtype than the cache's (spec and kv_regions a staging copy's:
        # transfer.plan.as_e4m3): stage(page ids, the tokens they hold, layers) fills them before posting
        stage=None,
    ):
        self.engine, self.spec, self.counter, self.stage = engine, spec, counter, stage
        self.config = config or TransferConfig()
        slots = self.config.context_slots
        # staging for context writes, beside the KV (one memory type per NIXL agent: DRAM or VRAM)
        self.context = torch.zeros(slots, hidden_size, dtype=torch.float32, device=kv_regions[0].device)
        self.agents = RankAgents(backend, kv_regions, self.context)
        self.backend = self.agents.backends[0]  # rank 0's (the context buffer's)
        self.rails = Rails(len(self.agents.backends), self.config.rail_timeout_s)
        self.rates = self.rails.rates
        self.failovers = 0  # rails taken down, each with its posts moved to the rank's other rails
        self.reposted = 0  # posts sent again over another rail
        self.channels: list = []  # one control channel per decode worker
        self._free_slots = list(range(slots))
        self._slots: dict[str, int] = {}
        self.transfers: dict[str, _Transfer] = {}  # by request id: what the sender thread reads
        # every request's state (transfer/handoff.py), by (request id, seq): an id may be queued behind
        # its own earlier transfer, which a decode worker that took it over (or fetched it again) sent
        self.handoff: Handoff[PrefillState] = Handoff("prefill", PREFILL_MOVES)
        self._peers: dict[tuple[int, bytes], str] = {}  # (agent, a decode agent's metadata) -> its name
        self._passes = 0
        self._layer_s = 0.0  # seconds a layer has been taking (moving average, as the sender thread saw)
        # the latest (request, layer, perf_counter) of KV posts, and the latest finished transfers
        self.post_log: deque[tuple[str, int, float]] = deque(maxlen=LOG_LIMIT)
        self.done_log: deque[Sent] = deque(maxlen=LOG_LIMIT)
        self.refused = 0  # requests refused at the boundary
        # prompt tokens computed more than one step after their client went away (late_tokens), so far;
        # and the passes of the latest finished transfers, for an Abort that arrives after they ended
        self.tokens_after_cancel = 0
        self.cancelled_in_flight = 0  # requests whose client went away while held here (or before they came)
        self._ended_passes: OrderedDict[tuple[str, int], list] = OrderedDict()
        # request -> when its client left, for a cancel that came before the request did (the runtime's
        # Cancel overtook the decode worker's PrefillRequest): the request ends as it arrives (LOG_LIMIT kept)
        self._gone: OrderedDict[str, float] = OrderedDict()
        self._last_seq: dict[int, int] = {}  # id(channel) -> newest request seq taken from it
        # requests whose id an earlier owner still holds here (moved to another decode worker): taken once
        # the old transfer's writes are done and its pages back
        self._waiting: list[tuple[PrefillRequest, object]] = []
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send_loop, name="prefill-messenger", daemon=True)
        self._thread.start()

    # ---- engine hooks (the engine's thread) ----------------------------------------------------------

    def on_batch(self, batch, counter: Tensor) -> None:
        """Before a forward pass: queue the pages this pass completes, to be posted layer by layer."""
        self._passes += 1
        items = []
        began = time.time()
        for chunk in batch.chunks:
            t = self.transfers.get(chunk.seq.request_id)
            if t is not None:
                t.passes.append((self._passes, began, chunk.num_tokens))
            if t is None or t.aborted:
                continue
            t.started = t.started or time.perf_counter()
            final = chunk.end == len(chunk.seq.prompt_ids)
            upto = len(chunk.pages) if final else chunk.end // self.spec.page_size
            if upto > t.sent_pages:
                if self.config.send_mode == "request":  # held until on_prefilled
                    t.held = (t.held[0] if t.held else t.sent_pages, upto, list(chunk.pages[:upto]))
                else:
                    items.append((t, t.sent_pages, upto, list(chunk.pages[:upto])))
                t.sent_pages = upto
        if items:
            self._jobs.put(("kv", self._passes, items))

    def on_prefilled(self, seq, last_hidden: Tensor) -> None:
        """After the last chunk: queue the context write (the last position's hidden state)."""
        t = self.transfers.get(seq.request_id)
        if t is None or t.aborted or self.handoff.state(_key(t.req)) is not State.COMPUTING:
            return  # stopped (aborted, or failed: its posts end)
        t.computed = time.perf_counter()
        self.handoff.move(_key(t.req), State.SENDING, Cause.COMPUTED)
        if t.held is not None:  # send_mode=request: every page now, once the pass's last layer is stored
            self._jobs.put(("kv", self._passes, [(t, *t.held)]))
            t.held = None
        slot = self._slots[seq.request_id]
        self.context[slot] = last_hidden.float()
        done = None
        if self.context.is_cuda:  # the copy is queued on the compute stream: post once it has run
            done = torch.cuda.Event()
            done.record()
        self._jobs.put(("ctx", t, slot, done))

    def on_failed(self, seq, error: str) -> None:
        """The engine failed the request (its step raised): it fails here, and Ended tells the decode side."""
        t = self.transfers.get(seq.request_id)
        if t is not None:
            with self._lock:
                t.error = t.error or error
            self._stopping(t)

    # ---- control (the engine's thread) ----------------------------------------------------------------

    def add_peer(self, channel) -> None:
        """Serve a decode worker over channel; it learns this worker's shard spec from the Hello."""
        self.channels.append(channel)
        channel.send(Hello.of(self.spec, self.agents.names, self.agents.rails))

    def replace_peer(self, channel) -> None:
        """A decode worker came back as a new process (restarted): what was on its old channel is
        aborted, the old channel closed, and the new one served as add_peer does."""
        self.remove_peer(channel.peer, "decode worker restarted", Cause.PEER_EXITED)
        self.add_peer(channel)

    def remove_peer(
        self, name: str, reason: str = "decode worker left the decode role", cause: Cause = Cause.PEER_LEFT
    ) -> None:
        """A decode worker left that role (an elastic worker): what came over its channel is aborted and
        the channel closed."""
        for old in [c for c in self.channels if c.peer == name]:
            self._abort_channel(old, reason, cause)
            self.channels.remove(old)
            old.close()

    def _abort_channel(self, channel, reason: str, cause: Cause) -> None:
        """Abort every request that came over channel (its decode worker is silent, replaced or gone)."""
        for t in list(self.transfers.values()):
            if t.channel is channel:
                self.abort(t.req.request_id, reason, cause)
        for req, queued in [(r, c) for r, c in self._waiting if c is channel]:  # never started: end now
            self._unqueue(req, queued, reason, cause)

    def _unqueue(self, req: PrefillRequest, channel, reason: str, cause: Cause) -> None:
        """A queued request (never started here) ends: out of the queue, ENDED, and its decode worker told."""
        self._waiting.remove((req, channel))
        self.handoff.move(_key(req), State.ENDED, cause)
        self._tell(channel, Ended(req.request_id, req.seq, f"aborted: {reason}"))

    def abort(self, request_id: str, reason: str, cause: Cause = Cause.ABORTED) -> None:
        """Stop a request from this side: no post for it starts after this; Ended tells the decode side."""
        t = self.transfers.get(request_id)
        if t is None:
            return
        with self._lock:
            if not t.aborted:
                t.aborted, t.stop_cause = reason, cause
        self._stopping(t)
        self.engine.stop(request_id)

    def _stopping(self, t: _Transfer) -> None:
        """An aborted or failed transfer posts nothing new (the sender thread checks its flags): STOPPING
        until its posts in flight finish."""
        key = _key(t.req)
        if self.handoff.state(key) in (State.COMPUTING, State.SENDING):
            self.handoff.move(key, State.STOPPING, t.stop_cause)

    def cancel(self, request_id: str, at: float) -> None:
        """Its client went away (at: when, time.time()), as the runtime says, which may be before its
        decode worker's Abort comes (that worker busy or frozen): stop it as that Abort would, and tell the
        decode worker Ended. A request queued here goes at once; one not here yet is remembered, and ends
        as it arrives (a decode worker that sent it just after the client left, before it heard: under an
        abort storm it was computed whole for nobody)."""
        queued = [(r, c) for r, c in self._waiting if r.request_id == request_id]
        for req, channel in queued:
            self._unqueue(req, channel, "the client went away", Cause.CANCELLED)
        t = self.transfers.get(request_id)
        if t is not None and self._cancelled(t, at):
            self.abort(request_id, "the client went away", Cause.CANCELLED)
        elif t is None and not queued:
            _remember(self._gone, request_id, at)

    def _cancelled(self, t: _Transfer, at: float) -> bool:
        """Its client went away at `at`: counted once, whichever of the runtime's Cancel and the decode
        worker's Abort comes first. Whether this was the first."""
        if t.cancelled_at:
            return False
        t.cancelled_at = at
        self.cancelled_in_flight += 1
        return True

    def poll(self) -> None:
        """Take new requests and aborts; free the pages of requests whose writes have all finished."""
        for channel in self.channels:
            channel.heartbeat()
            for msg in channel.receive():
                if isinstance(msg, PrefillRequest):
                    self._accept(msg, channel)
                elif isinstance(msg, Abort):
                    self._on_abort(msg, channel)
            if channel.peer_silent_for() > self.config.peer_timeout_s:
                self._abort_channel(channel, "decode worker silent", Cause.PEER_SILENT)
        with self._lock:
            failed = [t for t in self.transfers.values() if t.error]  # by the sender thread, or the engine
            done = [
                t
                for t in self.transfers.values()
                if not t.in_flight and (t.context_posted or t.aborted or t.error)
            ]
            for t in done:
                del self.transfers[t.req.request_id]
        for t in failed:
            self._stopping(t)
        for t in done:
            rid = t.req.request_id
            if self.handoff.state(_key(t.req)) is State.STOPPING:
                self.handoff.move(_key(t.req), State.ENDED, Cause.DRAINED)
            else:  # every write finished
                self.handoff.move(_key(t.req), State.SENT, Cause.POSTED)
                if self.agents.striped:  # which agent each post went to, should a NIC drop them
                    self._tell(t.channel, Posted(rid, t.req.seq, t.finished))
            if t.done_at is not None:
                self.done_log.append(Sent(rid, t.started, t.first_post, t.computed, t.done_at))
            self.engine.stop(rid)  # a failed transfer stops its computation too
            self.engine.release(rid)
            self._free_slots.append(self._slots.pop(rid))
            if t.cancelled_at:
                self.tokens_after_cancel += late_tokens(t.passes, t.cancelled_at)
            else:  # kept a while: an Abort may still come (its client left as its KV landed)
                _remember(self._ended_passes, (rid, t.req.seq), t.passes)
            if t.aborted or t.error:
                stuck = sorted(t.stuck)
                self._tell(t.channel, Ended(rid, t.req.seq, t.error or f"aborted: {t.aborted}", stuck))
        if self._waiting:
            waiting, self._waiting = self._waiting, []
            for req, channel in waiting:
                if channel not in self.channels:  # its decode worker left meanwhile
                    self.handoff.move(_key(req), State.ENDED, Cause.PEER_LEFT)
                    continue
                if req.request_id in self.transfers:
                    self._waiting.append((req, channel))
                else:
                    self._take(req, channel)

    def _tell(self, channel, msg) -> None:
        if channel not in self.channels:
            return  # replaced (its decode worker restarted): no one is there to hear it
        try:
            channel.send(msg, timeout_s=0.1)
        except TimeoutError:  # a decode worker that takes nothing is silent, and handled as such
            pass

    def _on_abort(self, msg: Abort, channel) -> None:
        """Only the decode worker that sent a request may abort it; one this side does not hold (finished,
        refused, never seen) is answered at once, so the decode side never waits for an Ended, and the
        request itself, should it still arrive (a reordered channel), is dropped."""
        waiting = [(r, c) for r, c in self._waiting if r.request_id == msg.request_id and c is channel]
        if waiting and waiting[0][0].seq == msg.seq:  # never started here: gone from the queue
            self._unqueue(*waiting[0], msg.reason, Cause.CANCELLED if msg.cancelled_at else Cause.ABORTED)
            return
        t = self.transfers.get(msg.request_id)
        ended = self._ended_passes.pop((msg.request_id, msg.seq), None)
        if ended is not None and msg.cancelled_at:
            self.tokens_after_cancel += late_tokens(ended, msg.cancelled_at)
        if t is not None and t.channel is channel and t.req.seq == msg.seq:
            cause = Cause.ABORTED
            if msg.cancelled_at:  # a client's cancel (0: the decode worker's own abort)
                self._cancelled(t, msg.cancelled_at)
                cause = Cause.CANCELLED
            self.abort(msg.request_id, msg.reason, cause)
        elif t is None or t.req.seq != msg.seq:
            self._last_seq[id(channel)] = max(self._last_seq.get(id(channel), -1), msg.seq)
            self._tell(channel, Ended(msg.request_id, msg.seq, f"aborted: {msg.reason} (not held here)"))
        else:
            log.warning("ignored an Abort of %s from a decode worker that does not own it", msg.request_id)

    def _accept(self, req: PrefillRequest, channel) -> None:
        """Check and plan the request, then queue it; a bad one is refused and touches nothing. A request
        no newer than the last one from its channel (a duplicate, or one already aborted) is dropped."""
        if req.seq <= self._last_seq.get(id(channel), -1) or _key(req) in self.handoff:
            log.warning("dropped request %s: seq %d is stale on its channel", req.request_id, req.seq)
            return
        self._last_seq[id(channel)] = req.seq
        if self._gone.pop(req.request_id, None) is not None:  # its client left before it came
            self.cancelled_in_flight += 1
            self.handoff.move(_key(req), State.ENDED, Cause.CANCELLED)
            self._tell(channel, Ended(req.request_id, req.seq, "aborted: the client went away"))
            return
        old = self.transfers.get(req.request_id)
        if old is not None and old.channel is not channel:
            # the request moved to another decode worker (the first one died or gave it up, and this side
            # may not have heard yet): the newer owner wins; the old transfer stops, and this one waits
            # for its writes to finish and its pages to come back
            self.abort(req.request_id, "the request moved to another decode worker", Cause.MOVED)
            self._queue(req, channel)
            return
        if old is not None:  # its owner again, newer: it is done with the old one (landed: a preempted
            # request fetched again; or aborted), which this side has not reaped yet. It waits for that
            # (refused, 2 of 512 requests failed at 256 streams on 1P1D)
            self._queue(req, channel)
            return
        self._take(req, channel)

    def _queue(self, req: PrefillRequest, channel) -> None:
        """The request waits (QUEUED) for a context slot or for its id's earlier transfer to end."""
        if self.handoff.state(_key(req)) is None:
            self.handoff.move(_key(req), State.QUEUED, Cause.RECEIVED)
        self._waiting.append((req, channel))

    def _take(self, req: PrefillRequest, channel) -> None:
        try:
            if req.request_id in self.transfers:
                raise ValueError(f"request {req.request_id!r} is already being prefilled here")
            if not self._free_slots:  # decode workers' requests beyond them wait for a transfer to end
                self._queue(req, channel)
                return
            routes = self._plan(req)
            ctx = self._context_pair(req)
            dead = set()  # pairs that cannot connect (a NIC down): its writes go the other ways
            with self._lock:  # the sender thread may retire or renew an agent meanwhile
                for src, dst, ops in [*routes, (*ctx, [self._context_op(req, 0)])]:
                    if src not in self.rails.retired:
                        self._check_pair(req, src, dst, ops, dead)
            self.engine.start(req.request_id, req.prompt_ids, req.cache_salt, req.client)  # checks the ids
        except Exception as e:  # whatever a peer sent, it fails its own request only
            self.refused += 1
            log.warning("refused request %s: %s", req.request_id, e)
            self.handoff.move(_key(req), State.ENDED, Cause.ERROR)
            self._tell(channel, Ended(req.request_id, req.seq, f"prefill worker refused the request: {e}"))
            return
        self.handoff.move(_key(req), State.COMPUTING, Cause.STARTED)
        self._slots[req.request_id] = self._free_slots.pop()
        with self._lock:
            # a page the decode side holds in part (its pages smaller than ours) is sent from where its
            # holding ends (_send_layers)
            skip = req.held_tokens // self.spec.page_size
            self.transfers[req.request_id] = _Transfer(req, channel, sent_pages=skip, dead=dead)
        self._tell(channel, Accepted(req.request_id, req.seq))

    def _check_pair(self, req: PrefillRequest, src: int, dst: int, ops, dead: set) -> None:
        """Connect our agent src to the request's decode agent dst and check its writes against both sides'
        regions. A pair that cannot connect (a NIC down) goes into dead where another pair of its ranks can
        carry the writes; else, and for writes outside the regions, TransferError."""
        try:
            peer = self._peer(req, src, dst)
        except TransferError:
            ranks = self.agents.rails[src][0], req.rails[dst][0]
            if ranks[0] < 0 or ranks[1] < 0:  # one agent for every rank on a side: no other way
                raise
            dead.add((src, dst))
            if all(w in dead for w in pairs(self.agents.rails, req.rails, *ranks)):
                raise
            return
        self.agents.backends[src].check(peer, ops)

    def _peer(self, req: PrefillRequest, src: int, dst: int) -> str:
        """The name our agent src knows the request's decode agent dst by, connecting them the first time
        (only pairs the plan uses: an agent on one NIC may reach only the agents on its own rail)."""
        md = req.dst_metadata[dst]
        name = self._peers.get((src, md))
        if name is None:
            name = self._peers[src, md] = self.agents.backends[src].connect(md)
        return name

    def _plan(self, req: PrefillRequest) -> list:
        """Plan the whole request against placeholder source pages (the specs must be compatible, the page
        ids in range): the writes of each (our agent, their agent) pair, each checked once connected to be
        inside the regions both sides registered."""
        n = -(-len(req.prompt_ids) // self.spec.page_size)
        if n > self.spec.num_pages:
            raise ValueError(f"the prompt needs {n} pages; this worker's cache holds {self.spec.num_pages}")
        rows = plan_array(self.spec, req.dst_spec, list(range(n)), req.dst_pages, seed=req.seq)
        every = [(a, b, pairs(self.agents.rails, req.rails, a, b)) for a in range(self.spec.tp)
                 for b in range(req.dst_spec.tp)]  # fmt: skip
        routes = route(rows, self.agents.rails, req.rails)  # every pair a striped post may use, too
        return routes + [(i, j, np.zeros((0, 5), np.int64)) for *_, ways in every for i, j in ways]

    def _context_pair(self, req: PrefillRequest) -> tuple[int, int]:
        """The (our agent, their agent) pair that carries the context write: rank 0's first on one rail."""
        return pairs(self.agents.rails, req.rails, 0, 0)[0]

    def _context_op(self, req: PrefillRequest, slot: int) -> WriteOp:
        """The context write: from a rank-0 agent's context buffer to a decode rank-0 agent's."""
        row = self.context.shape[1] * self.context.element_size()
        far = context_region(req.rails, req.dst_spec.tp)
        return WriteOp(self.agents.context_region, slot * row, far, req.context_slot * row, row)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # ---- sender thread ------------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        busy = False  # posts in flight: look again soon (reaping drives their progress)
        while not self._stop.is_set():
            try:  # idle, the thread sleeps until a job comes: waking a thousand times a second took the
                # GIL and the core from the forward pass beside it (a prefill 20% slower on one core)
                job = self._jobs.get(timeout=self._poll_s() if busy else IDLE_WAIT_S)
            except queue.Empty:
                job = None
            try:
                if job is None:
                    pass
                elif job[0] == "kv":
                    self._send_layers(job[1], job[2])
                else:
                    self._send_context(*job[1:])
                busy = self._reap()
            except Exception as e:  # one bad job fails its own requests, never the thread
                log.exception("sender thread: a job failed")
                for t in self._job_transfers(job):
                    t.error = t.error or f"KV sender failed: {e!r}"

    def _job_transfers(self, job) -> list[_Transfer]:
        if job is None:  # failed while reaping: fail whatever is in flight
            with self._lock:
                return [t for t in self.transfers.values() if t.in_flight]
        return [item[0] for item in job[2]] if job[0] == "kv" else [job[1]]

    def _send_layers(self, target: int, items: list) -> None:
        """Post each layer's writes for every item as soon as counter[0, layer] reaches the pass (send_mode
        layer), or every layer's once the last one has (chunk, request)."""
        by_layer = [[] for _ in range(self.spec.num_layers)]  # [(transfer, ops [n, 5])] per layer
        staged = []  # per item: the pages it posts that the decode side lacks, and the tokens they hold
        for t, i0, i1, pages in items:
            req = t.req
            first, size = max(i0, req.held_tokens // self.spec.page_size), self.spec.page_size
            staged.append((pages[first:i1], min(i1 * size, len(req.prompt_ids)) - first * size))
            rows = plan_array(  # layer-major: each layer's writes are one slice
                self.spec,
                req.dst_spec,
                pages[:i1],
                req.dst_pages,
                start=max(i0 * self.spec.page_size, req.held_tokens),
                end=i1 * self.spec.page_size,
                seed=req.seq,
            )
            for layer, layer_rows in enumerate(np.split(rows, self.spec.num_layers)):
                by_layer[layer].append((t, layer_rows))
        layer, num_layers = 0, self.spec.num_layers
        streamed = self.config.send_mode == "layer"
        seen = None  # when the last layer done was seen (the first wait of a job may include a queue)
        while layer < num_layers:
            deadline = time.monotonic() + self.config.layer_timeout_s
            awaited = layer if streamed else num_layers - 1
            while int(self.counter[0, awaited]) < target:  # the kernel bumps it once the layer is stored
                if time.monotonic() > deadline or self._stop.is_set():
                    for t, _ in by_layer[layer]:
                        with self._lock:
                            if not t.error:
                                t.stop_cause = Cause.DEADLINE
                                t.error = (
                                    f"layer {awaited} not done within layer_timeout_s="
                                    f"{self.config.layer_timeout_s}"
                                )
                    return
                self._reap()  # drives earlier layers' writes and their notifications meanwhile
                time.sleep(self._poll_s())  # never spin: pinned to few cores, it would steal the pass's
            ready = layer + 1  # every layer already done goes in the same post: fewer, larger posts
            while ready < num_layers and int(self.counter[0, ready]) >= target:
                ready += 1
            now = time.perf_counter()
            if seen is not None and streamed:
                self._layer_s = 0.8 * self._layer_s + 0.2 * (now - seen) / (ready - layer)
            seen = now
            for i, (t, _) in enumerate(by_layer[layer]):
                rows = np.concatenate([by_layer[done][i][1] for done in range(layer, ready)])
                if self.stage is not None and len(rows):
                    self.stage(*staged[i], range(layer, ready))
                now = time.perf_counter()
                posts = route(rows, self.agents.rails, t.req.rails, self.rates.weights(), self._usable(t))
                if self._post(t, posts, "kv"):
                    t.first_post = t.first_post or now
                    self.post_log += [(t.req.request_id, done, now) for done in range(layer, ready)]
            layer = ready

    def _poll_s(self) -> float:
        """How long the sender thread waits between looks at the counter and at posts in flight."""
        return min(MAX_POLL_S, max(POLL_S, self._layer_s / POLLS_PER_LAYER))

    def _send_context(self, t: _Transfer, slot: int, done=None) -> None:
        if done is not None:
            done.synchronize()
        src, dst = self._context_pair(t.req)
        usable = self._usable(t)
        if not usable(src, dst):  # its rail is down: another pair of rank 0's agents
            ways = [w for w in pairs(self.agents.rails, t.req.rails, 0, 0) if usable(*w)]
            src, dst = ways[0] if ways else (src, dst)
        t.context_posted = self._post(t, [(src, dst, [self._context_op(t.req, slot)])], "ctx")

    def _post(self, t: _Transfer, posts: list, kind: str) -> bool:
        """Post each (this side's agent, the decode side's agent, ops) with its own notification, unless the
        transfer was aborted or failed (checked under the lock that poll frees under)."""
        with self._lock:
            if t.aborted or t.error:
                return False
            for src, dst, ops in posts:
                for part in parts_of(ops):
                    notif = Notif(kind, t.req.request_id, t.req.seq, t.posts, len(part))
                    try:
                        self._send(t, src, dst, part, notif)
                    except TransferError as e:
                        t.error = str(e)
                        return False
                    t.posts += 1
        return True

    def _send(self, t: _Transfer, src: int, dst: int, ops, notif: Notif) -> None:
        """Post ops from our agent src to the decode agent dst (the caller holds the lock); where that
        pair refuses it (the decode side renewed that agent: it is gone), over another pair of the same
        ranks. TransferError where none takes it."""
        while True:
            try:
                return self._send_on(t, src, dst, ops, notif)
            except TransferError:
                t.dead.add((src, dst))
                way = self._alternative(t, _Post(src, dst, "", None, 0, ops, notif))
                if way is None:
                    raise
                src, dst = way

    def _send_on(self, t: _Transfer, src: int, dst: int, ops, notif: Notif) -> None:
        peer = self._peer(t.req, src, dst)
        handle = self.agents.backends[src].post(peer, ops, notif.encode())
        nbytes = sum(op[4] for op in ops) if isinstance(ops, list) else int(ops[:, 4].sum())
        t.in_flight.append(_Post(src, dst, peer, handle, nbytes, ops, notif))
        self.rates.posted(src, time.perf_counter())

    def _usable(self, t: _Transfer):
        """Whether a pair may carry t's writes now: its rail is up (or due to be tried again) and no post
        of t failed on it."""
        now = time.perf_counter()
        return lambda i, j: self.rails.up(i, now) and (i, j) not in t.dead

    def _ranks(self, t: _Transfer, post: _Post) -> tuple[int, int]:
        """The (source rank, destination rank) a post's writes are of (an agent of every rank: the ops
        name the rank as their region)."""
        ops = as_ops(post.ops)
        src, dst = self.agents.rails[post.src][0], t.req.rails[post.dst][0]
        return (src if src >= 0 else int(ops[0, 0])), (dst if dst >= 0 else int(ops[0, 2]))

    def _alternative(self, t: _Transfer, post: _Post, avoid: int = -1) -> tuple[int, int] | None:
        """Another pair of the post's ranks that may carry it (the fastest rail; none of our agent avoid's),
        or None."""
        usable = self._usable(t)
        ways = [
            w
            for w in pairs(self.agents.rails, t.req.rails, *self._ranks(t, post))
            if w != (post.src, post.dst) and w[0] != avoid and usable(*w)
        ]
        if not ways:
            return None
        rates = self.rates.weights()
        return max(ways, key=lambda w: rates.get(w[0], 0.0))

    def _repost(self, t: _Transfer, post: _Post, stuck: str) -> bool:
        """Send a post again over another rail of its ranks, its notification naming the decode agents
        stuck posts of this number went to (the caller holds the lock). Whether there was one."""
        t.stuck.add(stuck)
        if t.aborted or t.error:
            return True  # nothing more goes for it; its Ended names the stuck agents
        way = self._alternative(t, post)
        if way is None:
            return False
        names = sorted({*post.notif.stuck.split(","), stuck} - {""})
        try:
            self._send(t, *way, post.ops, post.notif._replace(stuck=",".join(names)))
        except TransferError as e:
            t.error = t.error or str(e)
        self.reposted += 1
        return True

    def _check_rails(self) -> None:
        """Take down each rail whose posts have finished nothing for rail_timeout_s past what its
        measured rate needs for the bytes in flight on it, where every post on it can go another way:
        its agent is retired (closed with what it had not sent) and its posts sent again over other
        rails. A rail with no other way is waited for, as one NIC is (TCP retransmits once it is back).
        A retired agent's successor is started once its back-off is over (a NIC still down refuses it:
        it backs off again)."""
        now = time.perf_counter()
        for agent in self.rails.due(now):
            old = self.agents.backends[agent]
            try:
                new = old.renewed()
            except TransferError as e:
                log.warning("%s: its rail is still down (%s)", old.name, e)
                self.rails.take_down(agent, now)
                continue
            with self._lock:
                self.agents.backends[agent] = new
                self.rails.retired.discard(agent)
            log.warning("%s: its rail is back as %s", old.name, new.name)
        with self._lock:
            on = {}  # agent -> [(transfer, post)] in flight on it
            for t in self.transfers.values():
                for post in t.in_flight:
                    on.setdefault(post.src, []).append((t, post))
        for agent, posts in on.items():
            waited = now - self.rates.since[agent]
            rate = self.rates.finished_rate(agent)  # (a rate counting the stretch it is stuck in would
            # fall as fast as the wait grows, and the bytes owed at it never be paid)
            owed = sum(p.nbytes for _, p in posts) / rate if rate else 0.0
            if waited <= self.config.rail_timeout_s + owed:
                continue
            if any(self._alternative(t, p, agent) is None for t, p in posts if not (t.aborted or t.error)):
                continue
            self._fail_over(agent, posts, waited)

    def _fail_over(self, agent: int, posts: list, waited: float) -> None:
        with self._lock:
            for t, post in posts:
                if post in t.in_flight:
                    t.in_flight.remove(post)
            old = self.agents.backends[agent]
            log.warning(
                "%s: no post finished in %.1f s (rail_timeout_s=%s): its %d posts go over other rails",
                old.name, waited, self.config.rail_timeout_s, len(posts),
            )  # fmt: skip
            for _, post in posts:
                try:
                    old.release(post.handle)
                except Exception:  # nixl raises its own types; the agent goes next either way
                    log.debug("%s: releasing a stuck post failed", old.name, exc_info=True)
            try:
                old.retire()
            except Exception:  # (its successor starts afresh either way)
                log.warning("%s: retiring it failed", old.name, exc_info=True)
            self._peers = {k: v for k, v in self._peers.items() if k[0] != agent}
            self.rails.retired.add(agent)
            self.rails.take_down(agent, time.perf_counter())
            self.failovers += 1
            for t, post in posts:
                if not self._repost(t, post, post.peer):
                    t.error = t.error or f"a KV write was stuck on {old.name} and no other rail could take it"

    def _reap(self) -> bool:
        """Poll in-flight posts (this also sends their notifications) and drop finished ones: every post,
        as those on other agents (rails) finish in any order; a failed one goes again over another rail
        of its ranks where there is one (the request fails otherwise), and a rail that stopped moving is
        failed over (`_check_rails`). True while any post is still in flight."""
        with self._lock:
            transfers = [t for t in self.transfers.values() if t.in_flight]
        for t in transfers:
            for post in list(t.in_flight):
                backend = self.agents.backends[post.src]
                try:
                    state = backend.state(post.handle)
                except TransferError:
                    state = "ERR"
                if state == "PROC":
                    continue
                try:
                    backend.release(post.handle)
                except TransferError:
                    pass
                with self._lock:
                    t.in_flight.remove(post)
                    self.rates.finished(post.src, post.nbytes, time.perf_counter())
                    if state == "ERR":
                        t.dead.add((post.src, post.dst))
                        if not self._repost(t, post, post.peer):
                            t.error = t.error or "a KV write failed"
                    else:
                        self.rails.moved(post.src)
                        t.finished.setdefault(post.peer, []).append(post.notif.post)
                    if not t.in_flight and t.context_posted:
                        t.done_at = time.perf_counter()  # the last write (the context) has landed
        if len(self.agents.backends) > 1:
            self._check_rails()
        with self._lock:
            return any(t.in_flight for t in self.transfers.values())
