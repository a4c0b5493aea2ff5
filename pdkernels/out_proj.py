"""Attention output projection ``y = x @ W_o^T`` that signals "layer done" once all of its tiles are stored.

Ticket pattern: after storing its tile, every program takes a ticket (an acq_rel atomic add on
``counter[1, layer]``). The program that draws the last ticket knows every other tile is stored, resets
the ticket to 0 for the next pass and bumps ``counter[0, layer]`` by exactly one. A host thread (the
prefill messenger) polls ``counter[0, layer]`` to learn that the layer's KV is in the cache: the
signal is kernel-side, so it also works inside a CUDA graph.

On CUDA the counter lives in pinned host memory mapped into the device (one address for both under
unified addressing) and the bump is a system-scope release: the host reads ``counter[0, layer]`` with a
plain load (``host_view``) while later layers still run, instead of a device-to-host copy that would queue
behind the whole forward pass on the compute stream.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdkernels._paging import check_tensor, next_pow2, require
from pdkernels.splitk_gemm import (
    check_linear,
    default_split_k,
    gemm_meta,
    gemm_tile,
    new_out,
    split_tile,
    split_workspace,
    splitk_gemm_ref,
)

__all__ = ["out_proj", "out_proj_ref", "make_layer_counter", "host_view"]

GEMMS = ("auto", "triton", "library")
# From this many rows (prefill) gemm="auto" takes the library GEMM: on the H200 our Triton
# tiles reached 0.76x cuBLAS at M = 4096, while at decode M split-K keeps up with it as a graph replay.
LIBRARY_M = 128


@triton.jit
def _out_proj_kernel(
    # pointers
    x_ptr,
    w_ptr,
    y_ptr,
    counter_ptr,
    ticket_ptr,
    tile_order_ptr,
    # sizes
    M,
    N,
    K,
    layer,
    # strides
    x_strides,
    w_strides,
    y_stride,
    # meta
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_COUNTER: tl.constexpr,
    HAS_TILE_ORDER: tl.constexpr,
):
    tile = tl.program_id(0)
    if HAS_TILE_ORDER:
        tile = tl.load(tile_order_ptr + tile)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile // num_n, tile % num_n
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
    if HAS_COUNTER:
        tl.debug_barrier()  # every thread's stores of this tile precede the ticket
        _release(counter_ptr, ticket_ptr, layer, tl.cdiv(M, BLOCK_M) * num_n)


@triton.jit
def _out_proj_split_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    ws_ptr,
    tile_tickets_ptr,
    counter_ptr,
    ticket_ptr,
    M,
    N,
    K,
    layer,
    x_strides,
    w_strides,
    ws_strides,
    y_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_COUNTER: tl.constexpr,
):
    """Split-K in one launch (splitk_gemm's split_tile); each program that finishes a tile then draws the
    layer's ticket, and the one that finishes the last tile bumps the counter."""
    finished = split_tile(
        x_ptr,
        w_ptr,
        y_ptr,
        ws_ptr,
        tile_tickets_ptr,
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
    if HAS_COUNTER:
        if finished:
            tl.debug_barrier()  # the tile's stores precede the layer's ticket
            _release(counter_ptr, ticket_ptr, layer, tl.num_programs(0) * tl.num_programs(1))


@triton.jit
def _release(counter_ptr, ticket_ptr, layer, num_tiles):
    """Draw the layer's ticket; the program that draws the last of num_tiles resets it and bumps
    counter[0, layer] with a system-scope release (the host polls it)."""
    ticket = tl.atomic_add(ticket_ptr + layer, 1, sem="acq_rel")
    last = ticket == num_tiles - 1
    # Only the last program gets here with last=True; masks keep it branch-free.
    tl.atomic_xchg(ticket_ptr + layer, 0, mask=last, sem="relaxed")
    tl.atomic_add(counter_ptr + layer, 1, mask=last, sem="release", scope="sys")


@triton.jit
def _bump_kernel(counter_ptr, ticket_ptr, layer):
    """One program after a GEMM on the same stream (so after all of its stores): the layer's bump."""
    _release(counter_ptr, ticket_ptr, layer, 1)


_HOST: dict[int, Tensor] = {}  # data_ptr of a mapped counter -> the pinned host tensor behind it
# ... -> its ticket row in device memory: an atomic on host-mapped memory crosses PCIe (about 1 us each,
# measured on an H200: 2 ms for the 2048 tickets of a 4096-token projection), the bump only once a layer
_TICKETS: dict[int, Tensor] = {}


class _Mapped:
    """A device-side view of pinned host memory, for torch.as_tensor (UVA: the host address is valid on
    the device)."""

    def __init__(self, host: Tensor):
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": "<i4",
            "data": (host.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


def make_layer_counter(num_layers: int, device: torch.device | str = "cpu", mapped: bool = True) -> Tensor:
    """counter [2, num_layers] int32: row 0 counts finished passes per layer, row 1 is ticket scratch.

    On CUDA with mapped=True: a CUDA tensor over pinned host memory; ``host_view`` gives its host side, and
    the tickets live in device memory (row 1 stays 0)."""
    require(num_layers >= 1, f"num_layers must be >= 1, got {num_layers}")
    device = torch.device(device)
    if device.type != "cuda" or not mapped:
        return torch.zeros((2, num_layers), dtype=torch.int32, device=device)
    host = torch.zeros((2, num_layers), dtype=torch.int32, pin_memory=True)
    with torch.cuda.device(device):
        counter = torch.as_tensor(_Mapped(host), device=device)
    require(counter.data_ptr() == host.data_ptr(), "pinned host memory is not mapped at its host address")
    _HOST[counter.data_ptr()] = host
    _TICKETS[counter.data_ptr()] = torch.zeros(num_layers, dtype=torch.int32, device=device)
    weakref.finalize(counter, _forget, counter.data_ptr())
    return counter


def _forget(ptr: int) -> None:
    _HOST.pop(ptr, None)
    _TICKETS.pop(ptr, None)


def tickets(counter: Tensor) -> Tensor:
    """Where the programs draw their tickets: device memory beside a mapped counter, else row 1."""
    return _TICKETS.get(counter.data_ptr(), counter[1])


def host_view(counter: Tensor) -> Tensor:
    """What a host thread should poll: the host side of a mapped counter, else the counter itself (a CUDA
    counter that is not mapped is read through a copy that waits for the stream)."""
    return _HOST.get(counter.data_ptr(), counter) if counter.is_cuda else counter


def check_counter(counter: Tensor, layer: int, device: torch.device) -> None:
    check_tensor("counter", counter, 2, (torch.int32,), device, contiguous=True)
    require(
        counter.shape[0] == 2, f"counter must be [2, num_layers] (done, tickets), got {tuple(counter.shape)}"
    )
    require(0 <= layer < counter.shape[1], f"layer must lie in [0, {counter.shape[1]}), got {layer}")


def out_proj(
    x: Tensor,
    w: Tensor,
    out: Tensor | None = None,
    counter: Tensor | None = None,
    layer: int = 0,
    tile_order: Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int = 64,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    gemm: str = "auto",
    validate: bool = True,
) -> Tensor:
    """y = x @ w^T with x [M, K] (attention output), w [N, K]; returns (or fills) out [M, N].

    counter: [2, num_layers] int32 from make_layer_counter; when given, counter[0, layer] grows by one
    after every tile is stored, and counter[1, layer] is back to 0. tile_order [G] int32: program i
    computes tile tile_order[i] (tiles are row-major over [cdiv(M, block_m), cdiv(N, block_n)]); tests
    pass a permutation to emulate any schedule, or part of one to emulate tiles still in flight.
    split_k: K-slices (default: enough to fill the SMs at decode M, 1 at prefill M). Above 1, each tile's
    last slice to finish sums the fp32 partials, and the last tile finished bumps the counter, in one launch.
    gemm: "triton" (these kernels), "library" (torch's GEMM, cuBLAS on a GPU, then a one-program bump on
    the same stream) or "auto": the library from M = LIBRARY_M rows up (prefill), Triton below (decode,
    where split-K fills the SMs), and Triton whenever tile_order is given.
    """
    require(gemm in GEMMS, f"gemm must be one of {GEMMS}, got {gemm!r}")
    if validate:
        check_linear(x, w, out)
        if counter is not None:
            check_counter(counter, layer, x.device)
    (m, k), n = x.shape, w.shape[0]
    if tile_order is None and (gemm == "library" or (gemm == "auto" and m >= LIBRARY_M)):
        return _out_proj_library(x, w, new_out(x, w, out), counter, layer)
    big = x.is_cuda and m >= 128  # prefill M: Hopper-sized tiles, 8 warps
    block_m = block_m or (128 if big else min(128, max(16, next_pow2(m))))
    block_n = block_n or (128 if big else 64)
    num_warps = num_warps or (8 if big else 4)
    num_stages = num_stages or 3
    require(
        min(block_m, block_n, block_k) >= 16,
        f"block sizes must be >= 16 (tl.dot), got {(block_m, block_n, block_k)}",
    )
    require(split_k is None or split_k >= 1, f"split_k must be >= 1 or None, got {split_k}")
    out = new_out(x, w, out)
    if tile_order is None and m and n and k:
        split_k = split_k or default_split_k(m, n, k, block_m, block_n, block_k, x.device)
        if split_k > 1:
            return _out_proj_split(x, w, out, counter, layer, block_m, block_n, block_k, split_k)
    num_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if tile_order is not None:
        check_tensor("tile_order", tile_order, 1, (torch.int32, torch.int64), x.device, contiguous=True)
        order = tile_order.cpu()
        require(
            order.unique().numel() == order.numel()
            and (order.numel() == 0 or (int(order.min()) >= 0 and int(order.max()) < num_tiles)),
            f"tile_order must hold distinct tile ids in [0, {num_tiles})",
        )
    grid = (num_tiles if tile_order is None else tile_order.numel(),)
    if grid[0] == 0:
        return out
    _out_proj_kernel[grid](
        x,
        w,
        out,
        counter if counter is not None else out,
        tickets(counter) if counter is not None else out,
        tile_order if tile_order is not None else out,
        m,
        n,
        k,
        layer,
        x.stride(),
        w.stride(),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        HAS_COUNTER=counter is not None,
        HAS_TILE_ORDER=tile_order is not None,
        num_warps=num_warps,
        num_stages=num_stages,
        **gemm_meta(x),
    )
    return out


def _out_proj_split(x, w, out, counter, layer, block_m, block_n, block_k, split_k) -> Tensor:
    (m, k), n = x.shape, w.shape[0]
    grid, ws, tile_tickets = split_workspace(x, m, n, k, block_m, block_n, block_k, split_k)
    _out_proj_split_kernel[grid](
        x,
        w,
        out,
        ws,
        tile_tickets,
        counter if counter is not None else out,
        tickets(counter) if counter is not None else out,
        m,
        n,
        k,
        layer,
        x.stride(),
        w.stride(),
        ws.stride()[:2],
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        HAS_COUNTER=counter is not None,
        **gemm_meta(x),
    )
    return out


def _out_proj_library(x, w, out, counter, layer) -> Tensor:
    """Prefill M: the library GEMM (cuBLAS's Hopper kernels lead our Triton tiles there), then one program
    on the same stream bumps the counter: the stream orders it after every store of the projection."""
    splitk_gemm_ref(x, w, out)
    if counter is not None:
        _bump_kernel[(1,)](counter, tickets(counter), layer)
    return out


def out_proj_ref(
    x: Tensor, w: Tensor, out: Tensor | None = None, counter: Tensor | None = None, layer: int = 0
) -> Tensor:
    """Reference: the GEMM, then one bump of counter[0, layer]."""
    y = splitk_gemm_ref(x, w, out)
    if counter is not None:
        counter[0, layer] += 1
    return y
