"""An LLM as either half of the KV messenger: the few callbacks the transfer layer needs, and the wiring.

The transfer layer never imports the engine; these adapters give it an engine in the prefill role
(start, pages, stop, release) or the decode role (reserve, admit, fail, free, recompute).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.sequence import SamplingParams
from pdkernels.out_proj import host_view
from transfer.backends import Backend
from transfer.config import TransferConfig
from transfer.decode import DecodeMessenger
from transfer.plan import ShardSpec
from transfer.prefill import PrefillMessenger

if TYPE_CHECKING:  # the engine it adapts; engine/dp_group.py (which engine.llm starts) imports this module
    from engine.llm import LLM


def shard_spec(llm: LLM) -> ShardSpec:
    """The geometry of llm's KV cache as the transfer plan sees it."""
    return llm.config.shard_spec(llm.kv_cache.element_size(), llm.identity)


class PrefillSide:
    """An LLM in the prefill role, as the prefill messenger drives it."""

    def __init__(self, llm: LLM):
        self.llm = llm

    def start(self, request_id: str, prompt_ids: list[int], cache_salt: str = "", client=()) -> None:
        params = SamplingParams(max_tokens=1, cache_salt=cache_salt or None, client=tuple(client) or None)
        # this engine's own (DP group 0's with DP: each group's messenger serves its own engine)
        self.llm.add_request(prompt_ids, params, request_id=request_id, dp_rank=0)

    def pages(self, request_id: str) -> list[int]:
        return self.llm.allocator.pages(request_id)

    def stop(self, request_id: str) -> None:
        self.llm.core.stop(request_id)

    def release(self, request_id: str) -> None:
        self.llm.handoff.release(request_id)
        self.llm.core.forget(request_id)  # stopped or prefilled by now: nothing more is kept of it


class DecodeSide:
    """An LLM in the decode role, as the decode messenger drives it; group: a DP group of its (engine/dp.py)
    whose engine runs in another process and is driven through the front's pipe."""

    def __init__(self, llm: LLM, group: int = 0):
        self.llm, self.group = llm, group

    def reserve(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams | None,
        load_within_s: float = 0.0,
    ) -> tuple[list[int], int]:
        if self.group:
            return self.llm.front.reserve_in(self.group, request_id, prompt_ids, params, load_within_s)
        seq = self.llm.handoff.reserve(prompt_ids, params, request_id=request_id, load_within_s=load_within_s)
        held = seq.pages_named + self.llm.handoff.reserved_below(request_id)  # cached, or loading from below
        return self.llm.allocator.pages(request_id), held * self.llm.allocator.page_size

    def admit(self, request_id: str, context: Tensor | None) -> None:
        if self.group:  # by value: a tensor would cross as a shared-memory file of its own
            hidden = context.numpy() if context is not None else None
            self.llm.dp_engines.call(self.group, "admit", request_id, hidden)
        elif context is not None and not isinstance(context, Tensor):  # from the front (numpy)
            self.llm.handoff.admit_prefilled(request_id, torch.from_numpy(context))
        else:
            self.llm.handoff.admit_prefilled(request_id, context)

    def fail(self, request_id: str, error: str) -> None:
        if self.group:
            self.llm.dp_engines.call(self.group, "fail", request_id, error)
        else:
            self.llm.core.stop(request_id, error)

    def free(self, request_id: str) -> None:
        if self.group:
            self.llm.dp_engines.call(self.group, "free", request_id)
        else:
            self.llm.handoff.release(request_id)

    def set_aside(self, request_id: str, owner: str) -> None:
        if self.group:
            self.llm.dp_engines.call(self.group, "set_aside", request_id, owner)
        else:
            self.llm.handoff.set_aside(request_id, owner)

    def recompute(self, request_id: str) -> None:
        if self.group:
            self.llm.dp_engines.call(self.group, "recompute", request_id)
            return
        seq = self.llm.core.seqs.get(request_id)
        if seq is None or seq.finished:  # stopped meanwhile (handed back, aborted): nothing to compute
            self.llm.handoff.release(request_id)
            return
        self.llm.handoff.prefill_locally(request_id)


def prefill_messenger(
    llm: LLM, backend: Backend | list[Backend], config: TransferConfig | None = None, side: type = PrefillSide
) -> PrefillMessenger:
    """A PrefillMessenger over llm's KV regions (every TP rank's) and layer counter, as its listener;
    backend: an agent per TP rank (a worker's: transfer.backends.rank_agents) or one for all."""
    pm = PrefillMessenger(
        side(llm),
        backend,
        shard_spec(llm),
        llm.kv_regions,
        host_view(llm.core.counter),  # read while the pass runs, not after it (pinned, mapped on CUDA)
        llm.config.arch.hidden_size,
        config,
    )
    llm.core.listener = pm
    return pm


def decode_messenger(
    llm: LLM,
    backend: Backend | list[Backend],
    config: TransferConfig | None = None,
    side: type = DecodeSide,
    group_backends: list[Backend | list[Backend]] = (),
) -> DecodeMessenger:
    """A DecodeMessenger over llm's KV regions (every TP rank's; backend: an agent per rank, or one); with
    DP groups (llm.config.dp > 1), one more destination per other group, its KV registered with its own
    agents (group_backends[r - 1])."""
    dp = llm.config.dp
    if len(group_backends) != dp - 1:
        raise ValueError(f"dp={dp}: one backend (agent) for each of the other {dp - 1} DP groups")
    spec, hidden = shard_spec(llm), llm.config.arch.hidden_size
    dm = DecodeMessenger(side(llm), backend, spec, llm.kv_regions, hidden, config)
    for rank, group_backend in enumerate(group_backends, start=1):
        dm.add_group(side(llm, rank), group_backend, spec, llm.front.group_kv_regions(rank))
    return dm
