"""Split-K GEMM ``y = x @ W^T`` for the small-M linears of decode (M = 1..64 tokens).

With few rows, a plain tiled GEMM launches too few programs to read the weight at full bandwidth. Each
program here reduces one K-slice of one [BLOCK_M, BLOCK_N] tile in fp32 and writes it to a workspace,
then draws the tile's ticket; the slice that draws the last one sums the tile's partials in slice order
(deterministic: the same bits whichever slice finishes last) and casts, in the same launch (the ticket
pattern of out_proj's layer counter).
FLOPs: 2*M*N*K. Bytes: N*K*w.itemsize (weight) + M*K + M*N (activations), weight-dominated for small M.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdkernels._paging import INTERPRET, check_tensor, next_pow2, require

__all__ = [
    "splitk_gemm",
    "splitk_gemm_ref",
    "gemm_tile",
    "gemm_meta",
    "check_linear",
    "slice_bounds",
    "finish_tile",
    "split_tile",
    "split_workspace",
]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def gemm_tile(
    x_ptr,
    w_ptr,
    M,
    N,
    x_strides,
    w_strides,
    pid_m,
    pid_n,
    k_lo,
    k_hi,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] tile of x[:, k_lo:k_hi] @ w[:, k_lo:k_hi]^T (shared with out_proj)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * x_strides[0]
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * w_strides[0]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < k_hi
        x = tl.load(
            x_rows + offs_k[None, :] * x_strides[1], mask=(offs_m[:, None] < M) & in_k[None, :], other=0.0
        )
        w = tl.load(
            w_cols + offs_k[:, None] * w_strides[1], mask=in_k[:, None] & (offs_n[None, :] < N), other=0.0
        )
        if UPCAST:  # the interpreter's bf16 arithmetic is wrong; fp32 operands are exact there
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def slice_bounds(K, pid_k, split_k, BLOCK_K: tl.constexpr):
    """[k_lo, k_hi) of K-slice pid_k of split_k: whole BLOCK_K blocks dealt out evenly (slices differ by
    at most one block), so no slice waits on a longer one."""
    blocks = tl.cdiv(K, BLOCK_K)
    k_lo = (pid_k * blocks // split_k) * BLOCK_K
    k_hi = tl.minimum(((pid_k + 1) * blocks // split_k) * BLOCK_K, K)
    return k_lo, k_hi


@triton.jit
def finish_tile(
    acc,
    ws_ptr,
    y_ptr,
    tickets_ptr,
    M,
    N,
    pid_m,
    pid_n,
    pid_k,
    split_k,
    ws_strides,
    y_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Store this K-slice's fp32 partial of tile (pid_m, pid_n) and draw the tile's ticket. The slice that
    draws the last ticket knows every other partial is stored: it sums them in slice order (the result
    does not depend on which slice finished last), stores y in its dtype and resets the ticket for the
    next launch. Returns whether this program finished the tile (shared with out_proj)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ws = ws_ptr + offs_m[:, None].to(tl.int64) * ws_strides[1] + offs_n[None, :]
    tl.store(ws + pid_k * ws_strides[0], acc, mask=mask)
    tl.debug_barrier()  # every thread's stores of this partial precede the ticket
    tile = pid_m * tl.cdiv(N, BLOCK_N) + pid_n
    last = tl.atomic_add(tickets_ptr + tile, 1, sem="acq_rel") == split_k - 1
    if last:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(0, split_k):  # .cg: from L2, never a stale line of this SM's L1
            total += tl.load(ws + s * ws_strides[0], mask=mask, other=0.0, cache_modifier=".cg")
        y = y_ptr + offs_m[:, None].to(tl.int64) * y_stride + offs_n[None, :]
        tl.store(y, total.to(y_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(tickets_ptr + tile, 0, sem="relaxed")
    return last


@triton.jit
def split_tile(
    x_ptr,
    w_ptr,
    y_ptr,
    ws_ptr,
    tickets_ptr,
    M,
    N,
    K,
    x_strides,
    w_strides,
    ws_strides,
    y_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """This program's K-slice of its tile (grid: M tiles, N tiles, slices), then finish_tile; returns
    whether this program finished the tile (shared with out_proj)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    split_k = tl.num_programs(2)
    k_lo, k_hi = slice_bounds(K, pid_k, split_k, BLOCK_K)
    acc = gemm_tile(
        x_ptr,
        w_ptr,
        M,
        N,
        x_strides,
        w_strides,
        pid_m,
        pid_n,
        k_lo,
        k_hi,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        UPCAST,
        IEEE,
    )
    return finish_tile(
        acc,
        ws_ptr,
        y_ptr,
        tickets_ptr,
        M,
        N,
        pid_m,
        pid_n,
        pid_k,
        split_k,
        ws_strides,
        y_stride,
        BLOCK_M,
        BLOCK_N,
    )


@triton.jit
def _splitk_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    ws_ptr,
    tickets_ptr,
    M,
    N,
    K,
    x_strides,
    w_strides,
    ws_strides,
    y_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    ONE_SLICE: tl.constexpr,
):
    """One launch: each program multiplies one K-slice of one tile; the tile's last slice to finish sums
    the slices (split_tile). ONE_SLICE: the whole K in one program, stored directly (no workspace)."""
    if ONE_SLICE:
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        acc = gemm_tile(
            x_ptr,
            w_ptr,
            M,
            N,
            x_strides,
            w_strides,
            pid_m,
            pid_n,
            0,
            K,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            UPCAST,
            IEEE,
        )
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        y = y_ptr + offs_m[:, None].to(tl.int64) * y_stride + offs_n[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
    else:
        split_tile(
            x_ptr,
            w_ptr,
            y_ptr,
            ws_ptr,
            tickets_ptr,
            M,
            N,
            K,
            x_strides,
            w_strides,
            ws_strides,
            y_stride,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            UPCAST,
            IEEE,
        )


def gemm_meta(x: Tensor) -> dict:
    """Dtype-dependent meta-parameters of gemm_tile."""
    return dict(UPCAST=INTERPRET and x.dtype == torch.bfloat16, IEEE=x.dtype == torch.float32)


def check_linear(x: Tensor, w: Tensor, out: Tensor | None) -> None:
    """Check x [M, K], w [N, K] and, when given, out [M, N] in x's dtype."""
    check_tensor("x", x, 2, DTYPES)
    check_tensor("w", w, 2, (x.dtype,), x.device)
    require(x.shape[1] == w.shape[1], f"x is [M, K={x.shape[1]}] but w is [N, K={w.shape[1]}]: K must match")
    if out is not None:
        check_tensor("out", out, 2, (x.dtype,), x.device)
        require(
            tuple(out.shape) == (x.shape[0], w.shape[0]),
            f"out must be [M, N] = {(x.shape[0], w.shape[0])}, got {tuple(out.shape)}",
        )


def new_out(x: Tensor, w: Tensor, out: Tensor | None) -> Tensor:
    return torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device) if out is None else out


@functools.lru_cache(maxsize=16)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: no driver call per launch); 4 on the CPU."""
    return (
        _sms(device.index if device.index is not None else torch.cuda.current_device())
        if device.type == "cuda"
        else 4
    )


def default_split_k(
    m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, device: torch.device
) -> int:
    """Enough K-slices to give every SM about two programs, none shorter than one BLOCK_K."""
    sms = sm_count(device)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    return max(1, min(triton.cdiv(2 * sms, tiles), triton.cdiv(k, block_k)))


def splitk_gemm(
    x: Tensor,
    w: Tensor,
    out: Tensor | None = None,
    split_k: int | None = None,
    block_n: int = 64,
    block_k: int = 128,
    validate: bool = True,
) -> Tensor:
    """y = x @ w^T. x [M, K], w [N, K] (nn.Linear layout), fp16/bf16/fp32; returns (or fills) out [M, N].

    split_k: number of K-slices (default: from the SM count; at most one a BLOCK_K block); the reduction
    is deterministic (slice order) and happens in the same launch. Launches that split share one ticket
    scratch per device (split_workspace), so they must run in order on one stream, as the engine's do.
    """
    if validate:
        check_linear(x, w, out)
    out = new_out(x, w, out)
    require(split_k is None or split_k >= 1, f"split_k must be >= 1 or None, got {split_k}")
    require(min(block_n, block_k) >= 16, f"block sizes must be >= 16 (tl.dot), got {(block_n, block_k)}")
    (m, k), n = x.shape, w.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    block_m = min(64, max(16, next_pow2(m)))
    split_k = split_k or default_split_k(m, n, k, block_m, block_n, block_k, x.device)
    grid, ws, tickets = split_workspace(x, m, n, k, block_m, block_n, block_k, split_k)
    _splitk_kernel[grid](
        x,
        w,
        out,
        ws if ws is not None else out,
        tickets if tickets is not None else out,
        m,
        n,
        k,
        x.stride(),
        w.stride(),
        ws.stride()[:2] if ws is not None else (0, 0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ONE_SLICE=ws is None,
        **gemm_meta(x),
    )
    return out


# device -> int32 tickets, one per output tile of a split launch; every launch leaves them zero
_TILE_TICKETS: dict[torch.device, Tensor] = {}
_RETIRED: list[Tensor] = []  # outgrown scratch stays allocated: a captured CUDA graph may still use it


def tile_tickets(device: torch.device, tiles: int) -> Tensor:
    """The device's zeroed ticket scratch, at least `tiles` long: allocated once (grown by doubling past
    16,384 tiles, where a 4096-wide layer at decode M has 64), so that a launch costs no memset, and a CUDA
    graph captured after the first eager call keeps using the same buffer."""
    buf = _TILE_TICKETS.get(device)
    if buf is None or buf.numel() < tiles:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(16384, next_pow2(tiles)), dtype=torch.int32, device=device)
        _TILE_TICKETS[device] = buf
    return buf


def split_workspace(
    x: Tensor, m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, split_k: int
) -> tuple[tuple[int, int, int], Tensor | None, Tensor | None]:
    """(grid, fp32 partials [slices, M, N], tile tickets) of a split-K launch of x @ w^T; no workspace
    (None, None) when one slice covers K. Slices: at most one per BLOCK_K block of K."""
    split_k = max(1, min(split_k, triton.cdiv(k, block_k)))
    tiles = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    if split_k == 1:
        return (*tiles, 1), None, None
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    return (*tiles, split_k), ws, tile_tickets(x.device, tiles[0] * tiles[1])


def splitk_gemm_ref(x: Tensor, w: Tensor, out: Tensor | None = None) -> Tensor:
    """Reference: torch's GEMM in x's dtype (fp32 accumulation: oneDNN on the CPU, cuBLAS on GPU).

    It is also the CPU path of pdkernels.ops, so it must not upcast the weight (that costs a copy of it).
    """
    return torch.mm(x, w.t(), out=out)
