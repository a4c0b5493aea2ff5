"""Which bytes go where: the KV page writes between a prefill worker and a decode worker (no I/O).

Both sides keep, per TP rank, one KV region ``[layers, pages, planes, H_local, P, D]`` (HND; see
engine.kv.cache): planes K and V, or one for an MLA latent cache (H = 1, D the latent row). In HND one
head range of one page's K (or V) is a single contiguous run, so a page moves as one write per (source
rank, destination rank) head overlap, and K and V merge into one write when both ranks hold the same
heads. Ranks hold heads ``[r * H / tp, (r + 1) * H / tp)`` when ``H >= tp``; with fewer heads than
ranks (an MLA latent cache is replicated on every rank) each head is replicated on ``tp / H`` ranks, and
each destination rank's page is written once, by one source replica: the replicas take the pages in turn
from a start drawn per request from its seed (so runs repeat and every source rank and its NIC sends).

Writes are planned per page and never merged across pages, so the count for a whole request is the
sum of the counts for any split of its pages into chunks: the decode side computes it once, the
prefill side plans each chunk's completed pages as they become ready.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True)
class ShardSpec:
    """One worker's KV geometry, exchanged in the handshake."""

    tp: int
    num_kv_heads: int  # of the model (1 for an MLA latent cache)
    num_layers: int
    num_pages: int  # per rank region
    page_size: int
    head_dim: int
    itemsize: int  # bytes per element
    dtype: str = "bfloat16"
    kv_layout: str = "HND"
    planes: int = 2  # K and V; 1 for an MLA latent cache
    # what the KV means beyond its shape: digests of the model's config, its weights and its tokenizer
    # (engine.weights.identity; "" where a caller has none). Another model's KV, or another checkpoint's
    # of the same shape, or KV of another tokenizer's ids, is well-formed garbage: both sides must agree
    model: str = ""
    weights: str = ""
    tokenizer: str = ""

    def __post_init__(self):
        for name in (
            "tp",
            "num_kv_heads",
            "num_layers",
            "num_pages",
            "page_size",
            "head_dim",
            "itemsize",
            "planes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"ShardSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_layout not in ("HND", "NHD"):  # the plan writes HND alone (check_compatible)
            raise ValueError(f"ShardSpec.kv_layout must be 'HND' or 'NHD', got {self.kv_layout!r}")
        if self.num_kv_heads % self.tp and self.tp % self.num_kv_heads:
            raise ValueError(
                f"tp={self.tp} must divide num_kv_heads={self.num_kv_heads} or be a multiple of it"
            )

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp)

    def first_head(self, rank: int) -> int:
        """Global id of the first kv head that rank holds."""
        if self.num_kv_heads >= self.tp:
            return rank * self.heads_per_rank
        return rank * self.num_kv_heads // self.tp

    def holders(self, head: int) -> list[int]:
        """Ranks that hold a global kv head (one when sharded, tp / H when replicated)."""
        if self.num_kv_heads >= self.tp:
            return [head // self.heads_per_rank]
        per = self.tp // self.num_kv_heads
        return list(range(head * per, (head + 1) * per))

    @property
    def run_bytes(self) -> int:
        """Bytes of one head's K (or V) in one page."""
        return self.page_size * self.head_dim * self.itemsize

    @property
    def region_bytes(self) -> int:
        return self.num_layers * self.num_pages * self.planes * self.heads_per_rank * self.run_bytes

    def offset(self, layer: int, page: int, kv: int, local_head: int) -> int:
        """Byte offset of (layer, page, plane K=0/V=1, local head) in a rank's region."""
        return (
            ((layer * self.num_pages + page) * self.planes + kv) * self.heads_per_rank + local_head
        ) * self.run_bytes


class Write(NamedTuple):
    layer: int
    src_rank: int
    src_offset: int
    dst_rank: int
    dst_offset: int
    nbytes: int


# what both sides of a transfer must share (tp may differ: the plan converts between degrees)
MUST_MATCH = (
    "model", "weights", "tokenizer", "num_kv_heads", "num_layers", "page_size", "head_dim", "itemsize",
    "dtype", "kv_layout", "planes",
)  # fmt: skip


def check_sendable(spec: ShardSpec) -> None:
    """A worker's own cache, checked once as its messenger starts: the plan writes HND pages alone."""
    if spec.kv_layout != "HND":
        raise ValueError(
            f"KV transfer needs kv_layout 'HND' (a page's head range is one run), got {spec.kv_layout!r}"
        )


def check_compatible(src: ShardSpec, dst: ShardSpec) -> None:
    """Refuse a pair of specs whose KV does not mean the same on both sides, naming the first field they
    disagree on and both values (the decode side checks a prefill worker's Hello at connect; the prefill
    side each request's destination)."""
    for name in MUST_MATCH:
        a, b = getattr(src, name), getattr(dst, name)
        if a != b:
            raise ValueError(
                f"prefill and decode disagree on {name}: {a!r} (prefill) vs {b!r} (decode); both sides "
                "must match"
            )
    check_sendable(src)


def plan_writes(
    src: ShardSpec,
    dst: ShardSpec,
    src_pages: list[int],
    dst_pages: list[int],
    first_page_index: int = 0,
    layers: range | None = None,
    seed: int = 0,
) -> list[Write]:
    """Every write that copies src_pages[i] (prefill) into dst_pages[i] (decode) for the given layers.

    first_page_index: position of src_pages[0] in the request's page list (it picks the source replica
    in turn, so planning chunk by chunk equals planning the whole request). seed: the request's seed.
    Ordered by layer, then page, then destination rank and head run, then K before V.
    """
    rows = plan_array(src, dst, src_pages, dst_pages, first_page_index, layers, seed)
    return [Write(*row) for row in rows.tolist()]


def plan_array(
    src: ShardSpec,
    dst: ShardSpec,
    src_pages: list[int],
    dst_pages: list[int],
    first_page_index: int = 0,
    layers: range | None = None,
    seed: int = 0,
) -> np.ndarray:
    """plan_writes as an int64 array [writes, 6] of (layer, src_rank, src_offset, dst_rank, dst_offset,
    nbytes), built without a Python loop over layers or pages (the messenger plans on its hot path)."""
    check_compatible(src, dst)
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    sp, dp = np.asarray(src_pages, dtype=np.int64), np.asarray(dst_pages, dtype=np.int64)
    for name, pages, spec in (("source", sp, src), ("destination", dp, dst)):
        bad = pages[(pages < 0) | (pages >= spec.num_pages)]
        if len(bad):
            raise ValueError(f"{name} page ids {bad[:4].tolist()} outside [0, {spec.num_pages})")
    layers = np.asarray(layers if layers is not None else range(src.num_layers), dtype=np.int64)
    index = first_page_index + np.arange(len(sp))
    src_first = np.asarray([src.first_head(r) for r in range(src.tp)], dtype=np.int64)
    per_page = []  # [pages, rows, 5] per head run: (src_rank, src_offset, dst_rank, dst_offset, nbytes)
    for dst_rank, head0, nheads, choices in _head_runs(src, dst, seed):
        src_rank = np.asarray(choices, dtype=np.int64)[index % len(choices)]
        sh, dh = head0 - src_first[src_rank], head0 - dst.first_head(dst_rank)
        whole = nheads == src.heads_per_rank == dst.heads_per_rank  # K and V adjacent on both sides
        planes = src.planes
        for kv in (0,) if whole else range(planes):
            per_page.append(
                np.stack(
                    [
                        src_rank,
                        ((sp * planes + kv) * src.heads_per_rank + sh) * src.run_bytes,
                        np.full_like(sp, dst_rank),
                        ((dp * planes + kv) * dst.heads_per_rank + dh) * dst.run_bytes,
                        np.full_like(sp, (planes if whole else 1) * nheads * src.run_bytes),
                    ],
                    axis=1,
                )
            )
    one_layer = np.stack(per_page, axis=1).reshape(-1, 5)  # page-major, then run and K/V
    out = np.empty((len(layers), len(one_layer), 6), dtype=np.int64)
    out[:, :, 0] = layers[:, None]
    out[:, :, 1:] = one_layer
    out[:, :, 2] += layers[:, None] * (src.region_bytes // src.num_layers)
    out[:, :, 4] += layers[:, None] * (dst.region_bytes // dst.num_layers)
    return out.reshape(-1, 6)


def _head_runs(src: ShardSpec, dst: ShardSpec, seed: int) -> list[tuple[int, int, int, list[int]]]:
    """(dst_rank, first global head, heads, source ranks to rotate over): maximal runs of heads that a
    destination rank holds and the same source ranks hold."""
    rng = random.Random(seed)
    runs = []
    for dst_rank in range(dst.tp):
        head, end = dst.first_head(dst_rank), dst.first_head(dst_rank) + dst.heads_per_rank
        while head < end:
            holders = src.holders(head)
            stop = head + 1
            while stop < end and src.holders(stop) == holders:
                stop += 1
            k = rng.randrange(len(holders))  # where this destination starts its rotation
            runs.append((dst_rank, head, stop - head, holders[k:] + holders[:k]))
            head = stop
    return runs


def expected_writes(writes: list[Write], dst_tp: int) -> list[int]:
    """How many writes each destination rank receives."""
    counts = [0] * dst_tp
    for w in writes:
        counts[w.dst_rank] += 1
    return counts
