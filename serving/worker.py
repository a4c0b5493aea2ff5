"""One serving worker process (colocated, prefill or decode), started by serving.fleet.fleet and
driven by the main job's driver or the HTTP server's runtime.

Each worker talks to the runtime over a pyzmq DEALER socket (its name as identity, its CURVE key as
proof: transfer.auth), in the typed messages of serving.messages. It says Listening once its engine
is up (a decode worker with the control addresses it bound, one authenticated PAIR socket per prefill
worker), then Ready once every messenger peer is connected (a prefill worker connects to the addresses
the runtime forwards in Connect and announces itself with a Hello). It takes Submit, Cancel and
PeerDead, sends Progress after each step for requests submitted with stream=True, answers each request
with a Result (a bad or cancelled request too), and sends its per-step timeline on Stop. A worker exits
when told to, or when its parent (the runtime's process) is gone.
"""

from __future__ import annotations

import logging
import math
import os
import time
import traceback
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.role import Role
from serving.config import DeploymentConfig, KernelsConfig, worker_of
from serving.decode_front import DecodeFront
from serving.messages import (
    LOAD_EVERY_S,
    Cancel,
    Connect,
    ErrorKind,
    Failed,
    HandedBack,
    Listening,
    Load,
    PeerDead,
    PeerLeaving,
    Progress,
    Ready,
    Result,
    Stop,
    Submit,
    SwitchRole,
    TierCounters,
    Timeline,
    worker_codec,
)
from serving.roles import RoleSwitch
from transfer.auth import Credentials
from transfer.config import TransferConfig
from transfer.handoff import Cause, handoff_stats
from transfer.wire import MAX_MESSAGE_BYTES, WireError

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 300.0  # a decode worker waits this long for each prefill worker's Hello


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    engine: EngineConfig  # what its engine is built from (serving.config.engine_config), its role's
    deployment: DeploymentConfig
    transfer: TransferConfig
    kernels: KernelsConfig
    driver_address: str
    creds: Credentials  # this worker's keys and the deployment's directory
    run_dir: str  # private (0700) directory for its ipc:// sockets
    peers: tuple[str, ...] = ()  # the messenger's peer workers
    cores: tuple[int, ...] = ()  # CPU affinity (empty: leave as is)
    log_file: str | None = None  # this worker's log (the run folder's logs/<name>.log)
    log_level: str = "INFO"
    restart_wait_s: float = 0.0  # decode: how long requests wait for a dead prefill worker that the
    # launcher may restart (ray.max_restarts), when no other prefill worker is up
    # decode: the peers whose Hello it waits for before it is Ready (None: every one). An elastic
    # deployment's workers are each other's peers; those not prefilling yet join when they Hello
    wait_for: tuple[str, ...] | None = None
    netns: str | None = None  # launcher=netns: the network namespace (host) it runs in
    # prefill: the decode workers' KV dtype (model.kv_dtype), what its KV crosses as (engine.disagg's
    # prefill_messenger: e4m3 from a wider cache, deployment.prefill_kv_dtype, is quantized as it is sent)
    kv_wire_dtype: str = "auto"

    @property
    def role(self) -> Role:
        """The role it starts in (an elastic worker's changes: Worker.role)."""
        return self.engine.scheduler.role

    @property
    def tp(self) -> int:
        return self.engine.tp

    @property
    def dp(self) -> int:  # its DP groups (deployment.dp, prefill_dp or decode_dp)
        return self.engine.dp


def progress_items(outputs, streamed: dict, holdback: dict) -> list[tuple]:
    """(request id, new token ids, new text, their logprobs) of each streamed request that gained tokens,
    its text held back by as many characters as a stop string could still claim (a finished request's
    last tokens go in its Result). streamed: request id -> [tokens sent, characters sent], updated."""
    items = []
    for out in outputs:
        sent = streamed[out.request_id]
        if len(out.token_ids) == sent[0]:
            continue
        upto = max(sent[1], len(out.text) - holdback[out.request_id])
        new = (out.token_ids[sent[0] :], out.text[sent[1] : upto], wire_logprobs(out, sent[0]))
        items.append((out.request_id, *new))
        sent[0], sent[1] = len(out.token_ids), upto
    return items


def result_of(out, spec, received: float, dm, prefilled_here: bool, by_load: bool) -> Result:
    """A finished request's Result: out, the engine's output; received, when the worker got it; dm, the
    decode messenger (None: not a decode worker); prefilled_here: this worker computed its prompt;
    by_load: the router sent it here to prefill (deployment.local_prefill_by_load)."""
    rid = out.request_id
    result = Result(
        rid,
        spec.name,
        out.token_ids,
        received,
        out.scheduled_time,
        out.token_times,
        out.finish_reason,
        out.error,
        text=out.text,
        drafted=out.num_drafted_tokens,
        accepted=out.num_accepted_tokens,
        verify_steps=out.num_verify_steps,
        cached_tokens=out.num_cached_tokens or 0,
        logprobs=wire_logprobs(out, 0) if out.logprobs is not None else None,
    )
    if by_load:
        result.prefill_worker = spec.name
    timing = dm.timings.get(rid) if dm is not None else None
    if timing is not None:
        result.prefill, result.transfer_bytes = "remote", timing.nbytes
        result.transfer_s, result.kv_landed = timing.landed - timing.sent, timing.landed
        result.scheduled = timing.first_landed  # its first KV arriving: prefill has begun
        result.prefill_worker = timing.peer
    elif (
        dm is not None
        and not prefilled_here
        and len(out.prompt_token_ids) > spec.deployment.local_prefill_max_tokens
    ):
        result.prefill = "remote"  # its transfer failed (or it was recomputed here)
    if out.error is not None:
        result.prefill_lost = dm is not None and rid in dm.peer_lost
        result.error_kind = ErrorKind.WORKER_LOST if result.prefill_lost else ErrorKind.INTERNAL
    elif out.finish_reason == "abort":
        result.error_kind = ErrorKind.CANCELLED
    return result


def wire_logprobs(out, start: int) -> list:
    """The logprobs of out's tokens from `start` on, as Result and Progress carry them (a request that
    resumed after tokens made elsewhere has none for those: the runtime keeps them)."""
    if out.logprobs is None:
        return []
    offset = len(out.token_ids) - len(out.logprobs)
    return [
        [(t, lp.logprob, lp.rank) for t, lp in entry.items()]
        for entry in out.logprobs[max(0, start - offset) :]
    ]


def listen_address(spec: WorkerSpec, peer: str, again: str = "") -> str:
    """Where a decode worker's control socket for prefill worker `peer` binds (again: the messenger's
    generation, for an elastic worker). An ipc:// path is this process's own: a restarted worker bound its
    predecessor's, the prefill worker's old socket reconnected to it before the new one did (ZMQ
    reconnects a connecting end by itself), and the PAIR socket, taken, dropped the new socket's Hello:
    the worker waited for it for good."""
    if spec.transfer.control_transport == "ipc":
        return f"ipc://{spec.run_dir}/{spec.name}-{os.getpid()}-{peer}{again}"
    return f"tcp://{spec.transfer.control_host}:0"


def worker_main(spec: WorkerSpec) -> None:
    import zmq

    from transfer.auth import connect_as

    if spec.log_file is not None:
        os.makedirs(os.path.dirname(spec.log_file) or ".", exist_ok=True)  # another node's disk (ray)
        logging.basicConfig(
            filename=spec.log_file,
            level=spec.log_level,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            force=True,  # a Ray actor's process already has handlers
        )
    codec = worker_codec()
    # its own context: terminating it at the end flushes what the worker sent last (its Timeline), which
    # a worker forked from the fork server would lose (it ends with os._exit: no interpreter shutdown)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, spec.name.encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    connect_as(sock, spec.creds, "driver")
    sock.connect(spec.driver_address)
    worker = None
    try:
        worker = Worker(spec, sock)
        worker.serve()
    except KeyboardInterrupt:
        pass
    except Exception:
        log.exception("%s failed", spec.name)
        sock.send(codec.encode(Failed(spec.name, traceback.format_exc())))
    finally:
        if worker is not None:
            worker.close()
        sock.close()
        ctx.term()  # waits for the last messages to go, LINGER (1 s) at most


class Worker:
    def __init__(self, spec: WorkerSpec, sock):
        import torch

        from engine import make_llm
        from pdkernels import ops

        self.spec, self.sock, self.parent = spec, sock, os.getppid()
        self.gather_s = spec.deployment.gather_ms / 1e3
        self.role = spec.role  # an elastic worker's changes (SwitchRole)
        self.codec = worker_codec()
        if spec.cores:
            os.sched_setaffinity(0, spec.cores)
        torch.set_num_threads(spec.deployment.threads_per_worker)
        ops.set_backend(spec.kernels.backend)  # auto: Triton on CUDA, the torch references on the CPU
        d = spec.deployment
        self.llm = make_llm(spec.engine)  # a DPLLM where the deployment sets dp
        self.timeline = Timeline(spec.name, spec.role)
        self.live: dict[str, float] = {}  # request -> when it was received
        self.streamed: dict[str, list[int]] = {}  # streamed request -> [tokens sent, characters sent]
        self.holdback: dict[str, int] = {}  # characters a stop string could still claim
        self.load_at = 0.0  # when the last Load went
        self._last_stats = None  # the engine's latest step already in the timeline
        self.speed = dict(prefill_tokens=0, prefill_s=0.0, decode_steps=0, decode_seqs=0, decode_s=0.0)
        # decode: what waits for a prefill worker's KV, and for a restarted prefill worker
        self.front = DecodeFront(self.llm, d.local_prefill_max_tokens, spec.restart_wait_s, name=spec.name)
        self.pm = self.dm = None
        # elastic roles: the messenger's generation (a new transfer agent and control sockets each
        # switch), peers not yet heard from (decode), prefill peers leaving that role, a switch under way
        self.generation = 0
        self.joining: dict[str, object] = {}
        self.switch = RoleSwitch(self)
        if spec.role.samples:  # the router routes to this worker by what its cache holds
            self.llm.front.record_cache_events()
        self.llm.record_tier_events()  # ... and below it (a prefill worker's pool puts too)
        if spec.role.sends_kv or spec.role.receives_kv:  # a messenger for its side of the hand-off
            self._connect_messenger(spec.wait_for)

    def close(self) -> None:
        """Stop the messenger, then the engine: its TP rank processes, its other DP groups, its KV tiers'
        I/O and its rendezvous folder. A worker forked from the fork server ends with os._exit, which runs
        no finalizer: without this a worker of TP or DP ranks left its folder in TMPDIR at every stop."""
        for what, close in (("messenger", self._close_messenger), ("engine", self.llm.close)):
            try:
                close()
            except Exception:
                log.exception("%s: closing its %s failed", self.spec.name, what)

    def _close_messenger(self) -> None:
        """Stop this role's messenger: its sender thread, control sockets and transfer agents."""
        channels, agents = list(self.joining.values()), []
        if self.pm is not None:
            self.pm.close()
            channels += self.pm.channels
            agents += self.pm.agents.backends
        if self.dm is not None:
            channels += [p.channel for p in self.dm.peers.values()]
            agents += self.dm.backends  # every DP group's too
        for channel in channels:
            channel.close()
        for agent in agents:
            agent.close()
        self.pm = self.dm = self.front.dm = None
        self.joining.clear()

    def _join(self) -> None:
        """Decode: peers that say Hello for the first time join (an elastic worker now prefilling)."""
        from transfer.protocol import PROTOCOL_VERSION, Hello

        for peer, channel in list(self.joining.items()):
            for msg in channel.receive():
                if isinstance(msg, Hello) and msg.version == PROTOCOL_VERSION:
                    del self.joining[peer]
                    try:
                        self.dm.add_peer(peer, channel, msg)
                    except ValueError as e:  # its KV would not mean the same here: it is asked nothing
                        log.error("%s: %s", self.spec.name, e)
                        break
                    log.info("%s: prefill worker %s joined", self.spec.name, peer)
                    break

    def _connect_messenger(self, wait_for) -> None:
        """This role's messenger: a prefill worker connects to the decode workers' addresses (the runtime's
        Connect); a decode worker binds one control socket per peer and waits for the Hello of each in
        wait_for (None: all); the others join when they say Hello (an elastic worker turning prefill)."""
        from engine.disagg import decode_messenger, prefill_messenger
        from transfer.backends import rank_agents
        from transfer.channel import ZmqEndpoint
        from transfer.protocol import decode_codec, prefill_codec, wait_hello

        spec, t = self.spec, self.spec.transfer
        again = f"-{self.generation}" if self.generation else ""  # a new agent's and socket's name
        name = f"{spec.name}-{os.getpid()}{again}"
        agents = rank_agents(t, name, spec.tp)  # DP group 0's: one per TP rank, each on its own NIC
        if self.role.sends_kv:
            self.pm = prefill_messenger(self.llm, agents, t, kv_dtype=spec.kv_wire_dtype)
            self._send(Listening(spec.name, {}))
            connect = self._await_connect()
            for peer, address in connect.addresses.items():
                if address:
                    self.pm.add_peer(ZmqEndpoint(address, False, spec.creds, peer, prefill_codec()))
            if spec.dp > 1:  # each other DP group: a messenger of its own, in its engine's process
                peers = {
                    rank: [(dn, addrs[rank - 1]) for dn, addrs in connect.groups.items() if addrs[rank - 1]]
                    for rank in range(1, spec.dp)
                }
                self.llm.front.start_group_messengers(t, name, peers, spec.creds)
            return
        groups = [rank_agents(t, f"{name}-dp{r}", spec.tp, r) for r in range(1, spec.dp)]
        self.dm = self.front.dm = decode_messenger(self.llm, agents, t, group_backends=groups)
        channels = {}
        for peer in spec.peers:  # a prefill worker's DP group authenticates as its worker
            address = listen_address(spec, peer, again)
            channels[peer] = ZmqEndpoint(address, True, spec.creds, worker_of(peer), decode_codec())
        self._send(Listening(spec.name, {p: c.address for p, c in channels.items()}))

        def alive() -> bool:
            return os.getppid() == self.parent

        for peer, channel in channels.items():
            if wait_for is not None and peer not in wait_for:
                self.joining[peer] = channel
                continue
            hello = wait_hello(channel, timeout_s=HELLO_TIMEOUT_S, alive=alive)
            self.dm.add_peer(peer, channel, hello, worker=worker_of(peer))
            log.info("%s: prefill worker %s connected (agents %s)", spec.name, peer, ", ".join(hello.agents))

    def _await_connect(self) -> Connect:
        """The decode workers' addresses, from the runtime's Connect."""
        import zmq

        give_up = time.monotonic() + HELLO_TIMEOUT_S
        while time.monotonic() < give_up and os.getppid() == self.parent:
            if self.sock.poll(100, zmq.POLLIN):
                msg = self._recv()
                if isinstance(msg, Connect):
                    return msg
        raise TimeoutError(f"{self.spec.name}: no Connect from the runtime within {HELLO_TIMEOUT_S} s")

    def _send(self, msg) -> None:
        self.sock.send(self.codec.encode(msg))

    def _drain(self) -> bool:
        """Handle every message waiting; True when one was the runtime's Stop (its timeline sent back)."""
        import zmq

        while self.sock.poll(0, zmq.POLLIN):
            msg = self._recv()
            if isinstance(msg, Stop):
                for key, value in self._stats().items():
                    setattr(self.timeline, key, value)
                free, pages = self.llm.pages  # every DP group's
                self.timeline.free_pages, self.timeline.num_pages = free, pages
                self.timeline.role = self.role
                self._send(self.timeline)
                log.info("%s stopped by the driver (%d of %d pages free)", self.spec.name, free, pages)
                return True
            self._handle(msg)
        return False

    def _recv(self):
        """The next message from the runtime, or None for one that does not decode (dropped, logged)."""
        try:
            return self.codec.decode(self.sock.recv())
        except WireError as e:
            log.warning("%s: %s", self.spec.name, e)
            return None

    def serve(self) -> None:
        import zmq

        prefill_tok_s, step_s = self.llm.measure_speed()
        self._send(Ready(self.spec.name, self.llm.scheduler.salt or b"", prefill_tok_s, step_s))
        from pdkernels import ops

        kv = self.llm.kv_cache
        log.info(
            "%s up: %s worker, tp %d, dp %d, pid %d, %s %s, kernels %s",
            self.spec.name,
            self.spec.role,
            self.spec.tp,
            self.spec.dp,
            os.getpid(),
            kv.device,
            self.spec.engine.dtype,
            ops.resolve("decode_attention", kv.device),
        )
        while os.getppid() == self.parent:
            stepping = self.llm.has_unfinished() or self.front.backlog or self.switch.under_way
            busy = stepping or (self.dm and self.dm.pending)
            # a decode worker that only waits for KV to land looks again within a millisecond rather than
            # spinning: on a shared machine the spin takes a core (or its sibling) from the prefill's pass
            if self.sock.poll(0 if stepping or self.pm else 1, zmq.POLLIN):
                if self._drain():
                    return
                if not busy and self.gather_s > 0 and self.llm.has_unfinished():
                    until = time.monotonic() + self.gather_s  # the rest of a burst joins the first step
                    while (left := until - time.monotonic()) > 0 and self.sock.poll(
                        math.ceil(left * 1e3), zmq.POLLIN
                    ):
                        if self._drain():
                            return
            if self.pm is not None:
                self.pm.poll()  # the only place its finished transfers are logged: into the timeline
                self.timeline.sent += [tuple(s) for s in self.pm.done_log]
                self.pm.done_log.clear()
                self.llm.front.poll_groups()  # each other DP group's messenger (none without DP)
            if self.dm is not None:
                self.front.drain(lambda rid, e: self._refuse(rid, self.live.pop(rid), e))
                self.dm.poll()
                self._join()
                self.switch.tend()
            if self.llm.has_unfinished():
                self._step()
            elif self.switch.under_way and self.switch.settled():
                self.switch.finish()
            elif self.pm is not None:
                time.sleep(0.0005)
            if time.monotonic() - self.load_at > LOAD_EVERY_S:
                self.load_at = time.monotonic()
                if self.llm.tiers is not None:
                    self.llm.tiers.tend()  # pool puts waiting for a host slot go, idle or not
                running, waiting = self.llm.queues  # every DP group's
                groups = self.llm.front.take_cache_events()
                pending = len(self.front.backlog) + (len(self.dm.pending) if self.dm is not None else 0)
                self._send(
                    Load(
                        self.spec.name,
                        self.llm.pages[0],
                        running,
                        waiting + pending,
                        **self._stats(),
                        cache_events=[e for group in groups for e in group],
                        group_cache_events=groups if len(groups) > 1 else [],
                        tier_events=self.llm.take_tier_events(),
                        **self.speed,
                    )
                )

    def _stats(self) -> dict[str, int]:
        """The engine's counters as Load and Timeline carry them."""
        cache = self.llm.prefix_cache_stats
        return {
            **self.llm.preemption_stats,
            "prefix_queries": cache["queries"],
            "prefix_hits": cache["hits"],
            "cached_pages": cache["cached_pages"],
            "kv_tiers": {t: TierCounters(**c) for t, c in self.llm.kv_tier_stats.items()},
            "prompt_tokens_after_cancel": self.pm.tokens_after_cancel if self.pm is not None else 0,
            "prefills_cancelled": self.pm.cancelled_in_flight if self.pm is not None else 0,
            "rail_failovers": self.pm.failovers if self.pm is not None else 0,
            "agents_renewed": self.dm.renewed if self.dm is not None else 0,
            **handoff_stats([m.handoff for m in (self.pm, self.dm) if m is not None]),
        }

    def _handle(self, msg) -> None:
        if isinstance(msg, Connect) and self.pm is not None:  # a decode worker's new sockets (or none)
            from transfer.channel import ZmqEndpoint
            from transfer.protocol import prefill_codec

            for peer, address in msg.addresses.items():
                if peer in self.spec.peers and address:  # restarted, or an elastic worker now decoding
                    log.warning("%s: decode worker %s is (back) up; connecting afresh", self.spec.name, peer)
                    self.pm.replace_peer(ZmqEndpoint(address, False, self.spec.creds, peer, prefill_codec()))
                elif peer in self.spec.peers:  # an elastic worker left the decode role
                    self.pm.remove_peer(peer)
        elif isinstance(msg, SwitchRole):
            self.switch.begin(msg)
        elif isinstance(msg, PeerLeaving) and self.dm is not None:
            self.dm.retire(msg.name)
            self.switch.leaving.add(msg.name)
        elif isinstance(msg, PeerDead) and self.dm is not None:
            peer = self.dm.peers.get(msg.name)
            if peer is None or (msg.pid and msg.pid != peer.hello.pid):
                return  # not a peer, or about a process of it already replaced by a restarted one
            log.warning("%s: prefill worker %s died; its requests end", self.spec.name, msg.name)
            for name in [n for n, p in self.dm.peers.items() if p.worker == msg.name]:  # its DP groups too
                self.dm.peer_dead(name)
            self.front.returning[msg.name] = time.monotonic() + msg.back_within_s  # 0: not coming back
        elif isinstance(msg, Cancel):
            self._cancel(msg.request_id, msg.at)
        elif isinstance(msg, Submit) and self.switch.under_way:  # sent before the runtime knew: back
            self._send(HandedBack(self.spec.name, [msg.request_id]))
        elif isinstance(msg, Submit):
            received = time.perf_counter()
            try:  # a bad request fails alone, with its error
                params = msg.sampling  # checked where it was built and again on decode
                if msg.grammar is not None:  # compiled by the server: loaded, not compiled here
                    self.llm.front.load_grammar(params.structured_outputs, msg.grammar)  # every DP group's
                if msg.request_id in self.live:
                    raise ValueError(f"request_id {msg.request_id!r} is already in flight here")
                if self.dm is None:
                    rid, outs, group = msg.request_id, msg.output_ids, msg.dp_rank  # group: the router's
                    self.llm.add_request(msg.prompt_ids, params, rid, outs, msg.after, dp_rank=group)
                else:
                    self.front.take(msg, params, self.live)
            except (ValueError, TypeError) as e:
                self._refuse(msg.request_id, received, e)
                return
            self.live[msg.request_id] = received
            if msg.stream:
                self.streamed[msg.request_id] = [len(msg.output_ids), msg.text_sent]
                self.holdback[msg.request_id] = max((len(s) - 1 for s in params.stop), default=0)

    def _cancel(self, request_id: str, at: float = 0.0) -> None:
        """The client went away (at: when, time.time()): end the request wherever it is; its Result
        follows (abort). A prefill worker stops computing and sending it (the runtime tells every live
        one, before the first token); its decode worker hears Ended."""
        if self.pm is not None:
            self.pm.cancel(request_id, at)
            return
        if request_id not in self.live:
            return
        waiting = self.front.drop(request_id)
        if waiting and self.llm.front.holds(request_id):  # preempted, waiting to be fetched again
            self.llm.abort(request_id)  # its Result (abort, with its tokens so far) follows a step
        elif waiting:  # not yet sent to a prefill worker: nothing to undo
            self.streamed.pop(request_id, None)
            received = self.live.pop(request_id)
            self._send(Result.failed(request_id, ErrorKind.CANCELLED, None, self.spec.name, received))
        elif self.dm is not None and request_id in self.dm.pending:
            self.dm.abort(request_id, "aborted: the client went away", at)  # its pages free once safe
        else:
            self.llm.abort(request_id)

    def _refuse(self, request_id: str, received: float, error: Exception) -> None:
        """A request this worker cannot take ends alone, its error in its Result."""
        log.warning("%s: refused request %s: %s", self.spec.name, request_id, error)
        self._send(Result.failed(request_id, ErrorKind.BAD_REQUEST, str(error), self.spec.name, received))

    def _step(self) -> None:
        """One engine step: its timeline entry, Progress for streamed requests, a Result for each that
        finished (the engine hands each finished request back once)."""
        outputs = self.llm.step()
        if self.dm is not None:  # preempted: fetched again, before any new request
            self.front.refetch(self.llm.front.take_refetches())
        stats = self.llm.core.last_step
        if stats is not None and stats is not self._last_stats:
            self._last_stats = stats
            self.timeline.steps.append(
                (
                    stats.start,
                    stats.end,
                    stats.prefill_tokens,
                    stats.decode_tokens,
                    stats.verify_steps,
                    list(stats.prefill_chunks),
                    stats.decode_kv,
                )
            )
            self.timeline.loads += self.llm.take_tier_loads()  # drawn beside the steps
            speed = self.speed
            if stats.prefill_tokens:
                speed["prefill_tokens"] += stats.prefill_tokens
                speed["prefill_s"] += stats.end - stats.start
            elif stats.decode_tokens:
                speed["decode_steps"] += 1
                speed["decode_seqs"] += stats.decode_tokens
                speed["decode_s"] += stats.end - stats.start
        mine = [o for o in outputs if o.request_id in self.live]
        if self.streamed:
            self._progress([o for o in mine if not o.finished and o.request_id in self.streamed])
        for out in mine:
            if out.finished:
                self._report(out)

    def _progress(self, outputs) -> None:
        """Progress for the streamed requests that gained tokens (progress_items)."""
        items = progress_items(outputs, self.streamed, self.holdback)
        if items:
            self._send(Progress(items))

    def _report(self, out) -> None:
        """The Result of a finished request of this worker's (decode/colocated)."""
        rid = out.request_id
        here = self.front.prefilled_here.pop(rid, None)  # BY_LOAD: the router sent it here to prefill
        self.streamed.pop(rid, None)
        by_load = here is Cause.BY_LOAD
        result = result_of(out, self.spec, self.live.pop(rid), self.dm, here is not None, by_load)
        if out.error is not None:
            log.warning("%s: request %s failed: %s", self.spec.name, rid, out.error)
        self._send(result)
        if self.dm is not None:
            self.dm.forget(rid)
