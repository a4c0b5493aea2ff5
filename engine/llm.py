"""The engine's API: LLM(config) or LLM(model, **overrides) (engine.config.EngineConfig), then
generate(prompts, SamplingParams(...)), chat, or add_request / step / abort.

Roles (engine/role.py): ``colocated`` serves whole requests; ``prefill`` computes the KV of the tokens it
is given (a prompt without its last token), never samples, tells its listener each batch before the
forward pass, and keeps a request's pages until the hand-off releases them; ``decode`` additionally
reserves pinned pages for that KV and starts decoding once they are filled, running the last prompt token
as the first decode step (``llm.handoff``: engine/decode_role.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import replace
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.decode_role import DecodeHandoff
from engine.front import DPFront
from engine.graphs import DecodeGraphs, graphs_wanted
from engine.kv.cache import PageAllocator, allocate_kv_cache, allocate_scaled_kv_cache, scaled_views
from engine.kv.pages import namespace
from engine.kv.tiers import KVTiers
from engine.model import Model, Shard
from engine.mtp import drafting
from engine.role import Role
from engine.runner import ModelRunner
from engine.scheduler import Batch, Scheduler
from engine.sequence import (
    CompletionOutput,
    RequestOutput,
    SamplingParams,
    Sequence,
)
from engine.step_sampling import StepSampler
from engine.tp import TPGroup, init_rank
from engine.weights import identity, load_model
from pdkernels.out_proj import make_layer_counter

log = logging.getLogger(__name__)


def _close_ranks(tp_group, folder: str | None) -> None:
    """Stop this engine's TP ranks, leave the process group, remove the rendezvous directory if it made
    it (an LLM's finalizer: it holds no reference to the LLM)."""
    import torch.distributed as dist

    if tp_group is not None:
        tp_group.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


class PrefillListener(Protocol):
    """What the prefill role tells the messenger."""

    def on_batch(self, batch: Batch, counter: torch.Tensor) -> None: ...  # before the forward pass

    def on_prefilled(self, seq: Sequence, last_hidden: torch.Tensor) -> None: ...  # all its KV computed

    def on_failed(self, seq: Sequence, error: str) -> None: ...  # its step raised: no KV will come


class LLM:
    def __init__(
        self,
        config: EngineConfig | str = "smollm2-135m",
        /,
        *,
        listener: PrefillListener | None = None,
        rendezvous: str | None = None,
        **overrides,
    ):
        """config: what the engine is built from (engine.config.EngineConfig), or a model's name; overrides:
        settings by name, EngineConfig.of's (LLM("tiny-random", page_size=8, role="prefill")). listener: the
        prefill role's messenger. rendezvous: where every DP group's ranks meet (engine/dp.py's DPLLM, which
        composes dp > 1 engines, sets it for each). With CUDA graphs one page is kept back as the padding
        rows' scratch page."""
        config = EngineConfig.of(config, **overrides)
        if config.dp > 1 and rendezvous is None:
            raise ValueError(
                f"dp={config.dp}: an LLM is one DP group's engine; engine.dp.DPLLM runs the {config.dp} "
                "groups (DPLLM(model, dp=...) takes the same settings)"
            )
        loaded = load_model(config.model)
        config = replace(config, arch=loaded.config)  # the checks that need the model's shape run here
        arch, cache, role = loaded.config, config.cache, config.scheduler.role
        torch.manual_seed(config.seed + config.dp_rank)
        self.tokenizer = loaded.tokenizer
        self.identity = identity(loaded)  # (model, weights, tokenizer) digests: a KV peer must share them
        dev = torch.device(config.device)
        shard = Shard.of(arch, 0, config.tp, config.expert_parallel, config.dp, config.dp_rank)
        self.tp_group = leads = None
        if config.world > 1:  # ranks of this engine's group (and, dp > 1, of the other groups)
            own = rendezvous is None  # TP alone: a private directory (mode 0700) for the store
            folder = tempfile.mkdtemp(prefix="pdk-tp-") if own else None
            rendezvous = rendezvous or os.path.join(folder, "rendezvous")
            try:
                self.tp_group = TPGroup(config, rendezvous) if config.tp > 1 else None
            except BaseException:
                _close_ranks(None, folder)
                raise
            self._finalizer = weakref.finalize(self, _close_ranks, self.tp_group, folder)
        self.model = Model(
            arch, loaded.weights, dev, config.torch_dtype, shard, config.batch_invariant, cache.kv_layout
        )
        self.kv_region = None  # an e4m3 cache's pages and scales, the bytes the transfer moves
        if cache.fp8:  # the model reads both
            self.kv_region, kv_cache, self.model.kv_scales = allocate_scaled_kv_cache(
                arch, cache, shard.num_kv_heads, dev
            )
        else:
            kv_cache = allocate_kv_cache(arch, cache, shard.num_kv_heads, dev, config.torch_dtype)
        # the other TP ranks' caches (and e4m3 scales) in their regions, mapped here (every rank holds as
        # many heads)
        ranks = [
            scaled_views(region, arch, cache, shard.num_kv_heads) if cache.fp8 else (region, None)
            for region in (self.tp_group.regions if self.tp_group else [])
        ]
        self._rank_caches, self._rank_scales = [c for c, _ in ranks], [s for _, s in ranks]
        # shared with the lead (TP) and, in the decode role, with DP group 0's agents (engine/dp.py)
        shared = config.tp > 1 or (config.dp > 1 and role.receives_kv)
        self.kv_cache = kv_cache.share_memory_() if shared and dev.type == "cpu" else kv_cache
        if config.world > 1:  # every rank has loaded its shard: join them
            groups = init_rank(0, config, rendezvous)
            self.model.tp_group, leads = groups.tp, groups.leads
        cuda_graphs = not cache.fp8 and graphs_wanted(
            config.cuda_graphs, arch, dev, config.tp, role, cache.num_pages
        )
        # with graphs, the last page is the padding rows' scratch page: never allocated
        self.allocator = PageAllocator(
            cache.num_pages - 1 if cuda_graphs else cache.num_pages, cache.page_size
        )
        salt = (
            f"{arch.name}|{config.dtype}|{cache.page_size}{'|invariant' * config.batch_invariant}"
            f"{'|fp8_e4m3' * cache.fp8}".encode()
            if cache.enable_prefix_caching
            else None
        )
        self.scheduler = Scheduler(config.scheduler, self.allocator, arch.max_position, salt)
        # speculative decoding (a prefill-role engine given it builds its drafter too: set_role may make it
        # decode)
        self.speculative = config.speculative_config
        self._drafter, self._propose = drafting(self.speculative, self.model, loaded, config.seed)
        self.runner = ModelRunner(self.model, self.kv_cache, cache.page_size, cache.kv_layout, self.tp_group)
        if cuda_graphs:
            self.runner.graphs = DecodeGraphs(
                self.model, self.kv_cache, cache.page_size, cache.num_pages - 1, config.scheduler.max_num_seqs
            )
        me = weakref.ref(self)  # the sampler asks for the grammars only when a chunk has one
        sampler = StepSampler(arch.eos_token_ids, self.tokenizer, lambda: me().core.grammars)
        # the parts: one engine's request lifecycle, the front of the other DP groups' engines, the
        # decode role's hand-off
        self.core = EngineCore(
            config, self.tokenizer, self.allocator, self.scheduler, self.runner, sampler, leads
        )
        self.core.listener = listener
        self.core.counter = make_layer_counter(arch.num_layers, dev) if role.sends_kv else None
        self.front = DPFront(self.core, self.kv_regions)  # one engine's; a DPLLM's spans its groups
        self.handoff = DecodeHandoff(self.core, self.front.make_sequence)
        self.tiers = self._make_tiers(arch.name) if config.kv_tiers.enabled else None
        self._wire_drafts()
        if dev.type == "cuda" and config.world == 1:
            self.warm_up()

    def warm_up(self) -> None:
        """Dummy passes in borrowed pages, given back: a long prompt, then the shapes Triton compiles
        apart (its integer arguments are specialized on == 1 and on divisibility by 16: one sequence and
        several, token counts of both kinds, prompt rows beside one-token rows, a decode batch). Done at
        start on one GPU; TP and DP ranks run their passes together, so theirs come with the first request."""
        c = self.config
        longest = min(c.scheduler.max_num_batched_tokens, c.arch.max_position) - 1  # not a multiple of 16
        free = self.allocator.num_free
        # the prefill role's passes bump a counter: a scratch one, so the messenger's counts stay true
        counter = None
        if self.core.counter is not None:
            counter = make_layer_counter(c.arch.num_layers, self.core.counter.device)
        for lengths in ([max(1, min(longest, free * c.cache.page_size))], [32, 16], [17, 5, 1], [1, 1], [1]):
            self._dummy_pass(lengths, counter)

    def _dummy_pass(self, lengths: list[int], counter=None) -> float | None:
        """One pass of dummy prompts of these lengths in borrowed pages, given back; its seconds (None:
        too few free pages for it)."""
        ids = [f"warm-up-{i}" for i in range(len(lengths))]
        if sum(map(self.allocator.pages_for, lengths)) > self.allocator.num_free:
            return None
        try:
            pages = [list(self.allocator.grow(i, n)) for i, n in zip(ids, lengths, strict=True)]
            start = time.perf_counter()
            self.runner.warm_up(lengths, pages, counter)
            return time.perf_counter() - start
        finally:
            for i in ids:
                self.allocator.free(i)

    def measure_speed(self) -> tuple[float | None, float | None]:
        """(prompt tokens a second at one step's token budget, a one-sequence decode step's seconds), each
        the faster of two dummy passes (the first pays one-time costs), so that a router predicts from
        this machine's speed before the first request reports one. (None, None) where the ranks would
        have to pass together (TP, DP) or the pages are too few; the prefill rate is None in the decode
        role (it prefills nothing of its own), the step None in the prefill role."""
        c = self.config
        if c.world > 1 or c.dp > 1:
            return None, None
        counter = None
        if self.core.counter is not None:  # the prefill role's passes bump a counter: a scratch one
            counter = make_layer_counter(c.arch.num_layers, self.core.counter.device)
        n = max(1, min(c.scheduler.max_num_batched_tokens, c.arch.max_position - 1))
        role = c.scheduler.role
        prefill = [self._dummy_pass([n], counter) for _ in range(2)] if role.prefills else []
        step = [self._dummy_pass([1], counter) for _ in range(3)] if role.samples else []
        prefill, step = [t for t in prefill if t], [t for t in step if t]
        return (n / min(prefill) if prefill else None), (min(step) if step else None)

    def _make_tiers(self, model: str) -> KVTiers:
        """The host and disk tiers under the prefix cache, hooked to the allocator and the scheduler."""
        c = self.config
        space = namespace(
            model, self.kv_cache, c.cache.kv_dtype if c.cache.fp8 else c.dtype, c.cache.kv_layout, c.tp
        )
        tiers = KVTiers(c.kv_tiers, self.page_tensors, space, c.cache.page_size)
        self.allocator.on_evict, self.allocator.on_named = tiers.evicted, tiers.named
        tiers.share = c.scheduler.role.prefills  # a decode worker's pages came from a prefill worker
        step = -(-c.scheduler.max_num_batched_tokens // c.cache.page_size)  # pages one step may name
        if tiers.pool is not None and tiers.share and tiers.host.num_slots < step:
            log.warning(
                "kv_tiers.host_bytes=%d holds %d pages, fewer than one step names (%d): each page put into "
                "the shared pool is staged in a host slot until the step after, so puts will lag behind "
                "and other workers find fewer pages; %d bytes or more keeps up",
                c.kv_tiers.host_bytes, tiers.host.num_slots, step, step * tiers.fmt.slot_bytes,
            )  # fmt: skip
        self.scheduler.tiers = tiers
        return tiers

    def _wire_drafts(self) -> None:
        """The scheduler proposes drafts in the decode and colocated roles, when speculation is set."""
        drafts = self._propose is not None and self.scheduler.role.samples
        self.scheduler.propose = self._propose if drafts else None
        self.core.drafter = self._drafter if drafts else None
        # the MTP head reads the hidden state before the last token
        self.scheduler.min_compute = 2 if self.core.drafter is not None else 1

    def set_role(self, role: Role | str) -> None:
        """Serve another role from now on (an elastic worker: prefill <-> decode), keeping the weights, the
        KV cache's memory and what the prefix cache holds. Only between requests: every one must have
        ended and been handed back by step() (ValueError otherwise). The prefill role gets its layer
        counter here; a decode role reached this way replays no CUDA graphs (none were captured)."""
        role = Role.parse(role)
        if self.core.seqs or self.has_unfinished() or self.scheduler.aside:
            raise ValueError(
                f"set_role('{role}') needs an idle engine; {len(self.core.seqs)} requests are here"
            )
        config = replace(self.config.scheduler, role=role)
        self.core.config = replace(self.config, scheduler=config)
        self.scheduler.config = config
        self._wire_drafts()
        if role.sends_kv and self.core.counter is None:
            self.core.counter = make_layer_counter(self.config.arch.num_layers, self.kv_cache.device)
        self.core.listener = None  # the new role's messenger sets its own
        if self.tiers is not None:
            self.tiers.share = role.prefills

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """Every TP rank's KV cache, mapped into this (the lead) process; rank order."""
        return [self.kv_cache] + self._rank_caches

    @property
    def page_tensors(self) -> list[torch.Tensor]:
        """Every tensor [layers, pages, ...] that holds a part of each page, what the KV tiers copy a page
        of: each TP rank's cache, and an e4m3 cache's (as bytes) then each rank's scales."""
        if self.kv_region is None:
            return self.kv_caches
        return [c.view(torch.uint8) for c in self.kv_caches] + [self.model.kv_scales, *self._rank_scales]

    @property
    def kv_regions(self) -> list[torch.Tensor]:
        """What the transfer registers and moves for each TP rank: its KV cache, or an e4m3 cache's pages
        and scales in one region (transfer.plan.ShardSpec.region_bytes)."""
        if self.kv_region is None:
            return self.kv_caches
        return [self.kv_region] + (self.tp_group.regions if self.tp_group else [])

    def close(self) -> None:
        """Stop the TP rank processes (also done when the LLM is garbage-collected or at exit)."""
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = self.scheduler.tiers = None
        if self.config.world > 1:
            self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, prompt, params=None, request_id=None, output_ids=None, after=None, dp_rank=None):
        """Queue a request (EngineCore.add_request; dp_rank: DPFront.add_request's)."""
        return self.front.add_request(prompt, params, request_id, output_ids, after, dp_rank)

    def step(self) -> list[RequestOutput]:
        """Run one batch (every DP group's); the outputs it advanced or ended (EngineCore.step)."""
        return self.front.step()

    def has_unfinished(self) -> bool:
        return self.front.has_unfinished()

    def abort(self, request_id: str, error: str | None = None) -> None:
        """End a request now (finish_reason 'abort', or 'error' with a message) and free its pages."""
        self.front.abort(request_id, error)

    def output(self, request_id: str) -> RequestOutput:
        return self.core.output(request_id)

    # counters over every DP group
    pages = property(lambda self: self.front.pages)
    queues = property(lambda self: self.front.queues)
    prefix_cache_stats = property(lambda self: self.front.prefix_cache_stats)
    preemption_stats = property(lambda self: self.front.preemption_stats)
    grammar_compiles = property(lambda self: self.front.grammar_compiles)

    @property
    def config(self) -> EngineConfig:
        return self.core.config

    def generate(
        self,
        prompts: list[str | list[int]] | str,
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); outputs in prompt order."""
        prompts = [prompts] if isinstance(prompts, str) else prompts
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        families = [
            self.make_sequences(p, sp) for p, sp in zip(prompts, params, strict=True)
        ]  # checked first
        ids = {s.request_id for family in families for s in family}
        for family in families:
            for seq in family:
                self.front.submit(seq)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids) and self.has_unfinished():
            done.update((o.request_id, o) for o in self.step() if o.finished and o.request_id in ids)
        outs = []
        for family in families:
            out = done[family[0].request_id]
            if len(family) > 1:
                children = [done[s.request_id] for s in family]
                out.completions = [
                    CompletionOutput(i, c.text, c.token_ids, c.finish_reason, c.logprobs)
                    for i, c in enumerate(children)
                ]
            outs.append(out)
        return outs

    def make_sequences(self, prompt, params: SamplingParams | None = None, request_id: str | None = None):
        """make_sequence, and for params.n > 1 its n - 1 siblings ('<id>#1', ...; child i seeded seed + i)
        that start once the first one's prompt KV is computed, sharing its pages through the prefix
        cache (only the prompt's last partial page is computed again)."""
        first = self.front.make_sequence(prompt, params, request_id)
        p = first.params
        if p.n == 1:
            return [first]
        family = [first]
        for i in range(1, p.n):
            seed = None if p.seed is None else (p.seed + i) % (1 << 63)
            child = self.front.make_sequence(
                first.prompt_ids, replace(p, n=1, seed=seed), f"{first.request_id}#{i}"
            )
            child.prompt, child.after = first.prompt, first
            family.append(child)
        return family

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """generate() on one conversation ([{"role", "content"}, ...]) or a list of them, each rendered
        with the model's chat template (as vLLM's LLM.chat)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c) for c in conversations], params)

    def apply_chat_template(self, messages: list[dict] | str) -> str:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self.tokenizer.apply_chat_template(messages)

    # ---- counters -------------------------------------------------------------------------------------

    @property
    def kv_tier_stats(self) -> dict[str, dict]:
        """Per tier below device memory: hit tokens, bytes moved, loads and their time, evictions, pages
        dropped by a check, pages held (empty without tiers)."""
        return self.tiers.summary() if self.tiers is not None else {}

    def record_tier_events(self) -> None:
        """From now on keep the KV tiers' events (engine.kv.tiers.KVTiers.record_events; none without)."""
        if self.tiers is not None:
            self.tiers.record_events()

    def take_tier_events(self) -> list[tuple[str, bool, bytes]]:
        """(tier, stored?, page name) since the last call, for a router (empty without tiers)."""
        return self.tiers.take_events() if self.tiers is not None else []

    def take_tier_loads(self) -> list[tuple[float, float, str, int]]:
        """Loads from the tiers that ended since the last call: (start, end, main tier, pages)."""
        return self.tiers.take_loads() if self.tiers is not None else []

    def reset_prefix_cache(self) -> int:
        """Forget every cached page (vLLM's name): pages no request holds become free, pages in use stay
        with their requests, unnamed (pages they fill from now on are named). Returns how many names
        were dropped."""
        dropped = self.allocator.reset_cache()
        return dropped + (self.tiers.clear() if self.tiers is not None else 0)
