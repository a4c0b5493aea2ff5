"""The prefill side of the KV messenger: stream each layer's pages as soon as the layer is done.

The engine calls `on_batch` before every forward pass (which chunks, which pages) and `on_prefilled`
after a request's last chunk. A sender thread then waits on the layer counter and posts layer l's
writes for the batch the moment counter[0, l] reaches that pass, while the forward pass goes on with
later layers. A page is posted once, when it is full (or, at the end, when it is the last page), so no
page is ever written twice. All backend calls happen on the sender thread; the engine's thread only
reads flags in `poll`, which also frees finished requests' pages and answers aborts.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from transfer.backends import Backend, TransferError, WriteOp
from transfer.plan import ShardSpec, plan_writes
from transfer.protocol import Abort, Ended, Endpoint, PrefillRequest, notif


class PrefillEngine(Protocol):
    def start(self, request_id: str, prompt_ids: list[int]) -> None: ...  # compute these tokens' KV

    def pages(self, request_id: str) -> list[int]: ...

    def stop(self, request_id: str) -> None: ...  # compute no more for it (pages stay until release)

    def release(self, request_id: str) -> None: ...  # free its pages


@dataclass
class _Transfer:
    req: PrefillRequest
    peer: str
    sent_pages: int = 0  # pages [0, sent_pages) are posted (or queued to be)
    in_flight: list = field(default_factory=list)  # backend handles, owned by the sender thread
    context_posted: bool = False
    aborted: str | None = None
    error: str | None = None


class PrefillMessenger:
    def __init__(
        self,
        engine: PrefillEngine,
        backend: Backend,
        spec: ShardSpec,
        channel: Endpoint,
        kv_regions: list[Tensor],
        counter: Tensor,
        hidden_size: int,
        context_slots: int = 64,
        layer_timeout_s: float = 30.0,
    ):
        self.engine, self.backend, self.spec, self.channel = engine, backend, spec, channel
        self.counter, self.layer_timeout_s = counter, layer_timeout_s
        self.context = torch.zeros(
            context_slots, hidden_size, dtype=torch.float32
        )  # staging for context writes
        backend.register(list(kv_regions) + [self.context])
        self._free_slots = list(range(context_slots))
        self._slots: dict[str, int] = {}
        self.transfers: dict[str, _Transfer] = {}
        self._peers: dict[bytes, str] = {}
        self._passes = 0
        self.post_log: list[tuple[str, int, float]] = []  # (request, layer, perf_counter) of each KV post
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
        for chunk in batch.chunks:
            t = self.transfers.get(chunk.seq.request_id)
            if t is None or t.aborted:
                continue
            final = chunk.end == len(chunk.seq.prompt_ids)
            upto = len(chunk.pages) if final else chunk.end // self.spec.page_size
            if upto > t.sent_pages:
                items.append((t, t.sent_pages, upto, list(chunk.pages[:upto])))
                t.sent_pages = upto
        if items:
            self._jobs.put(("kv", self._passes, items))

    def on_prefilled(self, seq, last_hidden: Tensor) -> None:
        """After the last chunk: queue the context write (the last position's hidden state)."""
        t = self.transfers.get(seq.request_id)
        if t is None or t.aborted:
            return
        slot = self._slots[seq.request_id]
        self.context[slot] = last_hidden.float()
        self._jobs.put(("ctx", t, slot))

    # ---- control (the engine's thread) ----------------------------------------------------------------

    def poll(self) -> None:
        """Take new requests and aborts; free the pages of requests whose writes have all finished."""
        self.channel.heartbeat()
        for msg in self.channel.receive():
            if isinstance(msg, PrefillRequest):
                self._accept(msg)
            elif isinstance(msg, Abort) and msg.request_id in self.transfers:
                with self._lock:  # no post for it starts after this
                    self.transfers[msg.request_id].aborted = msg.reason
                self.engine.stop(msg.request_id)
        with self._lock:
            done = [
                t
                for t in self.transfers.values()
                if not t.in_flight and (t.context_posted or t.aborted or t.error)
            ]
            for t in done:
                del self.transfers[t.req.request_id]
        for t in done:
            rid = t.req.request_id
            self.engine.stop(rid)  # a failed transfer stops its computation too
            self.engine.release(rid)
            self._free_slots.append(self._slots.pop(rid))
            if t.aborted or t.error:
                self.channel.send(Ended(rid, t.error or f"aborted: {t.aborted}"))

    def _accept(self, req: PrefillRequest) -> None:
        if not self._free_slots:
            self.channel.send(Ended(req.request_id, "prefill worker has no free context slot"))
            return
        if req.dst_metadata not in self._peers:
            self._peers[req.dst_metadata] = self.backend.connect(req.dst_metadata)
        self._slots[req.request_id] = self._free_slots.pop()
        with self._lock:
            self.transfers[req.request_id] = _Transfer(req, self._peers[req.dst_metadata])
        self.engine.start(req.request_id, req.prompt_ids)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # ---- sender thread ------------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=0.001)
            except queue.Empty:
                self._reap()
                continue
            if job[0] == "kv":
                self._send_layers(job[1], job[2])
            else:
                self._send_context(job[1], job[2])
            self._reap()

    def _send_layers(self, target: int, items: list) -> None:
        for layer in range(self.spec.num_layers):
            deadline = time.monotonic() + self.layer_timeout_s
            while (
                int(self.counter[0, layer]) < target
            ):  # the kernel bumps it once the layer's tiles are stored
                if time.monotonic() > deadline:
                    for t, *_ in items:
                        t.error = f"layer {layer} not done within {self.layer_timeout_s} s"
                    return
                time.sleep(0)
            for t, i0, i1, pages in items:
                self._post_pages(t, layer, i0, i1, pages)

    def _post_pages(self, t: _Transfer, layer: int, i0: int, i1: int, pages: list[int]) -> None:
        req = t.req
        writes = plan_writes(
            self.spec,
            req.dst_spec,
            pages[i0:i1],
            req.dst_pages[i0:i1],
            first_page_index=i0,
            layers=range(layer, layer + 1),
            seed=req.seed,
        )
        ops = [WriteOp(w.src_rank, w.src_offset, w.dst_rank, w.dst_offset, w.nbytes) for w in writes]
        if self._post(t, ops, notif("kv", req.request_id, len(ops))):
            self.post_log.append((req.request_id, layer, time.perf_counter()))

    def _send_context(self, t: _Transfer, slot: int) -> None:
        row = self.context.shape[1] * 4
        op = WriteOp(self.spec.tp, slot * row, t.req.dst_spec.tp, t.req.context_slot * row, row)
        t.context_posted = self._post(t, [op], notif("ctx", t.req.request_id, 1))

    def _post(self, t: _Transfer, ops: list[WriteOp], message: bytes) -> bool:
        """Post unless the transfer was aborted or failed (checked under the lock that poll frees under)."""
        with self._lock:
            if t.aborted or t.error:
                return False
            try:
                t.in_flight.append(self.backend.post(t.peer, ops, message))
            except TransferError as e:
                t.error = str(e)
                return False
        return True

    def _reap(self) -> None:
        """Poll in-flight posts (this also sends their notifications) and drop the finished ones."""
        with self._lock:
            transfers = list(self.transfers.values())
        for t in transfers:
            for handle in list(t.in_flight):
                state = self.backend.state(handle)
                if state == "PROC":
                    continue
                if state == "ERR":
                    t.error = "a KV write failed"
                self.backend.release(handle)
                with self._lock:
                    t.in_flight.remove(handle)
