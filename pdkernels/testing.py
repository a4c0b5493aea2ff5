"""Builders of paged-cache cases shared by the kernel tests, the CPU benchmarks and the GPU suite."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pdkernels._paging import batch_indices_positions


@dataclass
class PagedCase:
    cache: Tensor  # [pages, 2, H, P, D] or [pages, 2, P, H, D]
    kv_indptr: Tensor  # [B + 1] int32
    kv_indices: Tensor  # int32
    kv_last_page_len: Tensor  # [B] int32
    seq_lens: list[int]
    page_size: int
    kv_layout: str


def make_paged_cache(
    seq_lens: list[int],
    num_heads: int,
    head_dim: int,
    page_size: int,
    kv_layout: str = "HND",
    dtype=torch.float32,
    spare_pages: int = 3,
    seed: int = 0,
    fill: bool = True,
    device: str | torch.device = "cpu",
) -> PagedCase:
    """A cache with shuffled page ids, `spare_pages` unused pages, and random (or zero) contents."""
    g = torch.Generator().manual_seed(seed)
    pages_per_req = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_req) + spare_pages
    kv_indices = torch.randperm(num_pages, generator=g)[: sum(pages_per_req)].to(torch.int32)
    kv_indptr = torch.tensor([0] + pages_per_req).cumsum(0).to(torch.int32)
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(seq_lens, pages_per_req, strict=True)]
    heads_tokens = (num_heads, page_size) if kv_layout == "HND" else (page_size, num_heads)
    shape = (num_pages, 2, *heads_tokens, head_dim)
    if fill:
        g_dev = torch.Generator(device).manual_seed(seed)
        cache = torch.randn(shape, generator=g_dev, device=device).to(dtype)
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    to = {"device": device}
    return PagedCase(
        cache,
        kv_indptr.to(**to),
        kv_indices.to(**to),
        torch.tensor(last, dtype=torch.int32, **to),
        list(seq_lens),
        page_size,
        kv_layout,
    )


def append_positions(case: PagedCase, append_lens: list[int]) -> tuple[Tensor, Tensor]:
    """batch_indices, positions for appending the last append_lens[b] tokens of each request."""
    indptr = torch.tensor([0] + append_lens).cumsum(0)
    batch_indices, positions = batch_indices_positions(indptr, torch.tensor(case.seq_lens))
    return batch_indices.to(case.cache.device), positions.to(case.cache.device)


def all_pairs(*factors: list) -> list[tuple]:
    """A small set of cases in which every value of each factor meets every value of each other factor
    (a strength-2 covering array, built greedily from the full product, deterministic). Kernels under the
    interpreter are tested on these instead of the whole product: bugs that need three factors at once are
    rare, and each case costs seconds."""
    from itertools import combinations, product

    def pairs(case):
        return {(i, case[i], j, case[j]) for i, j in combinations(range(len(case)), 2)}

    full = list(product(*factors))
    todo = set().union(*(pairs(c) for c in full))
    chosen = []
    while todo:
        best = max(full, key=lambda c: len(pairs(c) & todo))
        chosen.append(best)
        todo -= pairs(best)
    return chosen
