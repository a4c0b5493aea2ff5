"""The engine's API: LLM(model=...).generate(prompts, SamplingParams(...)), plus the role hooks.

Roles (see scheduler.py): ``colocated`` serves whole requests; ``prefill`` computes the KV of the
tokens it is given (a prompt without its last token), never samples, tells its listener each batch
before the forward pass, and keeps a request's pages until ``release``; ``decode`` additionally
``reserve``s pinned pages for that KV and ``admit_prefilled`` starts decoding once they are filled,
running the last prompt token as the first decode step.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.decode_role import DecodeHandoff
from engine.graphs import DecodeGraphs
from engine.kv_cache import PageAllocator, allocate_kv_cache
from engine.model import Model, Shard
from engine.mtp import MTPDrafter, load_head_weights
from engine.runner import ModelRunner
from engine.scheduler import Batch, Scheduler
from engine.sequence import (
    CompletionOutput,
    RequestOutput,
    SamplingParams,
    Sequence,
    Status,
    check_token_ids,
)
from engine.speculative import SpeculativeConfig, ngram_drafts
from engine.step_sampling import StepSampling
from engine.tp import RankDied, TPGroup
from engine.weights import load_model
from pdkernels.out_proj import make_layer_counter

log = logging.getLogger(__name__)


class PrefillListener(Protocol):
    """What the prefill role tells the messenger."""

    def on_batch(self, batch: Batch, counter: torch.Tensor) -> None: ...  # before the forward pass

    def on_prefilled(self, seq: Sequence, last_hidden: torch.Tensor) -> None: ...  # all its KV computed

    def on_failed(self, seq: Sequence, error: str) -> None: ...  # its step raised: no KV will come


@dataclass(frozen=True)
class StepStats:
    """One step: when it ran (perf_counter) and how many prompt and decode tokens it computed."""

    start: float
    end: float
    prefill_tokens: int
    decode_tokens: int  # decode tokens and their drafts
    verify_steps: int = 0  # sequences whose drafts this step verified


class LLM(DecodeHandoff, StepSampling):
    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        tp: int = 1,
        page_size: int = 16,
        num_pages: int = 1024,
        device: str = "cpu",
        dtype: str = "float32",
        role: str = "colocated",
        kv_layout: str = "HND",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        seed: int = 0,
        listener: PrefillListener | None = None,
        cuda_graphs: bool | None = None,
        speculative_config: dict | SpeculativeConfig | None = None,
        reserved_tokens: int | None = 512,
        preemption: str = "recompute",
        enable_prefix_caching: bool = True,
        expert_parallel: bool = False,
        fair_share: bool = True,
    ):
        """cuda_graphs: replay decode steps as CUDA graphs (engine.graphs); None: on CUDA with tp 1 outside
        the prefill role (which never decodes). One page is kept back as the padding rows' scratch page.
        reserved_tokens, preemption, fair_share: admission with room to finish, what a preempted
        decode-role sequence does, and each request's share of the cache (engine.config.SchedulerConfig).
        enable_prefix_caching: share the KV of leading full pages between requests (engine/kv_cache.py;
        vLLM's name and default). expert_parallel: an MoE model under TP holds whole experts per rank
        (engine/moe.py) instead of a slice of each."""
        loaded = load_model(model)
        self.config = EngineConfig(
            model=loaded.config,
            cache=CacheConfig(page_size, num_pages, kv_layout, enable_prefix_caching),
            scheduler=SchedulerConfig(
                role, max_num_seqs, max_num_batched_tokens, reserved_tokens, preemption, fair_share
            ),
            device=device,
            dtype=dtype,
            tp=tp,
            seed=seed,
            expert_parallel=expert_parallel,
        )
        torch.manual_seed(seed)
        self.tokenizer = loaded.tokenizer
        dev = torch.device(device)
        shard = Shard.of(loaded.config, 0, tp, expert_parallel)
        self.tp_group = TPGroup(model, self.config) if tp > 1 else None
        if self.tp_group is not None:
            self._finalizer = weakref.finalize(self, self.tp_group.close)
        self.model = Model(loaded.config, loaded.weights, dev, self.config.torch_dtype, shard)
        kv_cache = allocate_kv_cache(
            loaded.config, self.config.cache, shard.num_kv_heads, dev, self.config.torch_dtype
        )
        self.kv_cache = kv_cache.share_memory_() if tp > 1 and dev.type == "cpu" else kv_cache
        # MoE: the experts' grouping reads counts on the host, which a capture cannot; MLA: its decode
        # path has not been captured on a GPU yet
        moe, mla = loaded.config.moe is not None, loaded.config.mla is not None
        if cuda_graphs is None:
            cuda_graphs = dev.type == "cuda" and tp == 1 and role != "prefill" and not (moe or mla)
        if cuda_graphs and (dev.type != "cuda" or tp != 1 or num_pages < 2 or moe or mla):
            raise ValueError(
                "cuda_graphs=True needs device='cuda', tp=1, num_pages >= 2 and a model without MoE or MLA "
                f"layers; got device={device!r}, tp={tp}, num_pages={num_pages}, moe={moe}, mla={mla}"
            )
        # with graphs, the last page is the padding rows' scratch page: never allocated
        self.allocator = PageAllocator(num_pages - 1 if cuda_graphs else num_pages, page_size)
        salt = f"{loaded.config.name}|{dtype}|{page_size}".encode() if enable_prefix_caching else None
        self.scheduler = Scheduler(self.config.scheduler, self.allocator, loaded.config.max_position, salt)
        # speculative decoding (vLLM's names: {"method": "ngram" | "mtp", "num_speculative_tokens": k, ...})
        # (a prefill-role engine given one builds its drafter too: set_role may make it decode)
        self.speculative = SpeculativeConfig.of(speculative_config)
        self.drafter: MTPDrafter | None = None  # the MTP head, while the scheduler drafts with it
        self._drafter: MTPDrafter | None = None
        self._propose = None  # what the scheduler proposes drafts with outside the prefill role
        if self.speculative is not None:
            s = self.speculative
            if s.method == "mtp":
                head = load_head_weights(s.model, loaded.config, loaded.weights, seed)
                self._drafter = MTPDrafter(self.model, head, s.num_speculative_tokens)
                self._propose = self._drafter.propose
            else:
                self._propose = lambda seq: ngram_drafts(
                    seq.all_ids, s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max
                )
        self._wire_drafts()
        self.runner = ModelRunner(self.model, self.kv_cache, page_size, kv_layout, self.tp_group)
        if cuda_graphs:
            self.runner.graphs = DecodeGraphs(
                self.model, self.kv_cache, page_size, num_pages - 1, max_num_seqs
            )
        self.listener = listener
        self.counter = make_layer_counter(loaded.config.num_layers, dev) if role == "prefill" else None
        self.seqs: dict[str, Sequence] = {}  # requests in flight (a finished one until step hands it back)
        self._ended: dict[str, Sequence] = {}  # finished, not yet handed back by step()
        self.last_step: StepStats | None = None  # what the latest step ran
        self._ids = itertools.count()
        self._grammars = None  # engine.structured.Grammars, on the first constrained request

    def _wire_drafts(self) -> None:
        """The scheduler proposes drafts in the decode and colocated roles, when speculation is set."""
        drafting = self._propose is not None and self.scheduler.role != "prefill"
        self.scheduler.propose = self._propose if drafting else None
        self.drafter = self._drafter if drafting else None
        # the MTP head reads the hidden state before the last token
        self.scheduler.min_compute = 2 if self.drafter is not None else 1

    def set_role(self, role: str) -> None:
        """Serve another role from now on (an elastic worker: prefill <-> decode), keeping the weights, the
        KV cache's memory and what the prefix cache holds. Only between requests: every one must have
        ended and been handed back by step() (ValueError otherwise). The prefill role gets its layer
        counter here; a decode role reached this way replays no CUDA graphs (none were captured)."""
        if role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"role={role!r} is not allowed: one of ('prefill', 'decode', 'colocated')")
        if self.seqs or self.has_unfinished() or self.scheduler.reserved or self.scheduler.refetching:
            raise ValueError(f"set_role({role!r}) needs an idle engine; {len(self.seqs)} requests are here")
        config = replace(self.config.scheduler, role=role)
        self.config = replace(self.config, scheduler=config)
        self.scheduler.config = config
        self._wire_drafts()
        if role == "prefill" and self.counter is None:
            self.counter = make_layer_counter(self.config.model.num_layers, self.kv_cache.device)
        self.listener = None  # the new role's messenger sets its own

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """Every TP rank's KV cache, mapped into this (the lead) process; rank order."""
        return [self.kv_cache] + (self.tp_group.kv_caches if self.tp_group else [])

    def close(self) -> None:
        """Stop the TP rank processes (also done when the LLM is garbage-collected or at exit)."""
        if self.tp_group is not None:
            self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- requests -------------------------------------------------------------------------------

    def make_sequence(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        output_ids: list[int] | None = None,
    ) -> Sequence:
        """Tokenize and check a request (raises ValueError or TypeError naming the problem). output_ids:
        tokens it already generated elsewhere (a request migrated from a worker that died): it resumes
        after them, its text and stop strings as if it had generated them here."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        vocab = self.config.model.vocab_size
        prompt_ids = (
            self.tokenizer.encode(prompt) if isinstance(prompt, str) else check_token_ids(prompt, vocab)
        )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty string, got {request_id!r}")
        context = self.config.model.max_position
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= context:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the context holds {context} "
                f"(model.max_position), leaving no room to generate"
            )
        if request_id in self.seqs:
            raise ValueError(f"request_id {request_id!r} is already in use (until forget)")
        for t in (*(params.logit_bias or ()), *params.stop_token_ids):
            if t >= vocab:
                raise ValueError(f"logit_bias and stop_token_ids take token ids in [0, {vocab}); got {t}")
        need = self.allocator.pages_for(min(len(prompt_ids) + params.max_tokens, context))
        if need > self.allocator.num_pages:
            raise ValueError(
                f"num_pages={self.allocator.num_pages} is too few for one request: this one needs "
                f"{need} pages of {self.allocator.page_size} tokens"
            )
        seq = Sequence(request_id, prompt_ids, params, prompt=prompt if isinstance(prompt, str) else None)
        seq.detokenizer = self.tokenizer.stream()
        if params.structured_outputs is not None:
            seq.grammar = self.grammars.matcher(params.structured_outputs)
        if output_ids:
            outputs = check_token_ids(output_ids, vocab)
            if len(outputs) >= params.max_tokens or len(prompt_ids) + len(outputs) >= context:
                raise ValueError(
                    f"{len(outputs)} tokens already generated leave nothing to generate (max_tokens "
                    f"{params.max_tokens}, context {context})"
                )
            seq.output_ids = outputs
            seq.text = "".join(seq.detokenizer.step(t) for t in outputs)
            if seq.grammar is not None and not all(seq.grammar.accept_token(t) for t in outputs):
                raise ValueError("output_ids do not keep to the request's structured_outputs")
        return seq

    @property
    def grammars(self):
        """The engine's structured-output compiler (engine.structured.Grammars), built on first use."""
        if self._grammars is None:
            from engine.structured import Grammars

            model = self.config.model
            self._grammars = Grammars(self.tokenizer, model.vocab_size, model.eos_token_ids)
        return self._grammars

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        output_ids: list[int] | None = None,
        after: str | None = None,
    ) -> str:
        """Queue a request (output_ids: make_sequence's; computed here with the prompt). after: the
        request_id of an earlier completion of the same prompt (n > 1, fanned out by the caller): this
        one starts once that one's prompt KV is computed, sharing its pages through the prefix cache."""
        if params is not None and params.n > 1:
            raise ValueError(
                f"n={params.n}: add_request takes one completion (generate takes n; or add each, with after)"
            )
        seq = self.make_sequence(prompt, params, request_id, output_ids)
        first = self.seqs.get(after) if after is not None else None
        if first is not None and first.prompt_ids == seq.prompt_ids and not output_ids:
            seq.after = first
        return self._submit(seq)

    def resume(self, seq: Sequence) -> None:
        """Decode role: a sequence that resumes with outputs (make_sequence's output_ids) waits, holding
        no pages, for its KV from a prefill worker: reserve(request_id=...) then admit_prefilled."""
        if seq.request_id in self.seqs:
            raise ValueError(f"request_id {seq.request_id!r} is already in use (until forget)")
        self.seqs[seq.request_id] = seq
        self.scheduler.refetching[seq.request_id] = seq

    def _submit(self, seq: Sequence) -> str:
        self.seqs[seq.request_id] = seq
        if self.drafter is not None:
            self.drafter.begin(seq)
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str, error: str | None = None) -> None:
        """End a request now (finish_reason 'abort', or 'error' with a message) and free its pages."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.finished:
            return
        self.scheduler.remove(seq)
        self._finish(seq, "error" if error else "abort", error)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record (its id can then be used again)."""
        seq = self.seqs.get(request_id)
        if seq is not None and seq.finished:
            del self.seqs[request_id]

    def has_unfinished(self) -> bool:
        """Work left for step(): sequences to run, or finished ones it has not handed back yet."""
        return self.scheduler.has_work() or bool(self._ended)

    def output(self, request_id: str) -> RequestOutput:
        """A request still in flight (step() hands back each finished one once, then forgets it)."""
        return RequestOutput.of(self.seqs[request_id])

    # ---- stepping --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return the outputs of the sequences it advanced and of every request that
        finished since the last step (aborted, stopped or failed ones too). A finished request is handed
        back once and then forgotten."""
        batch = self.scheduler.schedule()
        if batch is not None:
            start = time.perf_counter()
            self._run(batch)
            decoding = [c for c in batch.chunks if c.samples and c.num_tokens == 1 + len(c.drafts)]
            decode = sum(c.num_tokens for c in decoding)
            verify = sum(1 for c in decoding if c.drafts)
            self.last_step = StepStats(start, time.perf_counter(), batch.num_tokens - decode, decode, verify)
        seqs = {c.seq.request_id: c.seq for c in batch.chunks} if batch is not None else {}
        seqs.update(self._ended)
        self._ended.clear()
        outputs = [RequestOutput.of(seq) for seq in seqs.values()]
        for out in outputs:
            if out.finished and self.seqs.get(out.request_id) is seqs[out.request_id]:
                del self.seqs[out.request_id]
        return outputs

    def _run(self, batch: Batch) -> None:
        sampling = [c for c in batch.chunks if c.samples]
        try:
            if self.listener is not None:
                self.listener.on_batch(batch, self.counter)
            out = self.runner.run(batch, self.counter)
            # rows: one per plain sampling chunk; 1 + len(drafts) for a chunk with drafts (last in order)
            plain, rows, r = [], [], 0
            for c in sampling:
                rows.append((r, r + 1 + len(c.drafts)))
                if not c.drafts:
                    plain.append(r)
                r += 1 + len(c.drafts)
        except RankDied:  # not this step's fault: the engine itself is gone, and its caller must know
            raise
        except Exception as e:  # the step's sequences fail with the error; the engine serves on
            log.exception("a step failed; its %d sequences end with the error", len(batch.chunks))
            for chunk in batch.chunks:
                self._fail(chunk.seq, f"engine step failed: {e!r}")
            return
        tokens, verified, logprobs, failed = self._sample(sampling, rows, plain, out.logits)
        now, sampled, row = time.perf_counter(), iter(tokens), 0
        for i, chunk in enumerate(batch.chunks):
            seq = chunk.seq
            if id(chunk) in failed:  # its own parameters failed the sampler: it ends, the others go on
                row += chunk.num_tokens
                if not chunk.drafts:
                    next(sampled)
                self._fail(seq, f"sampling failed: {failed[id(chunk)]!r}")
                continue
            seq.num_computed = chunk.end
            if chunk.samples and chunk.drafts:  # rejected drafts' KV is void
                seq.num_computed = chunk.end - len(chunk.drafts) + verified[id(chunk)][1]
            self.scheduler.computed(seq)
            row += chunk.num_tokens
            if self.drafter is not None:  # the target's hidden states at the positions now confirmed
                confirmed = chunk.num_tokens - len(chunk.drafts) + verified.get(id(chunk), (0, 0))[1]
                self.drafter.observe(seq, chunk.start, out.hidden[row - chunk.num_tokens :][:confirmed])
            if chunk.samples and chunk.drafts:
                new, accepted = verified[id(chunk)]
                seq.num_drafted += len(chunk.drafts)
                seq.num_accepted += accepted
                seq.num_verifies += 1
                for j, token in enumerate(new):
                    self._append_token(seq, token, now, logprobs.get(id(chunk), {}).get(j))
                    if seq.finished:
                        break
                if not seq.finished:  # pages past its length (rejected drafts) go back
                    self.allocator.shrink(seq.request_id, seq.num_tokens)
            elif chunk.samples:
                self._append_token(seq, next(sampled), now, logprobs.get(id(chunk), {}).get(0))
            elif self.scheduler.role == "prefill" and seq.num_computed == self.scheduler.target(seq):
                self.scheduler.remove(seq, free_pages=False)
                self._prefilled(seq, out.last_hidden[i])

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
                self._submit(seq)
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
        first = self.make_sequence(prompt, params, request_id)
        p = first.params
        if p.n == 1:
            return [first]
        family = [first]
        for i in range(1, p.n):
            seed = None if p.seed is None else (p.seed + i) % (1 << 63)
            child = self.make_sequence(
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
    def preemption_stats(self) -> dict[str, int]:
        """Preemptions so far, and the tokens whose KV they dropped: computed again here or refetched."""
        s = self.scheduler
        return {
            "preemptions": s.num_preemptions,
            "recomputed_tokens": s.num_recomputed_tokens,
            "refetched_tokens": s.num_refetched_tokens,
        }

    @property
    def prefix_cache_stats(self) -> dict[str, int]:
        """Prompt tokens looked up in the prefix cache and found there; pages cached and evicted."""
        s, a = self.scheduler, self.allocator
        return {
            "queries": s.num_prefix_queries,
            "hits": s.num_prefix_hits,
            "cached_pages": a.num_cached,
            "evicted_pages": a.num_evicted,
        }

    def reset_prefix_cache(self) -> int:
        """Forget every cached page (vLLM's name): pages no request holds become free, pages in use stay
        with their requests, unnamed (pages they fill from now on are named). Returns how many names
        were dropped."""
        return self.allocator.reset_cache()

    # ---- internals -------------------------------------------------------------------------------------

    def _prefilled(self, seq: Sequence, last_hidden: torch.Tensor) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, "prefilled"
        if self.listener is not None:
            self.listener.on_prefilled(seq, last_hidden)

    def _append_token(self, seq: Sequence, token: int, now: float, logprob: dict | None = None) -> None:
        seq.output_ids.append(token)
        seq.token_times.append(now)
        if logprob is not None:
            seq.logprobs.append(logprob)
        p, model = seq.params, self.config.model
        if seq.grammar is not None and not seq.grammar.accept_token(token):
            self.scheduler.remove(seq)
            self._finish(seq, "error", f"token {token} breaks the request's structured_outputs")
            return
        grown = len(seq.text)
        seq.text += seq.detokenizer.step(token)
        # a stop string can only end in the new text: look from where it could start (after min_tokens)
        hits = [] if len(seq.output_ids) <= p.min_tokens else p.stop
        stop_at, stop = min(
            ((i, s) for i, s in ((seq.text.find(s, max(0, grown - len(s) + 1)), s) for s in hits) if i >= 0),
            default=(-1, ""),
        )
        if stop_at >= 0:
            seq.text = seq.text[: stop_at + (len(stop) if p.include_stop_str_in_output else 0)]
            reason = "stop"
        elif (not p.ignore_eos and token in model.eos_token_ids) or token in p.stop_token_ids:
            reason = "stop"
        elif seq.grammar is not None and seq.grammar.is_terminated():  # its grammar's end (ignore_eos too)
            reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= model.max_position:
            reason = "length"
        else:
            return
        self.scheduler.remove(seq)
        self._finish(seq, reason)

    def _fail(self, seq: Sequence, error: str) -> None:
        if self.scheduler.role != "prefill":
            self.abort(seq.request_id, error)
            return
        self.stop(seq.request_id, error)  # a prefill request's pages wait for the messenger's release
        if self.listener is not None:
            self.listener.on_failed(seq, error)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.status, seq.finish_reason, seq.error = Status.FINISHED, reason, error
        self._ended[seq.request_id] = seq
