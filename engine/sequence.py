"""Requests as the engine tracks them: sampling parameters, per-sequence state, and what callers get back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Status(Enum):
    WAITING = "waiting"  # no KV computed yet (or preempted)
    RUNNING = "running"  # has pages; prefilling or decoding
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

    def __post_init__(self):
        if self.params.seed is not None:
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
        )
