"""Paged KV memory of one worker rank: the cache tensor and the page allocator.

Pages belong to one request at a time. A pinned request's pages (a decode worker waiting for remote
writes) are never preempted or handed to another request until unpinned; `num_free` lets tests prove
that nothing leaks.
"""

from __future__ import annotations

from collections import deque

import torch

from engine.config import CacheConfig, ModelConfig


def allocate_kv_cache(
    model: ModelConfig, cache: CacheConfig, num_kv_heads: int, device, dtype
) -> torch.Tensor:
    """One tensor for all layers: [layers, pages, 2, H, P, D] (HND) or [layers, pages, 2, P, H, D] (NHD).

    One region per rank is what the transfer engine registers; cache[l] is layer l's paged cache.
    """
    heads_tokens = (
        (num_kv_heads, cache.page_size) if cache.kv_layout == "HND" else (cache.page_size, num_kv_heads)
    )
    shape = (model.num_layers, cache.num_pages, 2, *heads_tokens, model.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


class OutOfPages(Exception):
    """Not enough free pages right now (the scheduler queues or preempts; it never surfaces to users)."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self._free: deque[int] = deque(range(num_pages))
        self._owned: dict[str, list[int]] = {}
        self._pinned: set[str] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages(self, request_id: str) -> list[int]:
        return self._owned.get(request_id, [])

    def can_grow(self, request_id: str, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) - len(self.pages(request_id)) <= self.num_free

    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        """Make request_id own enough pages for num_tokens tokens; raise OutOfPages (taking none) if short."""
        owned = self._owned.setdefault(request_id, [])
        need = self.pages_for(num_tokens) - len(owned)
        if need > self.num_free:
            raise OutOfPages(f"{request_id} needs {need} more pages, {self.num_free} free")
        owned.extend(self._free.popleft() for _ in range(max(0, need)))
        return owned

    def shrink(self, request_id: str, num_tokens: int) -> None:
        """Give back the pages past what num_tokens tokens need (rejected speculative tokens' pages)."""
        owned = self._owned.get(request_id, [])
        keep = self.pages_for(num_tokens)
        while len(owned) > keep:
            self._free.append(owned.pop())

    def free(self, request_id: str) -> None:
        """Return a request's pages (a pinned request must be unpinned first)."""
        if request_id in self._pinned:
            raise RuntimeError(f"{request_id} is pinned: unpin it before freeing its pages")
        self._free.extend(self._owned.pop(request_id, []))

    def pin(self, request_id: str) -> None:
        self._pinned.add(request_id)

    def unpin(self, request_id: str) -> None:
        self._pinned.discard(request_id)

    def is_pinned(self, request_id: str) -> bool:
        return request_id in self._pinned
