"""Attention output projection ``y = x @ W_o^T`` that signals "layer done" once all of its tiles are stored.

Ticket pattern: after storing its tile, every program takes a ticket (an acq_rel atomic add on
``counter[1, layer]``). The program that draws the last ticket knows every other tile is stored, resets
the ticket to 0 for the next pass and bumps ``counter[0, layer]`` by exactly one. A host thread (the
prefill messenger) polls ``counter[0, layer]`` to learn that the layer's KV is in the cache: the
signal is kernel-side, so it also works inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdkernels._paging import check_tensor, next_pow2, require
from pdkernels.splitk_gemm import check_linear, gemm_meta, gemm_tile, new_out, splitk_gemm_ref

__all__ = ["out_proj", "out_proj_ref", "make_layer_counter"]


@triton.jit
def _out_proj_kernel(
    # pointers
    x_ptr,
    w_ptr,
    y_ptr,
    counter_ptr,
    tile_order_ptr,
    # sizes
    M,
    N,
    K,
    layer,
    # strides
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_counter,
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
        stride_xm,
        stride_xk,
        stride_wn,
        stride_wk,
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
    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
    if HAS_COUNTER:
        tl.debug_barrier()  # every thread's stores of this tile precede the ticket
        ticket = tl.atomic_add(counter_ptr + stride_counter + layer, 1, sem="acq_rel")
        last = ticket == tl.cdiv(M, BLOCK_M) * num_n - 1
        # Only the last program gets here with last=True; masks keep it branch-free.
        tl.atomic_xchg(counter_ptr + stride_counter + layer, 0, mask=last, sem="relaxed")
        tl.atomic_add(counter_ptr + layer, 1, mask=last, sem="release")


def make_layer_counter(num_layers: int, device: torch.device | str = "cpu") -> Tensor:
    """counter [2, num_layers] int32: row 0 counts finished passes per layer, row 1 is ticket scratch."""
    require(num_layers >= 1, f"num_layers must be >= 1, got {num_layers}")
    return torch.zeros((2, num_layers), dtype=torch.int32, device=device)


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
    block_n: int = 64,
    block_k: int = 64,
    validate: bool = True,
) -> Tensor:
    """y = x @ w^T with x [M, K] (attention output), w [N, K]; returns (or fills) out [M, N].

    counter: [2, num_layers] int32 from make_layer_counter; when given, counter[0, layer] grows by one
    after every tile is stored, and counter[1, layer] is back to 0. tile_order [G] int32: program i
    computes tile tile_order[i] (tiles are row-major over [cdiv(M, block_m), cdiv(N, block_n)]); tests
    pass a permutation to emulate any schedule, or part of one to emulate tiles still in flight.
    """
    if validate:
        check_linear(x, w, out)
        if counter is not None:
            check_counter(counter, layer, x.device)
    out = new_out(x, w, out)
    (m, k), n = x.shape, w.shape[0]
    block_m = block_m or min(128, max(16, next_pow2(m)))
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
        tile_order if tile_order is not None else out,
        m,
        n,
        k,
        layer,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        counter.stride(0) if counter is not None else 0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        HAS_COUNTER=counter is not None,
        HAS_TILE_ORDER=tile_order is not None,
        **gemm_meta(x),
    )
    return out


def out_proj_ref(
    x: Tensor, w: Tensor, out: Tensor | None = None, counter: Tensor | None = None, layer: int = 0
) -> Tensor:
    """Reference: the GEMM, then one bump of counter[0, layer]."""
    y = splitk_gemm_ref(x, w, out)
    if counter is not None:
        counter[0, layer] += 1
    return y
