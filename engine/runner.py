"""Runs one scheduled batch through the model: builds the page-table tensors, calls forward, picks rows."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor

from engine.model import BatchMeta, Model
from engine.scheduler import Batch
from pdkernels._paging import check_page_table


@dataclass
class StepOutput:
    logits: Tensor  # [rows, vocab] fp32: per sampling chunk its last row (1 + drafts rows with drafts)
    last_hidden: Tensor  # [chunks, hidden]: the hidden state at each chunk's last token
    hidden: Tensor  # [tokens, hidden]: every row's final hidden state (the MTP draft head reads them)


class ModelRunner:
    def __init__(self, model: Model, kv_cache: Tensor, page_size: int, kv_layout: str = "HND", tp_group=None):
        self.model, self.kv_cache, self.page_size, self.kv_layout = model, kv_cache, page_size, kv_layout
        self.tp_group = tp_group  # ranks 1..N-1 mirror each forward pass
        self.graphs = None  # engine.graphs.DecodeGraphs: decode steps replayed as CUDA graphs

    def meta(self, batch: Batch, counter: Tensor | None = None) -> tuple[Tensor, BatchMeta]:
        """input_ids [T] and the BatchMeta of a batch (checked once here; the layers skip the checks)."""
        ids, positions, batch_indices, qo, kv_indptr, kv_indices, last = [], [], [], [0], [0], [], []
        for b, c in enumerate(batch.chunks):
            ids += c.token_ids
            positions += range(c.start, c.end)
            batch_indices += [b] * c.num_tokens
            qo.append(qo[-1] + c.num_tokens)
            kv_indices += c.pages
            kv_indptr.append(len(kv_indices))
            last.append(c.end - (len(c.pages) - 1) * self.page_size)
        dev = self.kv_cache.device

        def i32(x):
            return torch.tensor(x, dtype=torch.int32, device=dev)

        meta = BatchMeta(
            positions=i32(positions),
            batch_indices=i32(batch_indices),
            qo_indptr=i32(qo),
            kv_indptr=i32(kv_indptr),
            kv_indices=i32(kv_indices),
            kv_last_page_len=i32(last),
            all_decode=all(c.num_tokens == 1 for c in batch.chunks),
            counter=counter,
            max_q_len=max((c.num_tokens for c in batch.chunks), default=0),
            max_kv_len=max((c.end for c in batch.chunks), default=0),
        )
        check_page_table(
            meta.kv_indptr,
            meta.kv_indices,
            meta.kv_last_page_len,
            self.kv_cache.shape[1],
            self.page_size,
            dev,
        )
        return torch.tensor(ids, dtype=torch.long, device=dev), meta

    @torch.inference_mode()
    def warm_up(self, lengths: list[int], pages: list[list[int]], counter: Tensor | None = None) -> None:
        """One eager pass of dummy prompts of these lengths from position 0, each written into its pages
        (which the caller owns and then frees), so that the kernels compile before the first request
        rather than inside its time to first token (on an H200 the 1P1D prefill worker's first pass
        took 0.85 s, the next ones 0.06 s). counter: a scratch one, for the out_proj that bumps it."""
        chunks = [
            SimpleNamespace(token_ids=[0] * n, start=0, end=n, num_tokens=n, pages=own)
            for n, own in zip(lengths, pages, strict=True)
        ]
        ids, meta = self.meta(SimpleNamespace(chunks=chunks), counter)
        hidden = self.model.forward(ids, meta, self.kv_cache)
        self.model.logits(hidden[meta.qo_indptr[1:].long() - 1])
        dev = self.kv_cache.device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    @torch.inference_mode()
    def idle(self) -> None:
        """Data-parallel attention: a step without tokens here (engine/dp.py); its ranks join the
        all-to-alls of the groups that have some."""
        if self.tp_group is not None:
            self.tp_group.idle()
        self.model.idle()

    @torch.inference_mode()
    def run(self, batch: Batch, counter: Tensor | None = None) -> StepOutput:
        chunks = batch.chunks
        if (
            self.graphs is not None
            and counter is None
            and all(c.num_tokens == 1 for c in chunks)
            and self.graphs.bucket(len(chunks)) is not None
        ):
            hidden = self.graphs.run(
                [c.seq.all_ids[c.start] for c in chunks], [c.start for c in chunks], [c.pages for c in chunks]
            )
            sampling = [i for i, c in enumerate(chunks) if c.samples]
            hidden = hidden.clone()
            return StepOutput(self.model.logits(hidden[sampling]), hidden, hidden)
        input_ids, meta = self.meta(batch, counter)
        if self.tp_group is not None:
            self.tp_group.step(input_ids, meta)
        hidden = self.model.forward(input_ids, meta, self.kv_cache)
        last = meta.qo_indptr[1:].long() - 1
        rows, start = [], 0  # a sampling chunk's last row; with drafts, its decode token's and theirs too
        for c in batch.chunks:
            if c.samples:
                rows += range(start + c.num_tokens - 1 - len(c.drafts), start + c.num_tokens)
            start += c.num_tokens
        return StepOutput(self.model.logits(hidden[rows]), hidden[last], hidden)
