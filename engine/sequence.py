"""Requests as the engine tracks them: sampling parameters, per-sequence state, and what callers get back."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from engine.fair import check_client
from engine.structured import StructuredOutputs

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # the most tokens it generates
    temperature: float = 0.0  # 0: greedy; else in [0.01, 100]
    top_p: float = 1.0  # nucleus sampling's probability mass (1: off)
    top_k: int = 0  # the likeliest k tokens only (0: off)
    seed: int | None = None  # its sampling's seed (None: random)
    stop: tuple[str, ...] = ()  # strings that end it (not included, unless include_stop_str_in_output)
    ignore_eos: bool = False  # run to max_tokens through EOS and stop_token_ids
    # vLLM's: penalties on tokens already there (presence/frequency: the output's; repetition: prompt and
    # output), min_p (relative to the likeliest token), no EOS/stop before min_tokens, logit_bias added
    # to the logits (token id -> bias in [-100, 100]), stop_token_ids that end it like EOS
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0  # in [-2, 2], per time a token is already in the output
    repetition_penalty: float = 1.0  # in [0.01, 100], on tokens in the prompt or output (1: off)
    min_p: float = 0.0  # drop tokens below min_p x the likeliest token's probability (0: off)
    min_tokens: int = 0  # no EOS or stop before this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100], added to its logit
    stop_token_ids: tuple[int, ...] = ()  # tokens that end it as EOS does
    include_stop_str_in_output: bool = False  # keep the stop string that ended it in its text
    logprobs: int | None = None  # the sampled token's log-probability and this many of the likeliest
    structured_outputs: StructuredOutputs | None = None  # a JSON schema, regex, choice or grammar to keep to
    n: int = 1  # completions of the prompt: computed once, its pages shared (child i seeded seed + i)
    cache_salt: str | None = None  # prefix-cache pages are shared only among requests of the same salt
    # who it is for (engine/fair.py): sender, then user; workers admit by each client's share of what runs
    client: tuple[str, ...] | None = None

    def __post_init__(self):
        _integer("max_tokens", self.max_tokens, 1, "an integer >= 1")
        _number("temperature", self.temperature)
        if self.temperature != 0 and not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                f"got {self.temperature}"
            )
        _number("top_p", self.top_p)
        if not MIN_TOP_P <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [{MIN_TOP_P}, 1], got {self.top_p}")
        _integer("top_k", self.top_k, 0, "an integer >= 0 (0 turns it off)")
        if self.seed is not None:
            _integer("seed", self.seed, 0, "None or an integer in [0, 2**63)", 1 << 63)
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
            raise TypeError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        for key in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, key), bool):
                raise TypeError(f"{key} must be a bool, got {getattr(self, key)!r}")
        for key in ("presence_penalty", "frequency_penalty"):
            _number(key, getattr(self, key))
            if not -2 <= getattr(self, key) <= 2:
                raise ValueError(f"{key} must be in [-2, 2], got {getattr(self, key)}")
        _number("repetition_penalty", self.repetition_penalty)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}] "
                f"(1: off), got {self.repetition_penalty}"
            )
        _number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _integer("min_tokens", self.min_tokens, 0, f"an integer in [0, max_tokens={self.max_tokens}]")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        bias = self.logit_bias or {}
        if not isinstance(bias, dict):
            raise TypeError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
        for token, value in bias.items():
            _integer("logit_bias keys", token, 0, "token ids (integers >= 0)")
            _number(f"logit_bias[{token}]", value)
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {value}")
        object.__setattr__(self, "logit_bias", {t: float(v) for t, v in bias.items()} or None)
        ids = self.stop_token_ids or ()
        if not isinstance(ids, list | tuple):
            raise TypeError(f"stop_token_ids must be a list of token ids, got {ids!r}")
        for t in ids:
            _integer("stop_token_ids", t, 0, "a list of token ids (integers >= 0)")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs", StructuredOutputs(**self.structured_outputs))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise TypeError(
                f"structured_outputs must be StructuredOutputs or a dict, got {self.structured_outputs!r}"
            )
        _integer("n", self.n, 1, f"an integer in [1, {MAX_N}]", MAX_N + 1)
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT
        ):
            raise ValueError(f"cache_salt must be None or a string of 1-{MAX_CACHE_SALT} characters")
        object.__setattr__(self, "client", check_client(self.client))
        if self.logprobs is not None:
            _integer(
                "logprobs", self.logprobs, 0, f"None or an integer in [0, {MAX_LOGPROBS}]", MAX_LOGPROBS + 1
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the model's logits before the pick (penalties, bias, min_tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )


MAX_N = 64  # completions one request may ask for
# Bounds that keep the sampler's arithmetic finite in fp32: logits over a temperature of 1e-300 (or a
# repetition penalty of 1e-300) are infinities, and their softmax NaN. vLLM raises temperatures under
# 0.01 to 0.01; we refuse them instead, naming the bound (docs/serving.md). The sampler keeps the likeliest
# token whatever top_p rounds to, and one sequence whose sampling still fails ends alone (LLM._sample).
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0
MIN_TOP_P = 1e-6  # 1e-300 is 0 in fp32: every token was dropped
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_CACHE_SALT = 256  # characters of a cache_salt
MAX_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's top_logprobs bound)


def _integer(name: str, value, low: int, allowed: str, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {allowed}, got {value!r}")
    if value < low or (high is not None and value >= high):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")


def check_token_ids(prompt_ids, vocab_size: int) -> list[int]:
    """prompt_ids as a list of ints in [0, vocab_size); TypeError/ValueError naming the first bad one."""
    if not isinstance(prompt_ids, list | tuple):
        raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt_ids).__name__}")
    for i, t in enumerate(prompt_ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"prompt token ids must be ints; prompt[{i}] is {t!r}")
        if not 0 <= t < vocab_size:
            raise ValueError(
                f"prompt token ids must be in [0, {vocab_size}) (the vocabulary); prompt[{i}] is {t}"
            )
    return list(prompt_ids)


class Status(Enum):
    """Where a sequence is in its engine's scheduler (engine/scheduler.py). Its two queues hold WAITING and
    RUNNING sequences; the others wait out of both (Scheduler.aside) for KV that comes from elsewhere: a
    prefill worker's writes, or pages loading from below device memory. The decode role's states are the
    engine's side of the hand-off (transfer/handoff.py has the messenger's; docs/handoff.md both)."""

    WAITING = "waiting"  # queued: no KV computed yet, preempted, or holding pages it waits to grow
    RUNNING = "running"  # has pages; prefilling or decoding
    LOADING = "loading"  # admitted: its leading pages load from below device memory; it computes the rest
    AWAITING_KV = "awaiting kv"  # decode role: pages pinned for the KV a prefill worker writes
    AWAITING_LOADS = "awaiting loads"  # decode role: the KV sent landed; it decodes once its loads land
    REFETCH = "refetch"  # decode role: preempted, KV dropped; for the worker to take (take_refetches)
    REFETCHING = "refetching"  # decode role: taken; waits to reserve pages for its KV, fetched again
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    status: Status = Status.WAITING
    arrival_time: float = field(default_factory=time.perf_counter)
    scheduled_time: float | None = None  # first put in a batch (queueing ends)
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    generator: torch.Generator | None = None
    detokenizer: object | None = None  # engine.tokenizer.TextStream: text grows one token at a time
    num_drafted: int = 0  # speculative decoding: tokens proposed for it, accepted, and verify steps
    num_accepted: int = 0
    num_verifies: int = 0
    draft: object | None = None  # the draft head's state for this request (engine.mtp.HeadState)
    admitted_at: int = 0  # its length when last admitted: the scheduler's page guarantee counts from it
    recompute_until: int = 0  # positions whose KV was computed before a preemption dropped it
    num_cached_tokens: int | None = None  # prompt tokens whose KV came from the prefix cache (first start)
    page_hashes: list[bytes] = field(default_factory=list, repr=False)  # names of its full pages so far
    pages_named: int = 0  # its leading pages the prefix cache knows by name
    logprobs: list[dict] = field(default_factory=list, repr=False)  # per output token (params.logprobs)
    grammar: object | None = field(default=None, repr=False)  # xgrammar matcher (params.structured_outputs)
    after: Sequence | None = field(default=None, repr=False)  # n > 1: the sibling whose prompt KV it shares
    load: object | None = field(default=None, repr=False)  # pages loading from below (engine.kv.tiers.Load)

    def __post_init__(self):
        if self.params.seed is not None:
            import torch  # here, not at import: the server's front reads requests without torch

            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class CompletionOutput:
    """One completion of a request, as vLLM shapes it (`RequestOutput.outputs[0]`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict] | None = None  # per token: {token id: engine.sampler.Logprob}, the picked first


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    error: str | None
    arrival_time: float
    token_times: list[float]  # perf_counter time of each output token
    scheduled_time: float | None = None  # its first forward pass
    num_drafted_tokens: int = 0  # speculative decoding: drafts proposed and accepted, and the steps
    num_accepted_tokens: int = 0  # that verified them
    num_verify_steps: int = 0
    num_cached_tokens: int | None = None  # prompt tokens whose KV came from the prefix cache (vLLM's name)
    logprobs: list[dict] | None = None  # SamplingParams.logprobs: per output token, as CompletionOutput's
    completions: list[CompletionOutput] | None = None  # n > 1 (LLM.generate): every completion

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape: the completions, `outputs[0]` the first (the only one when n = 1)."""
        if self.completions is not None:
            return self.completions
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.logprobs)]

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @staticmethod
    def of(seq: Sequence) -> RequestOutput:
        return RequestOutput(
            seq.request_id,
            seq.prompt,
            list(seq.prompt_ids),
            seq.text,
            list(seq.output_ids),
            seq.finished,
            seq.finish_reason,
            seq.error,
            seq.arrival_time,
            list(seq.token_times),
            seq.scheduled_time,
            seq.num_drafted,
            seq.num_accepted,
            seq.num_verifies,
            seq.num_cached_tokens,
            list(seq.logprobs) if seq.params.logprobs is not None else None,
        )
