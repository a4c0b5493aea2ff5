"""An LLM as either half of the KV messenger: the few callbacks the transfer layer needs, and the wiring.

The transfer layer never imports the engine; these adapters give it an engine in the prefill role
(start, pages, stop, release) or the decode role (reserve, admit, fail, free, recompute).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.config import KV_DTYPES
from engine.sequence import SamplingParams
from pdkernels.out_proj import host_view
from transfer.backends import Backend
from transfer.config import TransferConfig
from transfer.decode import DecodeMessenger
from transfer.plan import ShardSpec, as_e4m3, wire_spec
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


class E4M3Staging:
    """A prefill worker's KV as it crosses to decode workers whose cache is e4m3 while its own is wider
    (bf16, fp32): a staging copy of each TP rank's cache in e4m3 with a float32 scale per page, plane and
    head (engine.kv.cache's scaled region, what the transfer registers instead of the cache), each page
    quantized into it from the cache as its layers are posted (pdkernels.kv_quant.quantize, over the rows
    the page holds: the bits an e4m3 cache keeps for a page written whole). The price: half the cache's
    bytes again (a quarter of an fp32 one's), and a pass over each page sent."""

    def __init__(self, llm: LLM):
        from engine.kv.cache import allocate_scaled_kv_cache

        c = llm.config
        heads = llm.model.shard.num_kv_heads  # every rank holds as many
        self.caches, self.layout, self.page_size = llm.kv_caches, c.cache.kv_layout, c.cache.page_size
        staged = [allocate_scaled_kv_cache(c.arch, c.cache, heads, cache.device) for cache in self.caches]
        self.regions = [region for region, _, _ in staged]
        self.views = [(kv, scales) for _, kv, scales in staged]
        self.spec = as_e4m3(shard_spec(llm))

    def __call__(self, pages: list[int], tokens: int, layers: range) -> None:
        """Quantize layers' pages of every rank into the staging copy: pages hold tokens from the first
        one's start (the last page's rows past them are a reused page's leftovers: zero, never counted)."""
        from pdkernels.kv_quant import page_dims, quantize

        n, rows = len(pages), tokens - (len(pages) - 1) * self.page_size
        hnd = self.layout == "HND"
        for cache, (kv, scales) in zip(self.caches, self.views, strict=True):
            index = torch.tensor(pages, device=cache.device)
            x = cache[layers.start : layers.stop][:, index].float().flatten(0, 1)  # [layers * n, planes, ...]
            if rows < self.page_size:  # x is a copy (indexed): its last pages' leftover rows zeroed in place
                last = x[n - 1 :: n]  # a view
                (last[:, :, :, rows:] if hnd else last[:, :, rows:]).zero_()
            q, s = quantize(x, page_dims(self.layout))
            shape = (len(layers), n)
            kv[layers.start : layers.stop, index] = q.view(*shape, *q.shape[1:])
            s = s[..., 0, 0] if hnd else s[:, :, 0, :, 0]
            scales[layers.start : layers.stop, index] = s.view(*shape, *s.shape[1:])
        if self.caches[0].is_cuda:  # the writes read the staging copy from the NIC: done before they post
            torch.cuda.current_stream().synchronize()


def prefill_messenger(
    llm: LLM,
    backend: Backend | list[Backend],
    config: TransferConfig | None = None,
    side: type = PrefillSide,
    kv_dtype: str = "auto",
) -> PrefillMessenger:
    """A PrefillMessenger over llm's KV regions (every TP rank's) and layer counter, as its listener;
    backend: an agent per TP rank (a worker's: transfer.backends.rank_agents) or one for all. kv_dtype: what
    the KV crosses as, the decode workers' cache's (engine.config.KV_DTYPES): auto, the cache's own;
    fp8_e4m3 from a wider cache, through an E4M3Staging."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    spec, regions, stage = shard_spec(llm), llm.kv_regions, None
    if wire_spec(spec, kv_dtype) != spec:
        stage = E4M3Staging(llm)
        spec, regions = stage.spec, stage.regions
    pm = PrefillMessenger(
        side(llm),
        backend,
        spec,
        regions,
        host_view(llm.core.counter),  # read while the pass runs, not after it (pinned, mapped on CUDA)
        llm.config.arch.hidden_size,
        config,
        stage,
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
