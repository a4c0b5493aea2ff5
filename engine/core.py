"""The engine's core, under the LLM facade (engine/llm.py): a request's life inside one engine.

make_sequence checks and tokenizes a request; add_request queues it with the scheduler; step() takes the
scheduler's batch (engine/scheduler.py), runs it (the model runner, engine/runner.py), samples it
(engine/step_sampling.py) and post-processes each sequence: its new tokens, stop strings, EOS, grammar,
length; a finished request is handed back once. The decode role's hand-off is engine/decode_role.py's.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from engine.collectives import any_true
from engine.scheduler import Batch
from engine.sequence import RequestOutput, SamplingParams, Sequence, Status, check_token_ids
from engine.tp import RankDied

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    """One step: when it ran (perf_counter) and how many prompt and decode tokens it computed."""

    start: float
    end: float
    prefill_tokens: int
    decode_tokens: int  # decode tokens and their drafts
    verify_steps: int = 0  # sequences whose drafts this step verified
    # (tokens, first position) of each prompt chunk: what of its sequence it attends over before it
    prefill_chunks: tuple[tuple[int, int], ...] = ()
    decode_kv: int = 0  # KV positions the decode tokens attend over, summed over their sequences


class EngineCore:
    """One engine's request lifecycle: checking, queueing, stepping and post-processing. engine.LLM builds
    its parts (the model runner, the scheduler over the page allocator, the step's sampler) and holds it;
    the DP front (engine/front.py) and the decode role's hand-off (engine/decode_role.py) work through it."""

    def __init__(self, config, tokenizer, allocator, scheduler, runner, sampler, leads=None):
        """leads: the process group of every DP group's first rank (dp > 1), for each step's agreement."""
        self.config, self.tokenizer = config, tokenizer
        self.allocator, self.scheduler, self.runner, self.sampler = allocator, scheduler, runner, sampler
        self._leads = leads
        self.listener = None  # the prefill role's messenger (engine.llm.PrefillListener)
        self.counter: torch.Tensor | None = None  # the prefill role's layer counter
        self.drafter = None  # the MTP head, while the scheduler drafts with it
        self.seqs: dict[str, Sequence] = {}  # requests in flight (a finished one until step hands it back)
        self._ended: dict[str, Sequence] = {}  # finished, not yet handed back by step()
        self.last_step: StepStats | None = None  # what the latest step ran
        self._ids = itertools.count()
        self._grammars = None  # engine.structured.Grammars, on the first constrained request

    @property
    def grammars(self):
        """The engine's structured-output compiler (engine.structured.Grammars), built on first use."""
        if self._grammars is None:
            from engine.structured import Grammars

            model = self.config.arch
            self._grammars = Grammars(self.tokenizer, model.vocab_size, model.eos_token_ids)
        return self._grammars

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
        vocab = self.config.arch.vocab_size
        prompt_ids = (
            self.tokenizer.encode(prompt) if isinstance(prompt, str) else check_token_ids(prompt, vocab)
        )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty string, got {request_id!r}")
        context = self.config.arch.max_position
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= context:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the context holds {context} "
                f"(model.max_position), leaving no room to generate"
            )
        if request_id in self.seqs or self.allocator.pages(request_id):
            raise ValueError(
                f"request_id {request_id!r} is already in use (until forget, and until the pages of an "
                "earlier request of that id are released)"
            )
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
        return self.submit(self.prepare(prompt, params, request_id, output_ids, after))

    def prepare(self, prompt, params=None, request_id=None, output_ids=None, after=None) -> Sequence:
        """add_request's sequence, checked, not yet queued (after: linked when that one is here)."""
        if params is not None and params.n > 1:
            raise ValueError(
                f"n={params.n}: add_request takes one completion (generate takes n; or add each, with after)"
            )
        seq = self.make_sequence(prompt, params, request_id, output_ids)
        first = self.seqs.get(after) if after is not None else None
        if first is not None and first.prompt_ids == seq.prompt_ids and not output_ids:
            seq.after = first
        return seq

    def resume(self, seq: Sequence) -> None:
        """Decode role: a sequence that resumes with outputs (make_sequence's output_ids) waits, holding
        no pages, for its KV from a prefill worker: reserve(request_id=...) then admit_prefilled."""
        if seq.request_id in self.seqs:
            raise ValueError(f"request_id {seq.request_id!r} is already in use (until forget)")
        self.seqs[seq.request_id] = seq
        self.scheduler.resume(seq)

    def submit(self, seq: Sequence) -> str:
        """Queue a checked sequence (make_sequence's) with the scheduler; its request_id."""
        self.seqs[seq.request_id] = seq
        if self.drafter is not None:
            self.drafter.begin(seq)
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str, error: str | None = None) -> None:
        """End a request now (finish_reason 'abort', or 'error' with a message) and free its pages."""
        self._end(request_id, error, free_pages=True)

    def stop(self, request_id: str, error: str | None = None) -> None:
        """End a request now (finish_reason 'abort', or 'error') but keep its pages until they are released
        (engine/decode_role.py): a transfer may still be reading or writing them."""
        self._end(request_id, error, free_pages=False)

    def _end(self, request_id: str, error: str | None, free_pages: bool) -> None:
        seq = self.seqs.get(request_id)
        if seq is None or seq.finished:
            return
        self.scheduler.remove(seq, free_pages=free_pages)
        self._finish(seq, "error" if error else "abort", error)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record (its id can then be used again)."""
        seq = self.seqs.get(request_id)
        if seq is not None and seq.finished:
            del self.seqs[request_id]

    # ---- counters (this engine's; engine/front.py's DPFront sums every DP group's over these) ---------

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
        if batch is None and self.scheduler.landing:  # nothing to step but KV loading from below
            self.scheduler.tiers.wait(0.02)
        # data-parallel attention: the groups' first ranks agree whether any has a batch, and every
        # group's ranks join each MoE layer's all-to-all, a group without one with none (engine/dp.py)
        if self.config.dp > 1 and any_true(batch is not None, self._leads) and batch is None:
            self.runner.idle()
        if batch is not None:
            start = time.perf_counter()
            self._run(batch)
            end = time.perf_counter()
            decoding, prompts = [], []  # a decode token (and its drafts) per sequence; prompt chunks
            for c in batch.chunks:
                if c.samples and c.num_tokens == 1 + len(c.drafts):
                    decoding.append(c)
                else:
                    prompts.append((c.num_tokens, c.start))
            decode = sum(c.num_tokens for c in decoding)
            verify = sum(1 for c in decoding if c.drafts)
            kv = sum(c.start + c.num_tokens for c in decoding)
            prefill = batch.num_tokens - decode
            self.last_step = StepStats(start, end, prefill, decode, verify, tuple(prompts), kv)
            if self.scheduler.budget is not None:  # the step-time model the budget sizes steps by
                s = self.last_step
                self.scheduler.budget.observe(decode, s.prefill_tokens, s.end - s.start)
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
        tokens, verified, logprobs, failed = self.sampler.sample(sampling, rows, plain, out.logits)
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
            elif not self.scheduler.role.samples and seq.num_computed == self.scheduler.target(seq):
                self.scheduler.remove(seq, free_pages=False)
                self._prefilled(seq, out.last_hidden[i])

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
        p, model = seq.params, self.config.arch
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
        if self.scheduler.role.samples:
            self.abort(seq.request_id, error)
            return
        self.stop(seq.request_id, error)  # a prefill request's pages wait for the messenger's release
        if self.listener is not None:
            self.listener.on_failed(seq, error)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.status, seq.finish_reason, seq.error = Status.FINISHED, reason, error
        self._ended[seq.request_id] = seq
