"""The decode side of the KV messenger: reserve pages, ask a prefill worker, count what lands, release.

`submit` pins pages for the prompt's KV (all but its last token) and sends a PrefillRequest to one of
the prefill workers added with `add_peer`. The leading pages the engine's prefix cache holds already,
or loads from below device memory (its KV tiers, when that is expected to land before a transfer would:
`token_s`), are not asked for (`skip_pages`); where what is left is short (`local_max_tokens`) the
engine computes it itself and no request is sent. Every post from the prefill side ends with a notification
that says how many writes it carried; the request is handed to the decode scheduler only when the
count reaches what the plan says plus the context write.

A request that fails (abort, a stage deadline, an error reported by the prefill side, a silent peer)
ends at once with an error, or with `on_transfer_failure: recompute` is prefilled locally instead. Its
pages stay pinned until nothing can still land in them: the prefill side's Ended says so, or its
process is known to be gone. A peer that is only silent (hung, or cut off on another host: not known
dead) keeps its requests' pages quarantined until it either answers or dies, so a late write can never
land in another request's page; they are set aside under a name of their own (`fenced`), so the failed
requests can be sent again, to another prefill worker, meanwhile.

Messages count only from the peer that owns the request: Accepted and Ended from its control channel,
write notifications from its transfer agents (one per TP rank, named in its Hello) to the agents the
request named, each post's notification once. Anything else is dropped and counted in `dropped`; what
counted, by sending agent, in `writes_from`. This side's ranks have an agent each too
(transfer/agents.py): a PrefillRequest carries every one's metadata.

A worker of DP groups (data-parallel attention, engine/dp.py) holds each request's KV in one group: each
group is a destination of its own (`add_group`: its engine, its NIXL agent over its own KV regions and
NIC, its context buffer), and `submit` names the group. The prefill side sees one more decode agent: the
request's PrefillRequest carries the group's shard spec and agent, so the plan between the prefill
ranks and the group's ranks is the one between two TP workers. The control channels stay one per
prefill worker, here.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from transfer.agents import RankAgents
from transfer.backends import Backend, TransferError
from transfer.config import TransferConfig
from transfer.handoff import DECODE_MOVES, Cause, DecodeState, Handoff
from transfer.plan import ShardSpec, check_compatible, plan_array, unit_tokens
from transfer.protocol import PROTOCOL_VERSION, Abort, Accepted, Ended, Hello, Notif, Posted, PrefillRequest

log = logging.getLogger(__name__)
State = DecodeState
IN_FLIGHT = (State.REQUESTED, State.ACCEPTED, State.LANDING)  # sent, and nothing has failed
# a prompt token's time from request to landed KV until a peer's first transfer is measured (seconds)
PRIOR_TOKEN_S = 0.001
RETRY_AGENT_S = 1.0  # a renewed agent whose NIC refused its successor tries again after this


def _fenced(request_id: str, seq: int) -> tuple[str, str, int]:
    """Who holds a fenced transfer's pages in the engine: a key no request id can be."""
    return ("fenced", request_id, seq)


class NoFreeSlot(Exception):
    """Every context slot of the group waits for a transfer to land: submit again once one has."""


class DecodeEngine(Protocol):
    # pinned pages for prompt[:-1], and how many of its leading tokens those pages hold already or load
    # from below device memory (a whole number of pages: its prefix cache, its KV tiers, which may take
    # about load_within_s, the transfer's expected time); params: the engine's own (sampling) parameters
    def reserve(
        self, request_id: str, prompt_ids: list[int], params: object, load_within_s: float = 0.0
    ) -> tuple[list[int], int]: ...

    def admit(
        self, request_id: str, context: Tensor | None
    ) -> None: ...  # every write landed: start decoding; context: the last prefilled hidden state

    def fail(self, request_id: str, error: str) -> None: ...  # end the request with an error (pages stay)

    def free(self, request_id: str) -> None: ...  # unpin and free its pages

    # a failed request's pages, which its transfer may still write, held under owner (free(owner) frees
    # them) while request_id is free to be sent again
    def set_aside(self, request_id: str, owner: str) -> None: ...

    def recompute(self, request_id: str) -> None: ...  # its pages are safe again: prefill it here


@dataclass
class _Peer:
    name: str
    channel: object  # transfer.protocol.Endpoint or transfer.channel.ZmqEndpoint
    hello: Hello
    lost: bool = False  # silent past peer_timeout_s (until it talks again), or dead: its requests failed
    dead: bool = False  # its process exited (peer_dead): lost until a new process of it says Hello
    worker: str = ""  # the prefill worker it belongs to (itself, or a worker of DP groups: one peer each)

    def down(self) -> bool:
        """Lost, or its process gone (when it runs on this host, which can tell)."""
        return self.lost or self.hello.peer_alive() is False


@dataclass
class Timing:
    """When each stage of a transfer happened (time.perf_counter: one clock for every process here)."""

    sent: float
    peer: str = ""  # the prefill worker
    accepted: float | None = None
    first_landed: float | None = None
    landed: float | None = None  # the last write counted: the request is released to the scheduler
    writes: int = 0
    nbytes: int = 0


@dataclass
class _Group:
    """One destination of this worker's KV: a DP group's engine, agents, geometry and context buffer."""

    engine: DecodeEngine
    backends: list[Backend]  # one agent per TP rank (or per rank and NIC), or one for all (transfer.agents)
    spec: ShardSpec
    context: Tensor  # [context_slots, hidden]: each in-flight request's last prefilled hidden state
    metadata: list[bytes]  # the agents', in every PrefillRequest to this group
    free_slots: list[int]
    regions: list[Tensor]  # each TP rank's KV region (mapped here): its cache, or e4m3 pages and scales
    rails: list[tuple[int, str]] = field(default_factory=list)  # (rank, NIC) of each agent
    retired: dict[int, float] = field(default_factory=dict)  # agent -> when its successor is tried again

    def offered(self) -> tuple[list[bytes], list[tuple[int, str]]]:
        """The agents a PrefillRequest offers (metadata, rails): every one but those retired, while each
        rank keeps one."""
        live = [i for i in range(len(self.backends)) if i not in self.retired]
        if {self.rails[i][0] for i in live} != {r for r, _ in self.rails}:
            live = list(range(len(self.backends)))
        return [self.metadata[i] for i in live], [self.rails[i] for i in live]

    @property
    def backend(self) -> Backend:
        """Rank 0's agent (the context buffer's)."""
        return self.backends[0]


@dataclass
class _Pending:
    seq: int  # this request's number (transfer.protocol.PrefillRequest.seq)
    peer: _Peer
    slot: int
    sent_at: float  # time.monotonic, for deadlines
    prompt_tokens: int
    timing: Timing
    accepted_at: float | None = None
    received: int = 0
    posts: set[int] = field(default_factory=set)  # post numbers counted (a duplicate counts once)
    error: str | None = None  # why it failed (State.FAILED): its pages wait for Ended or the peer's death
    group: int = 0  # the DP group whose pages it fills
    pages: list[int] = field(default_factory=list)  # the pages it writes (its prefix cache's skipped)
    posted: dict[str, list[int]] | None = None  # the peer's Posted: decode agent -> its posts' numbers
    moved_at: float = 0.0  # time.monotonic of its Posted or its last write since, whichever came last

    @property
    def expected(self) -> int:
        """Writes to count before release: the plan's and the context write."""
        return self.timing.writes


def page_bytes(region: Tensor, spec: ShardSpec) -> Tensor:
    """A rank's pages in its region (the KV cache, or an e4m3 cache's pages and scales) as bytes,
    [layers, pages, planes, H, P, row] in HND or [..., P, H, row] in NHD, the spec's layout."""
    a, b = (spec.heads_per_rank, spec.page_size)[:: 1 if spec.kv_layout == "HND" else -1]
    pages = region.reshape(-1).view(torch.uint8)[: spec.kv_bytes]
    return pages.view(spec.num_layers, spec.num_pages, spec.planes, a, b, spec.head_dim * spec.itemsize)


def relayout(regions: list[Tensor], pages: list[int]) -> None:
    """Turn pages that hold KV in the other layout (a plane's [H, P] read as [P, H], or the reverse) into
    the one each rank's cache has, in place: a layer at a time, gathered, transposed and scattered back
    through two buffers of a layer's pages (fresh tensors of a whole request's pages cost more in page
    faults than the copies: 100 ms against 23 for 2,048 tokens of SmolLM2 in fp32)."""
    if not pages:
        return
    index = torch.as_tensor(pages, device=regions[0].device)
    for cache in regions:
        _, _, planes, a, b, d = cache.shape
        if a == 1 or b == 1:  # one head (a latent row) or one token a page: both layouts are the same bytes
            continue
        landed = torch.empty((len(pages), planes, a, b, d), dtype=cache.dtype, device=cache.device)
        own = torch.empty_like(landed)
        for layer in cache:
            torch.index_select(layer, 0, index, out=landed)
            own.copy_(landed.view(len(pages), planes, b, a, d).transpose(2, 3))
            layer.index_copy_(0, index, own)


class DecodeMessenger:
    def __init__(
        self,
        engine: DecodeEngine,
        backend: Backend | list[Backend],  # one agent per TP rank, or one for every rank
        spec: ShardSpec,
        kv_regions: list[Tensor],
        hidden_size: int,
        config: TransferConfig | None = None,
    ):
        self.config = config or TransferConfig()
        self.hidden_size = hidden_size
        self.groups: list[_Group] = []
        self.add_group(engine, backend, spec, kv_regions)
        g = self.groups[0]  # the one group of a worker without DP: its parts by their names
        self.engine, self.backend, self.spec, self.context = g.engine, g.backend, g.spec, g.context
        self._metadata, self._free_slots = g.metadata, g.free_slots
        self.peers: dict[str, _Peer] = {}
        self.retired: set[str] = set()  # peers that left the prefill role (retire)
        # every request of this side's by state (transfer/handoff.py): keyed by request id (a _Pending
        # each once sent), a fenced one by _fenced(request id, seq), its id free to be sent again
        self.handoff: Handoff[DecodeState] = Handoff("decode", DECODE_MOVES)
        # transfer timing of each admitted request, until `forget` (its context goes to the engine)
        self.timings: dict[str, Timing] = {}
        # requests that failed because their prefill worker died or went silent (nothing of theirs is
        # wrong: the caller may send them again); kept until forget()
        self.peer_lost: set[str] = set()
        self.dropped: Counter[str] = Counter()  # messages not counted, by why
        self.writes_from: Counter[str] = Counter()  # writes counted, by the prefill agent that sent them
        self.renewed = 0  # agents renewed because a post to them was stuck (transfer/prefill.py)
        # per peer, a prompt token's seconds from request to landed KV (moving average): what a page the
        # engine could load from below instead would cost to be sent
        self.token_s: dict[str, float] = {}
        # request numbers keep growing across restarts of this worker: a prefill worker drops stale ones
        self._seqs = itertools.count(time.time_ns())
        self.clock = time.monotonic  # for deadlines (tests drive their own)

    def add_group(
        self,
        engine: DecodeEngine,
        backend: Backend | list[Backend],
        spec: ShardSpec,
        kv_regions: list[Tensor],
    ) -> int:
        """Another destination (a DP group): its engine side, its own agents (one per TP rank, or one) over
        its KV regions, and a context buffer registered with rank 0's. Returns its number for submit's
        group."""
        context = torch.zeros(
            self.config.context_slots, self.hidden_size, dtype=torch.float32, device=kv_regions[0].device
        )
        agents = RankAgents(backend, kv_regions, context)  # the context buffer: written by prefill
        free = list(range(self.config.context_slots))
        self.groups.append(
            _Group(engine, agents.backends, spec, context, agents.metadata(), free, kv_regions, agents.rails)
        )
        return len(self.groups) - 1

    @property
    def pending(self) -> dict[str, _Pending]:
        """Requests sent and not yet released or safe to free (in flight, or failed: pages pinned)."""
        return dict(self.handoff.items(*IN_FLIGHT, State.FAILED))

    @property
    def fenced(self) -> dict[tuple[str, int], _Pending]:
        """Failed transfers from a peer that went silent but may be alive (cut off: on another host, or
        hung), by (request id, seq): their pages are set aside until it sends Ended or is known gone,
        since a write it posted may still land; the request id is free to be sent again."""
        return {key[1:]: p for key, p in self.handoff.items(State.FENCED)}

    def wait(self, request_id: str) -> None:
        """The request waits for pages (the decode worker's backlog, serving/decode_front.py) to be sent.
        Raises ValueError for an id this side still holds (its failed transfer's pages not yet safe)."""
        if request_id in self.handoff:
            raise ValueError(f"request {request_id!r} is still {self.handoff.state(request_id)} here")
        self.handoff.move(request_id, State.WAITING, Cause.SUBMITTED)

    def leave(self, request_id: str, cause: Cause) -> None:
        """A waiting request goes before anything was sent (cancelled, refused, handed back)."""
        if self.handoff.state(request_id) is State.WAITING:
            self.handoff.move(request_id, State.FREED, cause)

    @property
    def backends(self) -> list[Backend]:
        """Every group's agents (the caller closes them)."""
        return [b for g in self.groups for b in g.backends]

    def add_peer(self, name: str, channel, hello: Hello, worker: str | None = None) -> None:
        """A prefill worker reachable over channel, whose Hello (shard spec, host, pid) arrived. worker: the
        prefill worker this peer is a DP group of (None: itself); a router's choice of worker (submit's
        prefer) takes the least loaded of its groups. A peer whose KV would not mean the same here (another
        model, weights or tokenizer; another page size, dtype or layout) is refused now, a ValueError
        naming the field and both values, before any transfer."""
        try:
            check_compatible(hello.spec, self.spec)
        except ValueError as e:
            raise ValueError(f"prefill worker {name} cannot send its KV to this decode worker: {e}") from e
        self.peers[name] = _Peer(name, channel, hello, worker=worker or name)

    def retire(self, name: str) -> None:
        """The peer leaves the prefill role (an elastic worker): it is asked nothing new (what it holds
        still lands) until its next Hello on the same channel brings it back."""
        self.retired.add(name)

    def holds(self, name: str) -> bool:
        """Whether a transfer of this worker's is still in flight on peer `name`."""
        held = self.handoff.items(*IN_FLIGHT, State.FAILED, State.FENCED)
        return any(p.peer.name == name for _, p in held)

    def outstanding_tokens(self, peer: str) -> int:
        """Prompt tokens sent to peer and not yet landed (the router's load figure)."""
        return sum(p.prompt_tokens for _, p in self.handoff.items(*IN_FLIGHT) if p.peer.name == peer)

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: object = None,
        peer: str | None = None,
        local_max_tokens: int = 0,
        prefer: str | None = None,
        cache_salt: str = "",
        group: int = 0,
        client: tuple[str, ...] = (),
    ) -> bool:
        """Reserve pages and ask a prefill worker (peer if named; else prefer, the router's choice, while
        it is live: the least loaded of its DP groups; else the least loaded live one) for prompt_ids[:-1],
        past the pages the engine holds already; when the tokens the engine would still have to compute
        (those missing and the last) are at most local_max_tokens, or only the last, it computes them itself
        instead. cache_salt: the request's, for the prefill side's prefix cache; client: who it is for (the
        prefill side's fair share). group: the DP group whose
        engine takes it (add_group's number). Returns whether a prefill worker was asked.

        Raises what engine.reserve raises (out of pages, a bad request) with nothing taken, and NoFreeSlot
        while every context slot (transfer.context_slots) waits for a transfer to land: the caller keeps
        the request and submits it again later (at 256 streams, 378 of 512 requests failed on it instead)."""
        for name, p in self.peers.items():  # a process gone (seen from this host) but not yet silent:
            if not p.lost and p.down():  # nothing more lands from it, and it takes nothing new
                self.peer_dead(name)
        if peer is None:
            serving = [n for n in self.peers if n not in self.retired] or list(self.peers)
            live = [n for n in serving if not self.peers[n].lost] or serving
            preferred = [n for n in live if self.peers[n].worker == prefer] or live  # its DP groups
            peer = min(preferred, key=self.outstanding_tokens)
        if isinstance(group, bool) or not (isinstance(group, int) and 0 <= group < len(self.groups)):
            raise ValueError(
                f"group must be a DP group of this worker, in [0, {len(self.groups)}), got {group!r}"
            )
        if self.handoff.state(request_id) not in (None, State.WAITING):
            raise ValueError(f"request {request_id!r} is already {self.handoff.state(request_id)} here")
        target, g = self.peers[peer], self.groups[group]
        if len(prompt_ids) > 1 and not g.free_slots:  # every slot waits for a transfer: so does this one
            raise NoFreeSlot(f"{request_id}: all {self.config.context_slots} context slots are in use")
        if len(prompt_ids) > 1:  # check before anything is taken: a plan that raises leaves nothing behind
            # counts do not depend on which pages are used: plan against placeholder ids; the specs and
            # the highest id are what can fail, so the check plans the last page only
            src, n = target.hello.spec, len(prompt_ids) - 1
            ours, theirs = list(range(-(-n // g.spec.page_size))), list(range(-(-n // src.page_size)))
            last = (len(ours) - 1) * g.spec.page_size
            plan_array(src, g.spec, theirs, ours, start=last - last % unit_tokens(src, g.spec))
        expected_s = self.token_s.get(peer, PRIOR_TOKEN_S) * (len(prompt_ids) - 1)
        pages, cached = g.engine.reserve(request_id, prompt_ids, params, load_within_s=expected_s)
        missing = len(prompt_ids) - 1 - cached  # KV a prefill worker would write
        if missing <= 0:  # one token, or the engine holds all of it already: decode from the last token on
            self.handoff.move(request_id, State.DECODING, Cause.CACHED)
            g.engine.admit(request_id, None)
            return False
        if missing + 1 <= local_max_tokens:  # with the last token, always computed here
            self.handoff.move(request_id, State.RECOMPUTING, Cause.SHORT)
            g.engine.recompute(request_id)  # what is missing is short: computed here, no round trip
            return False
        if target.lost:  # nothing was sent: the pages are safe at once
            self.peer_lost.add(request_id)
            if self.config.on_transfer_failure == "fail":
                self.handoff.move(request_id, State.FREED, Cause.NO_PEER)
                g.engine.fail(request_id, f"no live prefill worker ({peer} is lost)")
                g.engine.free(request_id)
            else:
                self.handoff.move(request_id, State.RECOMPUTING, Cause.NO_PEER)
                g.engine.recompute(request_id)
            return False
        seq, skip = next(self._seqs), cached // g.spec.page_size
        writes = plan_array(src, g.spec, theirs, ours, start=skip * g.spec.page_size)
        nbytes = int(writes[:, 5].sum()) + g.context[0].numel() * g.context.element_size()
        slot = g.free_slots.pop()
        timing = Timing(time.perf_counter(), peer, writes=len(writes) + 1, nbytes=nbytes)
        pending = _Pending(
            seq, target, slot, self.clock(), len(prompt_ids) - 1, timing, group=group, pages=pages[skip:]
        )
        self.handoff.move(request_id, State.REQUESTED, Cause.SENT, pending)
        metadata, rails = g.offered()
        request = PrefillRequest(
            request_id, list(prompt_ids[:-1]), pages, g.spec, metadata, slot, seq, skip, cache_salt,
            list(client), rails,
        )  # fmt: skip
        try:
            target.channel.send(request)
        except TimeoutError as e:  # nothing was sent: nothing can land, the pages are safe at once
            reason = f"could not reach prefill worker {peer}: {e}"
            self._fail(request_id, pending, reason, Cause.UNREACHABLE, notify=False)
            self._pages_safe(request_id, Cause.UNREACHABLE)
        return True

    def abort(self, request_id: str, reason: str = "aborted by the decode worker", cancelled_at: float = 0.0):
        """Stop a request whose KV is on its way (cancelled_at: when its client went away, time.time(),
        for the prefill side's count of work done for nobody); its pages free once nothing can land."""
        if (p := self.handoff.record(request_id, *IN_FLIGHT)) is not None:
            cause = Cause.CANCELLED if cancelled_at else Cause.ABORTED
            self._fail(request_id, p, reason, cause, cancelled_at=cancelled_at)

    def poll(self) -> list[str]:
        """Count landed writes, handle control messages and deadlines; returns the ids admitted now."""
        for group, g in enumerate(self.groups):
            now = self.clock()
            for index in [i for i, at in g.retired.items() if at <= now]:
                self._start_successor(g, index)
            for index, backend in enumerate(g.backends):
                if index in g.retired:
                    continue
                for agent, msg in backend.notifications():
                    self._count(agent, msg, group)
        for peer in self.peers.values():
            for msg in peer.channel.receive():
                if isinstance(msg, Hello):  # the peer was restarted and handshakes again
                    self._rejoin(peer, msg)
                    continue
                rid = msg.request_id
                state = self.handoff.state(rid)
                p = self.handoff.record(rid, *IN_FLIGHT, State.FAILED)
                if isinstance(msg, Posted) and (p is None or p.peer is not peer or p.seq != msg.seq):
                    continue  # its writes all landed first (as they mostly do), or it ended: nothing to do
                fenced_key = _fenced(rid, msg.seq)
                fenced = self.handoff.record(fenced_key, State.FENCED)
                if isinstance(msg, Ended) and msg.stuck and (mine := p or fenced) and mine.peer is peer:
                    self._renew(mine.group, msg.stuck, peer)  # before its pages are safe
                if isinstance(msg, Ended) and fenced is not None and fenced.peer is peer:
                    self._unfence(fenced_key, Cause.SETTLED)  # back, and done writing its pages
                elif p is None or p.peer is not peer or p.seq != msg.seq:
                    self.dropped["control message for a request the peer does not own"] += 1
                elif isinstance(msg, Accepted):
                    p.accepted_at, p.timing.accepted = self.clock(), time.perf_counter()
                    if state is State.REQUESTED:  # (its first write may have come first: LANDING)
                        self.handoff.move(rid, State.ACCEPTED, Cause.ACCEPTED)
                elif isinstance(msg, Posted):
                    if state is not State.FAILED:
                        p.posted, p.moved_at = msg.posts, self.clock()
                else:
                    if state is not State.FAILED:  # the prefill side failed it
                        self._fail(
                            rid, p, msg.error or "prefill ended the request", Cause.ERROR, notify=False
                        )
                    self._pages_safe(rid, Cause.SETTLED)
            self._check_peer(peer)
        admitted, now = [], self.clock()
        for rid, p in self.handoff.items(*IN_FLIGHT):
            if self.handoff.state(rid) not in IN_FLIGHT:  # failed as this loop renewed an agent
                continue
            if p.received == p.expected:
                self.handoff.move(rid, State.DECODING, Cause.LANDED)
                g = self.groups[p.group]
                if p.peer.hello.spec.kv_layout != g.spec.kv_layout:  # landed in the sender's layout
                    relayout([page_bytes(region, g.spec) for region in g.regions], p.pages)
                context = g.context[p.slot].clone()
                g.free_slots.append(p.slot)
                p.timing.landed = time.perf_counter()
                took = (p.timing.landed - p.timing.sent) / max(p.prompt_tokens, 1)
                was = self.token_s.get(p.peer.name)
                self.token_s[p.peer.name] = took if was is None else 0.8 * was + 0.2 * took
                earlier = self.timings.get(rid)
                if earlier is None:
                    self.timings[rid] = p.timing
                else:  # its KV fetched again (a preempted request): one record, the bytes of both
                    earlier.nbytes += p.timing.nbytes
                g.engine.admit(rid, context)
                admitted.append(rid)
            elif reason := self._late(p, now):
                self._fail(rid, p, f"{reason} ({p.received}/{p.expected} writes landed)", Cause.DEADLINE)
            elif p.posted is not None and now - p.moved_at > self.config.rail_timeout_s:
                lost = sorted(agent for agent, posts in p.posted.items() if not p.posts.issuperset(posts))
                p.posted = None  # looked at once: the renewal sends the request again
                if lost and self.handoff.state(rid) in IN_FLIGHT:
                    log.warning("writes of %s sent to %s never landed: renewing them", rid, lost)
                    self._renew(p.group, lost, p.peer)
        return admitted

    def _count(self, agent: str, msg: bytes, group: int = 0) -> None:
        """Count a post's writes: only from the owning peer's agents to the request's group's agents, each
        post once, never past the plan."""
        try:
            _, rid, seq, post, writes, stuck = Notif.parse(msg)
        except ValueError:
            self.dropped["malformed notification"] += 1
            return
        p = self.handoff.record(rid, *IN_FLIGHT)
        if p is None or p.seq != seq:
            self.dropped["notification for no live transfer"] += 1
        elif agent.partition("~")[0] not in p.peer.hello.agents:  # (~n: an agent it renewed)
            self.dropped["notification from an agent that does not own the request"] += 1
        elif group != p.group:
            self.dropped["notification to another DP group's agent"] += 1
        elif stuck and not self._renew(p.group, stuck.split(","), p.peer):
            self.dropped["notification naming more stuck agents than it may"] += 1
        elif self.handoff.record(rid, *IN_FLIGHT) is not p:  # (the renewal sent it again)
            self.dropped["notification for a request sent again"] += 1
        elif post in p.posts or p.received + writes > p.expected:
            self.dropped["duplicate or excess notification"] += 1
        else:
            p.posts.add(post)
            p.received += writes
            p.moved_at = self.clock()
            self.writes_from[agent] += writes
            p.timing.first_landed = p.timing.first_landed or time.perf_counter()
            if self.handoff.state(rid) is not State.LANDING:
                self.handoff.move(rid, State.LANDING, Cause.WRITE)

    def _renew(self, group: int, names: list[str], peer: _Peer) -> bool:
        """Renew those of the group's agents named (a stuck post went to them, and its writes may still
        be in the network's buffers): each retired, its connections closed so that nothing more lands
        through it, and a successor started in its place (now, or once its NIC is up again), whose
        metadata the next requests carry. Notifications the old one had received are counted first.
        Then the peer's requests still landing in the group are sent again (`_resend`): over TCP a post
        counts as done once the kernel holds it, so posts the peer saw finish on that rail may never
        land. False for a list longer than the group's agents."""
        g = self.groups[group]
        if len(names) > len(g.backends):
            return False
        renewed = self.renewed
        for name in names:
            index = next((i for i, b in enumerate(g.backends) if b.name == name), None)
            if index is None or index in g.retired:  # renewed already, or not ours
                continue
            old = g.backends[index]
            received = old.notifications()
            old.retire()
            g.retired[index] = self.clock()
            self.renewed += 1
            self._start_successor(g, index)
            for agent, msg in received:
                self._count(agent, msg, group)
        if self.renewed > renewed:
            self._resend(group, peer)
        return True

    def _resend(self, group: int, peer: _Peer) -> None:
        """The peer's requests whose KV is still landing in the group fail as lost (`peer_lost`: the
        runtime sends them again, their prompt prefilled anew) and, where they end, their pages are set
        aside until the peer's Ended says nothing more of theirs can land (their ids free meanwhile)."""
        reason = f"a NIC of prefill worker {peer.name}'s transfer went down: sent again"
        g = self.groups[group]
        for rid, p in list(self.handoff.items(*IN_FLIGHT)):
            if p.group != group or p.peer is not peer:
                continue
            self.peer_lost.add(rid)
            self._fail(rid, p, reason, Cause.RAIL_LOST)
            if self.config.on_transfer_failure == "fail":
                g.engine.set_aside(rid, _fenced(rid, p.seq))
                self.handoff.move(rid, State.FENCED, Cause.RAIL_LOST, rename=_fenced(rid, p.seq))

    def _start_successor(self, g: _Group, index: int) -> None:
        """Start a retired agent's successor; where its NIC refuses (down), try again in a second."""
        old = g.backends[index]
        try:
            new = old.renewed()
        except TransferError as e:
            g.retired[index] = self.clock() + RETRY_AGENT_S
            log.warning("transfer agent %s: no successor yet (%s)", old.name, e)
            return
        g.backends[index], g.metadata[index] = new, new.metadata()
        del g.retired[index]
        log.warning("renewed transfer agent %s as %s (a post to it was stuck)", old.name, new.name)

    def forget(self, request_id: str) -> None:
        """Drop what was kept of an admitted request (its transfer timing) once its caller is done."""
        self.timings.pop(request_id, None)
        self.peer_lost.discard(request_id)

    def _late(self, p: _Pending, now: float) -> str | None:
        c = self.config
        if p.accepted_at is None and now > p.sent_at + c.handshake_timeout_s:
            return f"{p.peer.name} did not accept within handshake_timeout_s={c.handshake_timeout_s}"
        if p.accepted_at is not None and not p.received and now > p.accepted_at + c.first_layer_timeout_s:
            return f"no KV landed within first_layer_timeout_s={c.first_layer_timeout_s}"
        if now > p.sent_at + c.completion_timeout_s:
            return f"transfer not complete within completion_timeout_s={c.completion_timeout_s}"
        return None

    def _check_peer(self, peer: _Peer) -> None:
        """A silent peer fails its requests; once its process is known gone their pages are safe. Until
        then (alive, or on another host: cut off, hung) the failed ones' pages are set aside, so that the
        requests can be sent again (to another prefill worker) while a write it posted may still land."""
        mine = [rid for rid, p in self.handoff.items(*IN_FLIGHT, State.FAILED) if p.peer is peer]
        silent = peer.channel.peer_silent_for() > self.config.peer_timeout_s
        if not silent and not peer.dead:  # it talks (again): it takes requests
            peer.lost = False
        if not mine and not self.handoff.keys(State.FENCED):
            return
        if silent and not peer.lost and mine:
            peer.lost = True
            reason = f"prefill worker {peer.name} silent for over peer_timeout_s={self.config.peer_timeout_s}"
            for rid in mine:
                if self.handoff.state(rid) is not State.FAILED:
                    self.peer_lost.add(rid)
                    self._fail(rid, self.handoff.records[rid], reason, Cause.PEER_SILENT)
        if peer.lost and peer.hello.peer_alive() is False:
            for rid in mine:
                if self.handoff.state(rid) is not State.FAILED:  # sent since it was lost: none land
                    self._fail(rid, self.handoff.records[rid], f"prefill worker {peer.name} exited",
                               Cause.PEER_EXITED, notify=False)  # fmt: skip
                self._pages_safe(rid, Cause.PEER_EXITED)
            self._unfence_peer(peer)
        elif peer.lost and self.config.on_transfer_failure == "fail":
            fence = [rid for rid in mine if self.handoff.state(rid) is State.FAILED]
            for rid in fence:
                p = self.handoff.records[rid]
                self.groups[p.group].engine.set_aside(rid, _fenced(rid, p.seq))
                self.handoff.move(rid, State.FENCED, Cause.PEER_SILENT, rename=_fenced(rid, p.seq))
            if fence:
                log.warning(
                    "prefill worker %s is silent and may still write: %d failed requests' pages set aside "
                    "until it ends them or is gone (their ids are free to be sent again)",
                    peer.name,
                    len(fence),
                )

    def _unfence(self, key: tuple[str, str, int], cause: Cause) -> None:
        p = self.handoff.records[key]
        self.handoff.move(key, State.FREED, cause)
        g = self.groups[p.group]
        g.free_slots.append(p.slot)
        g.engine.free(key)

    def _unfence_peer(self, peer: _Peer) -> None:
        """The peer's process is gone: nothing of its can land any more."""
        for key in [k for k, p in self.handoff.items(State.FENCED) if p.peer is peer]:
            self._unfence(key, Cause.PEER_EXITED)

    def _rejoin(self, peer: _Peer, hello: Hello) -> None:
        """A new Hello on a peer's channel: a new process of that worker (same keys). The old one is
        gone, so its requests fail and their pages are safe; the peer takes requests again."""
        if hello.version != PROTOCOL_VERSION:
            self.dropped["Hello of another protocol version"] += 1
            return
        if any(p.peer is peer for _, p in self.handoff.items(*IN_FLIGHT, State.FAILED)):
            self.peer_dead(peer.name)
        self._unfence_peer(peer)
        try:
            check_compatible(hello.spec, self.spec)
        except ValueError as e:  # a new process of it that does not fit: it is asked nothing
            self.dropped["Hello of a peer that does not fit"] += 1
            log.error("prefill worker %s came back unable to send its KV here: %s", peer.name, e)
            peer.lost = peer.dead = True
            return
        peer.hello, peer.lost, peer.dead = hello, False, False
        self.retired.discard(peer.name)  # an elastic worker back in the prefill role

    def peer_dead(self, name: str) -> None:
        """Whoever started the peer knows it has exited: nothing more can land from it."""
        peer = self.peers[name]
        peer.lost = peer.dead = True
        self._unfence_peer(peer)
        for rid, p in self.handoff.items(*IN_FLIGHT, State.FAILED):
            if p.peer is peer:
                if self.handoff.state(rid) is not State.FAILED:
                    self.peer_lost.add(rid)
                    self._fail(rid, p, f"prefill worker {name} exited", Cause.PEER_EXITED, notify=False)
                self._pages_safe(rid, Cause.PEER_EXITED)

    def _fail(
        self,
        request_id: str,
        p: _Pending,
        reason: str,
        cause: Cause,
        notify: bool = True,
        cancelled_at: float = 0.0,
    ) -> None:
        """End the request (or mark it for local recompute); its pages stay until they are safe."""
        p.error = reason
        self.handoff.move(request_id, State.FAILED, cause)
        if self.config.on_transfer_failure == "fail":
            self.groups[p.group].engine.fail(request_id, reason)
        if notify:
            try:  # a hung peer may never read it; its silence is handled by _check_peer
                p.peer.channel.send(Abort(request_id, p.seq, reason, cancelled_at), timeout_s=0.1)
            except TimeoutError:
                pass

    def _pages_safe(self, request_id: str, cause: Cause) -> None:
        """Nothing can land in a failed request's pages any more: free them, or prefill it here."""
        p = self.handoff.records[request_id]
        g = self.groups[p.group]
        g.free_slots.append(p.slot)
        if self.config.on_transfer_failure == "recompute":
            self.handoff.move(request_id, State.RECOMPUTING, cause)
            g.engine.recompute(request_id)
        else:
            self.handoff.move(request_id, State.FREED, cause)
            g.engine.free(request_id)
