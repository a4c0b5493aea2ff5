"""One serving worker process (colocated, prefill or decode), started and driven by experiments.driver.

Each worker talks to the driver over a pyzmq DEALER socket (its name as identity): it says Ready once
its engine (and TP ranks, and every messenger peer) is up, takes Submit and PeerDead, answers each
request with a Result, and sends its per-step timeline on Stop. Prefill and decode workers also run
the KV messenger: a decode worker binds one PAIR socket per prefill worker; each prefill worker
connects to every decode worker and announces itself with a Hello. A worker exits when told to, or
when its parent (the driver) is gone.
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

from experiments.config import DeploymentConfig, ModelSpec
from transfer.config import TransferConfig


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    role: str  # colocated | prefill | decode
    model: ModelSpec
    deployment: DeploymentConfig
    transfer: TransferConfig
    driver_address: str
    peers: tuple[tuple[str, str], ...] = ()  # (peer worker name, PAIR address) for the messenger
    cores: tuple[int, ...] = ()  # CPU affinity (empty: leave as is)
    tp: int = 1
    seed: int = 0


@dataclass(frozen=True)
class Ready:
    name: str


@dataclass(frozen=True)
class Submit:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class PeerDead:
    name: str


@dataclass(frozen=True)
class Stop:
    pass


@dataclass
class Result:
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


@dataclass
class Timeline:
    name: str
    role: str
    steps: list = field(default_factory=list)  # (start, end, prefill tokens, decode tokens)


@dataclass(frozen=True)
class Failed:
    name: str
    error: str


def worker_main(spec: WorkerSpec) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, spec.name.encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(spec.driver_address)
    try:
        Worker(spec, sock).serve()
    except KeyboardInterrupt:
        pass
    except Exception:
        sock.send(pickle.dumps(Failed(spec.name, traceback.format_exc())))
    finally:
        sock.close()


class Worker:
    def __init__(self, spec: WorkerSpec, sock):
        import torch

        from engine import LLM
        from pdkernels import ops

        self.spec, self.sock, self.parent = spec, sock, os.getppid()
        if spec.cores:
            os.sched_setaffinity(0, spec.cores)
        torch.set_num_threads(spec.deployment.threads_per_worker)
        ops.set_backend("torch")
        d, m = spec.deployment, spec.model
        self.llm = LLM(
            m.name,
            tp=spec.tp,
            role=spec.role,
            dtype=m.dtype,
            page_size=m.page_size,
            num_pages=m.num_pages,
            max_num_seqs=m.max_num_seqs,
            max_num_batched_tokens=d.chunk_size,
            seed=spec.seed,
        )
        self.timeline = Timeline(spec.name, spec.role)
        self.live: dict[str, float] = {}  # request -> when it was received
        self.backlog: deque = deque()  # decode: (Submit, SamplingParams) waiting for free pages
        self.pm = self.dm = None
        if spec.role != "colocated":
            self._connect_messenger()

    def _connect_messenger(self) -> None:
        from engine.disagg import decode_messenger, prefill_messenger
        from transfer.backends import make_backend
        from transfer.channel import ZmqEndpoint
        from transfer.protocol import wait_hello

        t = self.spec.transfer
        backend = make_backend(t.backend, f"{self.spec.name}-{os.getpid()}", engine=t.nixl_engine)
        if self.spec.role == "prefill":
            self.pm = prefill_messenger(self.llm, backend, t)
            for _, address in self.spec.peers:
                self.pm.add_peer(ZmqEndpoint(address, bind=False))
            return
        self.dm = decode_messenger(self.llm, backend, t)
        for name, address in self.spec.peers:
            channel = ZmqEndpoint(address, bind=True)
            hello = wait_hello(channel, timeout_s=300, alive=lambda: os.getppid() == self.parent)
            self.dm.add_peer(name, channel, hello)

    def serve(self) -> None:
        import zmq

        self.sock.send(pickle.dumps(Ready(self.spec.name)))
        while os.getppid() == self.parent:
            busy = self.llm.has_unfinished() or self.backlog or (self.dm and self.dm.pending)
            if self.sock.poll(0 if busy or self.pm else 1, zmq.POLLIN):
                while self.sock.poll(0, zmq.POLLIN):
                    msg = pickle.loads(self.sock.recv())
                    if isinstance(msg, Stop):
                        self.sock.send(pickle.dumps(self.timeline))
                        return
                    self._handle(msg)
            if self.pm is not None:
                self.pm.poll()
            if self.dm is not None:
                self._drain_backlog()
                self.dm.poll()
            if self.llm.has_unfinished():
                self._step()
            elif self.pm is not None:
                time.sleep(0.0005)
            self._report()

    def _handle(self, msg) -> None:
        from engine import SamplingParams

        if isinstance(msg, PeerDead) and self.dm is not None:
            self.dm.peer_dead(msg.name)
        elif isinstance(msg, Submit):
            self.live[msg.request_id] = time.perf_counter()
            params = SamplingParams(max_tokens=msg.max_tokens, ignore_eos=True)
            d = self.spec.deployment
            if self.dm is None or len(msg.prompt_ids) <= d.local_prefill_max_tokens:
                self.llm.add_request(msg.prompt_ids, params, request_id=msg.request_id)
            else:
                self.backlog.append((msg, params))

    def _drain_backlog(self) -> None:
        from engine.kv_cache import OutOfPages

        while self.backlog:
            msg, params = self.backlog[0]
            try:
                self.dm.submit(msg.request_id, msg.prompt_ids, params)
            except OutOfPages:
                return  # pages come back as running requests finish
            self.backlog.popleft()

    def _step(self) -> None:
        start = time.perf_counter()
        self.llm.step()
        end = time.perf_counter()
        batch = self.llm.last_batch
        if batch is not None:
            decode = sum(1 for c in batch.chunks if c.num_tokens == 1 and c.samples)
            self.timeline.steps.append((start, end, batch.num_tokens - decode, decode))

    def _report(self) -> None:
        """Send a Result for every request of this worker's that has finished (decode/colocated)."""
        for rid in [r for r in self.live if self.llm.seqs.get(r) is not None and self.llm.seqs[r].finished]:
            seq = self.llm.seqs[rid]
            result = Result(
                rid,
                self.spec.name,
                list(seq.output_ids),
                self.live.pop(rid),
                seq.scheduled_time,
                list(seq.token_times),
                seq.finish_reason,
                seq.error,
            )
            timing = self.dm.timings.pop(rid, None) if self.dm is not None else None
            if timing is not None:
                result.prefill, result.transfer_bytes = "remote", timing.nbytes
                result.transfer_s = timing.landed - timing.sent
                result.scheduled = timing.first_landed  # its first KV arriving: prefill has begun
                result.prefill_worker = timing.peer
            elif self.dm is not None and len(seq.prompt_ids) > self.spec.deployment.local_prefill_max_tokens:
                result.prefill = "remote"  # its transfer failed (or it was recomputed here)
            self.sock.send(pickle.dumps(result))
            del self.llm.seqs[rid]
