"""Paged KV memory of one worker rank: the cache tensor and the page allocator with its prefix cache.

A page is used by the requests that hold it (a reference count). A full page whose KV is computed may be
named by a chained hash of its tokens (`page_hashes`); a named page is shared by every later request whose
prompt starts with the same tokens, and when its last user ends it stays cached, evictable: an allocation
takes unnamed free pages first, then the least recently released cached page (dropping its name). So
`num_free` (free + evictable) is what an allocation may take. A pinned request's pages (a decode worker
waiting for remote writes) are never preempted or freed until unpinned; `num_free` lets tests prove that
nothing leaks.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.config import CacheConfig, ModelConfig

if TYPE_CHECKING:  # torch where the cache is made: a router names pages (page_hashes) without it
    import torch


def allocate_kv_cache(
    model: ModelConfig, cache: CacheConfig, num_kv_heads: int, device, dtype
) -> torch.Tensor:
    """One tensor for all layers: [layers, pages, 2, H, P, D] (HND) or [layers, pages, 2, P, H, D] (NHD);
    an MLA model's has one plane and one head, its latent row: [layers, pages, 1, 1, P, D] in either layout
    (one head: the same bytes).

    One region per rank is what the transfer engine registers; cache[l] is layer l's paged cache.
    """
    heads_tokens = (
        (num_kv_heads, cache.page_size)
        if cache.kv_layout == "HND" or model.mla
        else (cache.page_size, num_kv_heads)
    )
    import torch

    shape = (model.num_layers, cache.num_pages, model.kv_planes, *heads_tokens, model.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def scaled_region_bytes(model: ModelConfig, cache: CacheConfig, num_kv_heads: int) -> int:
    """Bytes of an e4m3 cache's region (scaled_views): its pages, then a float32 per layer, page, plane and
    head."""
    kv = allocate_kv_cache(model, cache, num_kv_heads, "meta", _fp8())
    if kv.numel() % 4:  # the scales are float32 from there
        raise ValueError(f"an e4m3 cache needs a head_dim that 4 divides, got {model.head_dim}")
    return kv.numel() + 4 * math.prod(_scales_of(kv.shape, cache))


def scaled_views(
    region: torch.Tensor, model: ModelConfig, cache: CacheConfig, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 cache's byte region as (cache, scales): the pages as allocate_kv_cache lays them, then one
    float32 per layer, page, plane and head ([layers, pages, planes, H]). The region is what the
    transfer registers and moves: a page's scales go with it (transfer.plan.ShardSpec.scale_bytes)."""
    import torch

    shape = allocate_kv_cache(model, cache, num_kv_heads, "meta", _fp8()).shape
    kv_bytes = shape.numel()
    return (
        region[:kv_bytes].view(_fp8()).view(shape),
        region[kv_bytes:].view(torch.float32).view(_scales_of(shape, cache)),
    )


def allocate_scaled_kv_cache(
    model: ModelConfig, cache: CacheConfig, num_kv_heads: int, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An e4m3 cache's region (scaled_views), its pages zero and its scales 1: (region, cache, scales)."""
    import torch

    region = torch.empty(scaled_region_bytes(model, cache, num_kv_heads), dtype=torch.uint8, device=device)
    kv, scales = scaled_views(region, model, cache, num_kv_heads)
    kv.view(torch.uint8).zero_()
    scales.fill_(1.0)
    return region, kv, scales


def _fp8():
    from pdkernels.kv_quant import FP8

    return FP8


def _scales_of(shape, cache: CacheConfig) -> tuple[int, ...]:
    from pdkernels.kv_quant import scales_shape

    return scales_shape(tuple(shape), cache.kv_layout)


class OutOfPages(Exception):
    """Not enough free pages right now (the scheduler queues or preempts; it never surfaces to users)."""


def page_hashes(token_ids: list[int], page_size: int, salt: bytes, known: list[bytes]) -> list[bytes]:
    """Extend known (the names of token_ids' first full pages) with the names of its other full pages and
    return it: h_i = blake2b(h_(i-1) + page i's token ids), h_(-1) = salt (what else changes the KV: the
    model, dtype, page size). A cryptographic hash, so that no prompt can be made to collide with
    another's and be served its KV (vLLM's CVE-2025-25183)."""
    for i in range(len(known), len(token_ids) // page_size):
        tokens = array("q", token_ids[i * page_size : (i + 1) * page_size]).tobytes()
        known.append(hashlib.blake2b((known[-1] if i else salt) + tokens, digest_size=32).digest())
    return known


def request_salt(salt: bytes, cache_salt: str | None) -> bytes:
    """The first page's seed for a request with a cache_salt (vLLM's): its pages are named apart from
    every other salt's, so no request can find (or time) a prefix another tenant computed."""
    if not cache_salt:
        return salt
    return hashlib.blake2b(salt + b"\0cache_salt\0" + cache_salt.encode(), digest_size=32).digest()


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self._free: deque[int] = deque(range(num_pages))  # unnamed, unused
        self._owned: dict[str, list[int]] = {}
        self._pinned: set[str] = set()
        self._refs = [0] * num_pages  # requests holding each page
        self._name: dict[int, bytes] = {}  # page -> its name (named pages only)
        self._page: dict[bytes, int] = {}  # name -> page
        self._evictable: OrderedDict[int, None] = OrderedDict()  # named, unused; least recently used first
        self.num_evicted = 0  # named pages whose name an allocation dropped
        # (stored?, name) as names come and go, for a router's view of this cache (record_events())
        self.events: list[tuple[bool, bytes]] | None = None
        # the KV tiers below (engine/kv/tiers.py): told of a named page about to be evicted, whose KV
        # still holds, or (write-through) of a page just named
        self.on_evict: Callable[[int, bytes], None] | None = None
        self.on_named: Callable[[int, bytes], None] | None = None

    MAX_EVENTS = 50_000  # kept between take_events() calls; the oldest go first

    def record_events(self) -> None:
        """From now on keep (True, name) for each page named and (False, name) for each name dropped."""
        self.events = []

    def take_events(self) -> list[tuple[bool, bytes]]:
        """The events since the last call (empty when not recording)."""
        out, self.events = self.events or [], [] if self.events is not None else None
        return out

    def _event(self, stored: bool, name: bytes) -> None:
        if self.events is not None:
            self.events.append((stored, name))
            if len(self.events) > self.MAX_EVENTS:
                del self.events[: len(self.events) - self.MAX_EVENTS]

    @property
    def num_free(self) -> int:
        """Pages an allocation may take: free ones and cached ones no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Named pages (in use or evictable)."""
        return len(self._page)

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
        for _ in range(max(0, need)):
            owned.append(self._take())
        return owned

    def _take(self) -> int:
        if self._free:
            page = self._free.popleft()
        else:  # evict the least recently released cached page
            page, _ = self._evictable.popitem(last=False)
            name = self._name.pop(page)
            if self.on_evict is not None:
                self.on_evict(page, name)
            del self._page[name]
            self.num_evicted += 1
            self._event(False, name)
        self._refs[page] = 1
        return page

    def shrink(self, request_id: str, num_tokens: int) -> None:
        """Give back the pages past what num_tokens tokens need (rejected speculative tokens' pages)."""
        owned = self._owned.get(request_id, [])
        keep = self.pages_for(num_tokens)
        while len(owned) > keep:
            self._release(owned.pop())

    def free(self, request_id: str) -> None:
        """Return a request's pages (a pinned request must be unpinned first): last pages first, so that
        a prompt's tail is evicted before the prefix other prompts may share."""
        if request_id in self._pinned:
            raise RuntimeError(f"{request_id} is pinned: unpin it before freeing its pages")
        for page in reversed(self._owned.pop(request_id, [])):
            self._release(page)

    def rename(self, request_id: str, owner: str) -> None:
        """Hand request_id's pages (and its pin) to owner, a name no request uses: the pages stay held
        while the request id is free again."""
        if owner in self._owned:
            raise ValueError(f"{owner!r} already owns pages")
        pages = self._owned.pop(request_id, None)
        if pages is not None:
            self._owned[owner] = pages
        if request_id in self._pinned:
            self._pinned.discard(request_id)
            self._pinned.add(owner)

    def _release(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if page in self._name:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def pin(self, request_id: str) -> None:
        self._pinned.add(request_id)

    def unpin(self, request_id: str) -> None:
        self._pinned.discard(request_id)

    def is_pinned(self, request_id: str) -> bool:
        return request_id in self._pinned

    # ---- the prefix cache -------------------------------------------------------------------------------

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached pages of the longest run of leading names in hashes."""
        found = []
        for h in hashes:
            page = self._page.get(h)
            if page is None:
                break
            found.append(page)
        return found

    def num_unused(self, pages: list[int]) -> int:
        """How many of pages no request holds (sharing them takes them out of num_free)."""
        return sum(1 for p in pages if self._refs[p] == 0)

    def share(self, request_id: str, pages: list[int]) -> None:
        """request_id, holding no pages, starts with these cached pages (found by lookup)."""
        if self._owned.get(request_id):
            raise RuntimeError(f"{request_id} already holds pages: shared pages come first")
        for page in pages:
            if page not in self._name:
                raise RuntimeError(f"page {page} is not cached: only named pages are shared")
            self._refs[page] += 1
            self._evictable.pop(page, None)
        self._owned[request_id] = list(pages)

    def name(self, request_id: str, hashes: list[bytes], first: int = 0) -> int:
        """Name request_id's pages first, first + 1, ... by hashes[first:] (their KV is computed); a name
        already held by another page stays with it (this page is then freed unnamed). Returns the index
        after the last page named or already named: where the next call starts."""
        owned = self._owned.get(request_id, [])
        end = min(len(hashes), len(owned))
        for i in range(first, end):
            page, h = owned[i], hashes[i]
            if page not in self._name and h not in self._page:
                self._name[page], self._page[h] = h, page
                self._event(True, h)
                if self.on_named is not None:
                    self.on_named(page, h)
        return max(first, end)

    def reset_cache(self) -> int:
        """Forget every name (cached pages no one holds become free); returns how many were dropped."""
        dropped = len(self._page)
        for name in self._page:
            self._event(False, name)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._name.clear()
        self._page.clear()
        return dropped
