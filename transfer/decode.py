"""The decode side of the KV messenger: reserve pages, ask a prefill worker, count what lands, release.

`submit` pins pages for the prompt's KV (all but its last token) and sends a PrefillRequest. Every post
from the prefill side ends with a notification that says how many writes it carried; the request is
handed to the decode scheduler only when the count reaches what the plan says plus the context write.
A request that fails (abort, deadline, an error reported by the prefill side) ends at once with an
error, but its pages stay pinned until the prefill side confirms that nothing more is in flight
(Ended), so a late write can never land in a page that another request owns.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from transfer.backends import Backend
from transfer.plan import ShardSpec, plan_writes
from transfer.protocol import Abort, Ended, Endpoint, PrefillRequest, parse_notif


class DecodeEngine(Protocol):
    def reserve(
        self, request_id: str, prompt_ids: list[int]
    ) -> list[int]: ...  # pinned pages for prompt[:-1]

    def admit(self, request_id: str) -> None: ...  # every write landed: start decoding

    def fail(self, request_id: str, error: str) -> None: ...  # end the request with an error (pages stay)

    def free(self, request_id: str) -> None: ...  # unpin and free its pages


@dataclass
class _Pending:
    expected: int
    deadline: float
    slot: int
    received: int = 0
    failed: str | None = None  # set once the request has failed; pages wait for Ended


class DecodeMessenger:
    def __init__(
        self,
        engine: DecodeEngine,
        backend: Backend,
        spec: ShardSpec,
        channel: Endpoint,
        prefill_spec: ShardSpec,
        kv_regions: list[Tensor],
        hidden_size: int,
        context_slots: int = 64,
        deadline_s: float = 30.0,
        peer_timeout_s: float = 10.0,
    ):
        self.engine, self.backend, self.spec, self.channel = engine, backend, spec, channel
        self.prefill_spec, self.deadline_s, self.peer_timeout_s = prefill_spec, deadline_s, peer_timeout_s
        self.context = torch.zeros(context_slots, hidden_size, dtype=torch.float32)  # written by prefill
        backend.register(list(kv_regions) + [self.context])
        self._metadata = backend.metadata()
        self._free_slots = list(range(context_slots))
        self.pending: dict[str, _Pending] = {}
        self.contexts: dict[str, Tensor] = {}  # last prefilled hidden state of each admitted request
        self._seeds = itertools.count()

    def submit(self, request_id: str, prompt_ids: list[int]) -> None:
        """Reserve pages and ask the prefill worker for the KV of prompt_ids[:-1]."""
        pages = self.engine.reserve(request_id, prompt_ids)
        if len(prompt_ids) == 1:  # nothing to prefill: decode runs the only token
            self.engine.admit(request_id)
            return
        if not self._free_slots:
            self.engine.fail(request_id, "decode worker has no free context slot")
            self.engine.free(request_id)
            return
        seed = next(self._seeds)
        # counts do not depend on which source pages are used: plan against placeholder ids
        expected = (
            len(plan_writes(self.prefill_spec, self.spec, list(range(len(pages))), pages, seed=seed)) + 1
        )
        slot = self._free_slots.pop()
        self.pending[request_id] = _Pending(expected, time.monotonic() + self.deadline_s, slot)
        self.channel.send(
            PrefillRequest(request_id, list(prompt_ids[:-1]), pages, self.spec, self._metadata, slot, seed)
        )

    def abort(self, request_id: str, reason: str = "aborted by the decode worker") -> None:
        p = self.pending.get(request_id)
        if p is not None and p.failed is None:
            self._fail(request_id, p, reason)

    def poll(self) -> list[str]:
        """Count landed writes, handle Ended and deadlines; returns the request ids admitted now."""
        for _, msg in self.backend.notifications():
            kind, rid, writes = parse_notif(msg)
            p = self.pending.get(rid)
            if p is not None and p.failed is None:
                p.received += writes
        for msg in self.channel.receive():
            if isinstance(msg, Ended) and msg.request_id in self.pending:
                p = self.pending.pop(msg.request_id)
                if p.failed is None:  # the prefill side failed it
                    self.engine.fail(msg.request_id, msg.error or "prefill ended the request")
                self.engine.free(msg.request_id)
                self._free_slots.append(p.slot)
        if self.pending and self.channel.peer_silent_for() > self.peer_timeout_s:
            self._peer_died()
        admitted, now = [], time.monotonic()
        for rid, p in list(self.pending.items()):
            if p.failed is None and p.received == p.expected:
                del self.pending[rid]
                self.contexts[rid] = self.context[p.slot].clone()
                self._free_slots.append(p.slot)
                self.engine.admit(rid)
                admitted.append(rid)
            elif p.failed is None and now > p.deadline:
                self._fail(
                    rid,
                    p,
                    f"transfer deadline of {self.deadline_s} s passed "
                    f"({p.received}/{p.expected} writes landed)",
                )
        return admitted

    def _peer_died(self) -> None:
        """The prefill worker stopped answering: it sends nothing more, so every page can be freed now."""
        reason = f"prefill worker silent for over {self.peer_timeout_s} s"
        for rid, p in list(self.pending.items()):
            if p.failed is None:
                self.engine.fail(rid, reason)
            self.engine.free(rid)
            self._free_slots.append(p.slot)
            del self.pending[rid]

    def _fail(self, request_id: str, p: _Pending, reason: str) -> None:
        """End the request now; its pages stay pinned until the prefill side's Ended."""
        p.failed = reason
        self.engine.fail(request_id, reason)
        self.channel.send(Abort(request_id, reason))
