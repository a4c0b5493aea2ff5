"""Decode steps as CUDA graphs: one graph per batch-size bucket, captured at start-up and replayed.

A decode step launches a few kernels per layer; at small batch the GPU waits on the launches, not on the
memory. Each bucket's graph runs the model's forward pass over static input buffers (token ids, positions,
the page table); a step copies its page table into them, pads the batch to the bucket with rows that
append into and attend to one scratch page no request owns, replays, and reads its rows of the output.
The decode kernels take the bucket's shapes at capture, and no kernel syncs with the host, so one
capture serves every step of that size. Decode attention's split plan is live: the grid has the splits
the longest context could need, and each replay writes the step's split length (what an eager launch
would plan from the step's own page tables) into a buffer the kernel reads, so a 4k-token sequence in a
graph sized for 128k gets the splits it gets eagerly, not one.

Off the GPU the same padding and buffers run eagerly (`capture=False`): CI checks them on the CPU.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from engine.model import BatchMeta, Model
from engine.role import Role
from pdkernels.splits import cap_splits, live_split_len

log = logging.getLogger(__name__)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def buckets_for(max_num_seqs: int) -> tuple[int, ...]:
    """The buckets up to the first one that holds max_num_seqs (at most 256)."""
    top = next((b for b in BUCKETS if b >= max_num_seqs), BUCKETS[-1])
    return tuple(b for b in BUCKETS if b <= top)


class DecodeGraphs:
    def __init__(
        self,
        model: Model,
        kv_cache: Tensor,
        page_size: int,
        scratch_page: int,
        max_num_seqs: int,
        capture: bool = True,
    ):
        self.model, self.kv_cache, self.page_size, self.scratch = model, kv_cache, page_size, scratch_page
        self.buckets = buckets_for(max_num_seqs)
        self.max_pages = -(-model.config.max_position // page_size)  # a sequence's pages, at most
        top, dev = self.buckets[-1], kv_cache.device

        def i32(n):
            return torch.zeros(n, dtype=torch.int32, device=dev)

        self.ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions, self.last = i32(top), i32(top)
        self.batch_indices = torch.arange(top, dtype=torch.int32, device=dev)
        self.qo_indptr = torch.arange(top + 1, dtype=torch.int32, device=dev)
        self.kv_indptr, self.kv_indices = i32(top + 1), i32(top * self.max_pages)
        self.split_len = i32(1)  # the step's decode split length (live_split_len), read at replay
        self.outputs: dict[int, Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if capture else None
        for b in reversed(self.buckets) if capture else ():  # the largest first: the rest share its pool
            self._capture(b, pool)
        self.capture_s = time.perf_counter() - start
        if capture:
            log.info(
                "captured %d decode graphs (batch %s) in %.2f s",
                len(self.buckets),
                self.buckets,
                self.capture_s,
            )

    def bucket(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def _meta(self, b: int) -> BatchMeta:
        return BatchMeta(
            positions=self.positions[:b],
            batch_indices=self.batch_indices[:b],
            qo_indptr=self.qo_indptr[: b + 1],
            kv_indptr=self.kv_indptr[: b + 1],
            kv_indices=self.kv_indices[: b * self.max_pages],
            kv_last_page_len=self.last[:b],
            all_decode=True,
            max_q_len=1,
            max_kv_len=self.model.config.max_position,
            split_len=self.split_len,
            num_splits=cap_splits(self.model.config.max_position),
        )

    def _fill(self, ids: list[int], positions: list[int], pages: list[list[int]], b: int) -> None:
        """The step's rows, then padding rows of one token on the scratch page, into the static buffers."""
        n = len(ids)
        pad = b - n
        indptr, flat, last = [0], [], []
        for p, seq_pages in zip(positions, pages, strict=True):
            flat += seq_pages
            indptr.append(len(flat))
            last.append(p + 1 - (len(seq_pages) - 1) * self.page_size)
        flat += [self.scratch] * pad
        indptr += range(indptr[-1] + 1, indptr[-1] + 1 + pad)
        self.ids[:b].copy_(torch.tensor(ids + [0] * pad))
        self.positions[:b].copy_(torch.tensor(positions + [0] * pad, dtype=torch.int32))
        self.last[:b].copy_(torch.tensor(last + [1] * pad, dtype=torch.int32))
        self.kv_indptr[: b + 1].copy_(torch.tensor(indptr, dtype=torch.int32))
        self.kv_indices[: len(flat)].copy_(torch.tensor(flat, dtype=torch.int32))
        longest = max((p + 1 for p in positions), default=1)
        heads = self.model.shard.num_kv_heads
        self.split_len.fill_(live_split_len(len(flat) * self.page_size, longest, heads, self.kv_cache.device))

    def _capture(self, b: int, pool) -> None:
        self._fill([], [], [], b)  # every row a padding row while capturing
        meta = self._meta(b)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            for _ in range(2):
                self.model.forward(self.ids[:b], meta, self.kv_cache)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[b] = self.model.forward(self.ids[:b], meta, self.kv_cache)
        self.graphs[b] = graph

    @torch.inference_mode()
    def run(self, ids: list[int], positions: list[int], pages: list[list[int]]) -> Tensor:
        """Hidden states [len(ids), hidden] of one decode step (token ids, each one's position and its
        sequence's pages after this step's append)."""
        b = self.bucket(len(ids))
        self._fill(ids, positions, pages, b)
        if b in self.graphs:
            self.graphs[b].replay()
            out = self.outputs[b]
        else:  # capture=False: the same buffers, eagerly
            out = self.model.forward(self.ids[:b], self._meta(b), self.kv_cache)
        self.replays += 1
        return out[: len(ids)]


def graphs_wanted(cuda_graphs: bool | None, model, dev: torch.device, tp: int, role: Role, num_pages: int):
    """Whether decode steps replay as CUDA graphs (None: on CUDA with tp 1 outside the prefill role); a
    ValueError where they cannot. MoE: the experts' grouping reads counts on the host, which a capture
    cannot; MLA: its decode path has not been captured on a GPU yet."""
    moe, mla = model.moe is not None, model.mla is not None
    if cuda_graphs is None:
        return dev.type == "cuda" and tp == 1 and role.samples and not (moe or mla)
    if cuda_graphs and (dev.type != "cuda" or tp != 1 or num_pages < 2 or moe or mla):
        raise ValueError(
            "cuda_graphs=True needs device='cuda', tp=1, num_pages >= 2 and a model without MoE or MLA "
            f"layers; got device={dev.type!r}, tp={tp}, num_pages={num_pages}, moe={moe}, mla={mla}"
        )
    return cuda_graphs
