"""Which bytes go where: the KV page writes between a prefill worker and a decode worker (no I/O).

Both sides keep, per TP rank, one KV region ``[layers, pages, planes, H_local, P, D]`` (HND; see
engine.kv.cache): planes K and V, or one for an MLA latent cache (H = 1, D the latent row). In HND one
head range of one page's K (or V) is a single contiguous run, so a page moves as one write per (source
rank, destination rank) head overlap, and K and V merge into one write when both ranks hold the same
heads. Ranks hold heads ``[r * H / tp, (r + 1) * H / tp)`` when ``H >= tp``; with fewer heads than
ranks (an MLA latent cache is replicated on every rank) each head is replicated on ``tp / H`` ranks, and
each destination rank's page is written once, by one source replica: the replicas take the pages in turn
from a start drawn per request from its seed (so runs repeat and every source rank and its NIC sends).

The two sides' page sizes may differ when one divides the other (vLLM lets a prefill block be smaller
than the decode side's): the plan then copies units of the smaller page size, a unit of one head's K (or
V) being a contiguous part of that head's run on the larger side, so each unit moves as one write per
head and plane; a request's tokens map to pages by position on each side (token t is in page t // P).

The two sides' layouts may differ too (HND and NHD, [H, P] or [P, H] in a page's plane): the KV moves in
the prefill side's layout, its bytes into the decode side's pages as they are, and the decode side turns
each request's pages into its own layout in place once they have all landed (transfer/decode.py), one
pass over bytes it holds. In NHD one head of a page is not one run, so an NHD prefill side sends only
where each decode rank holds the heads of one prefill rank (the same TP; or one latent head): whole
pages, or whole units of all the rank's heads.

An e4m3 cache's scales (a float32 per layer, page, plane and head) follow every layer's pages in the
same region (ShardSpec.scale_bytes): each page write of a run of heads brings one write of those heads'
scales, after the layer's page writes; scaled pages cross only between equal page sizes. A prefill side
whose cache is wider (bf16, fp32) feeds an e4m3 decode side from a staging copy in e4m3 (as_e4m3), each
page quantized into it as its layers are posted; an e4m3 prefill side never feeds a wider decode side.

Writes are planned per unit (a page, where the sizes match) and never merged across units, so the count
for a whole request is the sum of the counts for any split of its tokens at unit boundaries: the decode
side computes it once, the prefill side plans each chunk's completed pages as they become ready.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
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
    dtype: str = "bfloat16"  # the KV's: the model's, or fp8_e4m3 (itemsize 1, scale_bytes 4)
    kv_layout: str = "HND"  # or NHD (the decode side converts what lands: see above)
    planes: int = 2  # K and V; 1 for an MLA latent cache
    # bytes of one page's scale per plane and head, kept after every layer's pages in the same region
    # ([layers, pages, planes, H_local] float32: an e4m3 cache's, engine.kv.cache); 0 for a cache without
    scale_bytes: int = 0
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
        if self.scale_bytes not in (0, 4):
            raise ValueError(
                f"ShardSpec.scale_bytes must be 0 (no scales) or 4 (float32), got {self.scale_bytes}"
            )
        if self.kv_layout not in ("HND", "NHD"):
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
    def kv_bytes(self) -> int:
        """Bytes of a rank region's pages (its scales, if any, follow them)."""
        return self.num_layers * self.num_pages * self.planes * self.heads_per_rank * self.run_bytes

    @property
    def region_bytes(self) -> int:
        return (
            self.kv_bytes
            + self.num_layers * self.num_pages * self.planes * self.heads_per_rank * self.scale_bytes
        )

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


# what both sides of a transfer must share (tp may differ: the plan converts between degrees; so may the
# page size, where one side's divides the other's, and the layout)
MUST_MATCH = (
    "model", "weights", "tokenizer", "num_kv_heads", "num_layers", "head_dim", "dtype", "itemsize", "planes",
    "scale_bytes",
)  # fmt: skip


E4M3 = "fp8_e4m3"


def as_e4m3(spec: ShardSpec) -> ShardSpec:
    """The geometry of spec's pages quantized to e4m3 with a float32 scale per page, plane and head: what a
    prefill side with a wider cache sends a decode side whose cache is e4m3 (a staging copy it quantizes
    each page into as its layers are posted: engine.disagg.E4M3Staging)."""
    return replace(spec, dtype=E4M3, itemsize=1, scale_bytes=4)


def wire_spec(spec: ShardSpec, kv_dtype: str) -> ShardSpec:
    """What a prefill side's KV crosses as toward decode workers whose cache holds kv_dtype (auto: the
    model's dtype, or fp8_e4m3): as_e4m3 of its own where those hold e4m3 and it a wider cache, else its
    own spec."""
    return as_e4m3(spec) if kv_dtype == E4M3 and spec.dtype != E4M3 else spec


def check_compatible(src: ShardSpec, dst: ShardSpec) -> None:
    """Refuse a pair of specs whose KV does not mean the same on both sides, naming the first field they
    disagree on and both values (the decode side checks a prefill worker's Hello at connect; the prefill
    side each request's destination)."""
    if src.dtype == E4M3 and dst.dtype != E4M3:
        raise ValueError(
            f"an e4m3 prefill side's KV cannot go to a {dst.dtype} decode side (it would read 3 mantissa "
            "bits as its own): give the prefill workers the decode workers' KV dtype, or a wider one "
            "(each page is then quantized as it is written)"
        )
    for name in MUST_MATCH:
        a, b = getattr(src, name), getattr(dst, name)
        if a != b:
            raise ValueError(
                f"prefill and decode disagree on {name}: {a!r} (prefill) vs {b!r} (decode); both sides "
                "must match"
            )
    small, large = sorted((src.page_size, dst.page_size))
    if src.scale_bytes and small != large:
        raise ValueError(
            f"prefill page_size {src.page_size} and decode page_size {dst.page_size} with scaled "
            f"({src.dtype}) pages: a page's scale covers its own tokens, so both sides must use one page size"
        )
    if large % small:
        raise ValueError(
            f"prefill page_size {src.page_size} and decode page_size {dst.page_size}: one must divide the "
            "other (a page of the smaller size is then a part of one page of the larger)"
        )
    if src.kv_layout == "NHD" and not all(
        n == src.heads_per_rank == dst.heads_per_rank for _, _, n, _ in _head_runs(src, dst, 0)
    ):
        raise ValueError(
            f"an NHD prefill side sends whole pages of its ranks' heads, and decode ranks here hold other "
            f"heads (prefill tp={src.tp}, decode tp={dst.tp}, {src.num_kv_heads} kv heads): run the "
            "prefill side in HND, or both at the same TP"
        )


def unit_tokens(src: ShardSpec, dst: ShardSpec) -> int:
    """Tokens a write unit holds: the smaller page size (the specs checked compatible)."""
    return min(src.page_size, dst.page_size)


def plan_writes(
    src: ShardSpec,
    dst: ShardSpec,
    src_pages: list[int],
    dst_pages: list[int],
    start: int = 0,
    end: int | None = None,
    layers: range | None = None,
    seed: int = 0,
) -> list[Write]:
    """Every write that copies the request's tokens [start, end) from its source (prefill) pages into its
    destination (decode) pages, for the given layers.

    src_pages and dst_pages: the request's page lists from its first token (src_pages[i] holds tokens
    [i * P, (i + 1) * P) at the source's page size P; the same for dst_pages at the destination's), as far
    as [start, end) reaches; end defaults to the tokens both lists hold and is cut there. start: a unit
    boundary (unit_tokens). seed: the request's (it picks the source replica of each unit in turn, so
    planning a request in spans equals planning it whole). Ordered by layer, then unit, then destination
    rank and head run, then K before V; a layer's scale writes (if any) after its page writes, in that
    order.
    """
    rows = plan_array(src, dst, src_pages, dst_pages, start, end, layers, seed)
    return [Write(*row) for row in rows.tolist()]


def plan_array(
    src: ShardSpec,
    dst: ShardSpec,
    src_pages: list[int],
    dst_pages: list[int],
    start: int = 0,
    end: int | None = None,
    layers: range | None = None,
    seed: int = 0,
) -> np.ndarray:
    """plan_writes as an int64 array [writes, 6] of (layer, src_rank, src_offset, dst_rank, dst_offset,
    nbytes), built without a Python loop over layers or units (the messenger plans on its hot path)."""
    check_compatible(src, dst)
    unit = unit_tokens(src, dst)
    held = min(len(src_pages) * src.page_size, len(dst_pages) * dst.page_size)
    end = held if end is None else min(end, held)
    if start % unit or start < 0:
        raise ValueError(f"start must be a multiple of {unit} tokens (the smaller page size), got {start}")
    sp, dp = np.asarray(src_pages, dtype=np.int64), np.asarray(dst_pages, dtype=np.int64)
    for name, pages, spec in (("source", sp, src), ("destination", dp, dst)):
        bad = pages[(pages < 0) | (pages >= spec.num_pages)]
        if len(bad):
            raise ValueError(f"{name} page ids {bad[:4].tolist()} outside [0, {spec.num_pages})")
    units = np.arange(start // unit, max(start // unit, -(-end // unit)), dtype=np.int64)
    tokens = units * unit
    # each unit's page on each side and its place in that page: in a head's run (HND), or in the plane of
    # all the rank's heads (NHD, whose runs are the rank's heads: check_compatible)
    nhd = src.kv_layout == "NHD"
    src_row, dst_row = (s.head_dim * s.itemsize * (s.heads_per_rank if nhd else 1) for s in (src, dst))
    src_page, src_at = sp[tokens // src.page_size], (tokens % src.page_size) * src_row
    dst_page, dst_at = dp[tokens // dst.page_size], (tokens % dst.page_size) * dst_row
    layers = np.asarray(layers if layers is not None else range(src.num_layers), dtype=np.int64)
    src_first = np.asarray([src.first_head(r) for r in range(src.tp)], dtype=np.int64)
    unit_bytes = unit * src.head_dim * src.itemsize
    same_pages = src.page_size == dst.page_size  # a head range of a page is one run on both sides
    per_unit = []  # [units, rows, 5] per write: (src_rank, src_offset, dst_rank, dst_offset, nbytes)
    scaled = []  # the same for the scales of what per_unit moves (pages of one size: check_compatible)
    for dst_rank, head0, nheads, choices in _head_runs(src, dst, seed):
        src_rank = np.asarray(choices, dtype=np.int64)[units % len(choices)]
        sh, dh = head0 - src_first[src_rank], head0 - dst.first_head(dst_rank)
        planes = src.planes
        if same_pages:
            whole = nheads == src.heads_per_rank == dst.heads_per_rank  # K and V adjacent on both sides
            cuts = [(0, kv) for kv in ((0,) if whole else range(planes))]
            width = (planes if whole else 1) * nheads * unit_bytes
        elif nhd:
            cuts = [(0, kv) for kv in range(planes)]  # the unit's tokens of all the rank's heads
            width = nheads * unit_bytes
        else:
            cuts = [(h, kv) for h in range(nheads) for kv in range(planes)]  # a head's part of a run
            width = unit_bytes
        for h, kv in cuts:
            if src.scale_bytes:  # the unit is a whole page: its scales of these heads (and planes)
                scaled.append(
                    np.stack(
                        [
                            src_rank,
                            ((src_page * planes + kv) * src.heads_per_rank + sh + h) * src.scale_bytes,
                            np.full_like(units, dst_rank),
                            ((dst_page * planes + kv) * dst.heads_per_rank + dh + h) * dst.scale_bytes,
                            np.full_like(units, width // unit_bytes * src.scale_bytes),
                        ],
                        axis=1,
                    )
                )
            per_unit.append(
                np.stack(
                    [
                        src_rank,
                        ((src_page * planes + kv) * src.heads_per_rank + sh + h) * src.run_bytes + src_at,
                        np.full_like(units, dst_rank),
                        ((dst_page * planes + kv) * dst.heads_per_rank + dh + h) * dst.run_bytes + dst_at,
                        np.full_like(units, width),
                    ],
                    axis=1,
                )
            )
    one_layer = np.stack(per_unit, axis=1).reshape(-1, 5)  # unit-major, then run and K/V
    out = np.empty((len(layers), len(one_layer), 6), dtype=np.int64)
    out[:, :, 0] = layers[:, None]
    out[:, :, 1:] = one_layer
    out[:, :, 2] += layers[:, None] * (src.kv_bytes // src.num_layers)
    out[:, :, 4] += layers[:, None] * (dst.kv_bytes // dst.num_layers)
    if scaled:  # each layer's scale writes after its page writes, into the scales after every page
        scales = np.stack(scaled, axis=1).reshape(-1, 5)
        rows = np.empty((len(layers), len(scales), 6), dtype=np.int64)
        rows[:, :, 0] = layers[:, None]
        rows[:, :, 1:] = scales
        for col, spec in ((2, src), (4, dst)):
            per_layer = (spec.region_bytes - spec.kv_bytes) // spec.num_layers
            rows[:, :, col] += spec.kv_bytes + layers[:, None] * per_layer
        out = np.concatenate([out, rows], axis=1)
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
