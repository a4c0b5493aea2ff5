"""Fast CPU paths behind pdkernels.ops for the torch backend: C++ for the paged cache
(pdkernels/csrc/: paged_cpu.cpp, decode_cpu.cpp, extend_cpu.cpp, linear_cpu.cpp, layers_cpu.cpp; simd_cpu.h
their shared helpers) and oneDNN's prepacked weights for bf16 GEMMs.

Built at first use with torch.utils.cpp_extension (g++ and ninja; about 20 s once, then loaded from
TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions); the engine's Model asks for it when it is
built on the CPU, the main job's driver and the test session before they start processes. Where it
cannot be built, `module()` is None and the torch code runs instead; PDKERNELS_CPU_EXT=0 turns it off.
What it holds:
- decode_attention: reads each sequence's K/V pages where they lie (no gather into a new tensor, no
  cast of the whole KV to fp32), one online-softmax pass per page, threads over sequences.
- kv_append: copies each new token's K/V rows into its (page, entry) slot.
- add_rms_norm: the residual add and RMSNorm in one pass over each row (pdkernels.norm's reference).
- rope: the rotary embedding of Q and K in one pass, bit-identical to pdkernels.rope's reference.
- gather_kv and causal_softmax: extend attention's torch path (pdkernels.extend_attention) gathers a
  sequence's K/V in one copy and takes the scale, causal mask, fp32 softmax and cast of each block of
  scores in one pass (torch's exp alone ran at about 0.7 ns an element here).
- bf16_linear: bf16 linear layers at decode sizes on AVX-512 BF16 CPUs without AMX, from the weight's
  panels (PanelWeight): vdpbf16ps over one sequential stream a panel of 32 columns.
- q8_linear: fp32 linear layers whose weights are exactly int8 blocks (GGUF's Q8_0 and Q4_1, as SmolLM2's
  file holds them), multiplied from the int8 copy at decode sizes (Q8Weight; AVX2 + FMA builds only).
- DenseDecoder: a dense model's decode step (and, on AMX CPUs, a step with prompt tokens) through all its
  layers in one call, the same kernels in the same order as engine.model.Model.forward (layers_cpu.cpp),
  without the Python between them.
- causal_attention_amx / extend_attention_amx (AMX CPUs only): a prompt chunk's causal attention in bf16 on
  oneDNN's brgemm through torch's cpublas, the online softmax in AVX-512 (attention_amx.cpp).
- packed_linear: `linear`'s oneDNN call; on several threads, each thread's own rows where the weight fits a
  core's L2 (linear_cpu.cpp: oneDNN's own division left SmolLM2's down projection at one core's speed).
- decode_attention on AVX-512 BF16 CPUs, bf16 caches: 16 tokens' scores at a time (vdpbf16ps), their
  lanes reduced together, P V accumulated in registers; on AVX2 + FMA CPUs the same shape in 8-lane fp32
  for fp32 and bf16 caches (decode_cpu.cpp). Each beats the portable loop where it is picked
  (docs/results/engine-cpu.md).

`pack(w)` stores a bf16 linear weight in oneDNN's blocked layout (torch.ops.mkldnn, as inductor's
freezing does), and `linear` multiplies by it: the same oneDNN kernels, bit-identical results, but the
weight streams from memory faster at decode sizes (docs/results/engine-cpu.md); on AVX-512 BF16 CPUs
without AMX also as bf16_linear's panels, which decode-sized products read instead (PanelWeight). Where
torch lacks oneDNN, or the dtype is not bf16, `pack` returns the weight as it is.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
from pathlib import Path

import torch
from torch import Tensor

from pdkernels import cpuinfo

log = logging.getLogger(__name__)
SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "paged_cpu.cpp",
        "decode_cpu.cpp",
        "extend_cpu.cpp",
        "linear_cpu.cpp",
        "layers_cpu.cpp",
        "attention_amx.cpp",
    )
]
_lock = threading.Lock()
_module = None
_tried = False


def enabled() -> bool:
    return os.environ.get("PDKERNELS_CPU_EXT", "1") != "0"


def _build_tag() -> str:
    """One build per CPU feature set (it is built with -march=native, and a home may be shared by unlike
    machines; PDKERNELS_CPU_ISA=avx2 narrows the set, cpuinfo.flags) and per checkout: torch's build
    files name the source by its path, so two checkouts sharing one build folder rebuilt each other's
    extension at every switch (a minute each, under a lock)."""
    return hashlib.sha1(f"{cpuinfo.flags()}\n{SOURCES[0].resolve()}".encode()).hexdigest()[:10]


def module():
    """The compiled extension, or None (turned off, or no compiler: the torch code runs)."""
    global _module, _tried
    if _tried or not enabled():
        return _module if enabled() else None
    with _lock:
        if not _tried:
            try:
                _module = _build(f"pdkernels_paged_cpu_{_build_tag()}")
            except Exception as e:  # no compiler, no ninja, no headers: the torch code serves
                log.warning("pdkernels' CPU extension could not be built (%s); using the torch code", e)
            _tried = True
    return _module


def _build(name: str):
    """Build (or load) the extension under an flock of our own: the kernel drops it when its holder dies,
    so a process killed mid-build cannot leave the others waiting forever on torch's lock file, which
    stays behind (seen here: every later process hung at start-up). Holding the flock, any such file is
    a dead builder's, and goes."""
    import fcntl

    from torch.utils.cpp_extension import _get_build_directory, load

    folder = Path(_get_build_directory(name, verbose=False))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{name}.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = folder / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink()
        # PDKERNELS_CPU_ISA=avx2 (cpuinfo): this CPU's AVX2 paths only, its AVX-512 and AMX left out
        narrowed = ["-mno-avx512f", "-mno-amx-tile"] if cpuinfo.forced_isa() == "avx2" else []
        return load(
            name=name,
            sources=[str(path) for path in SOURCES],
            extra_cflags=["-O3", "-march=native", *narrowed, "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )


def for_cache(cache) -> object | None:
    """The extension where it serves this paged cache (a contiguous 5-D tensor on the CPU), else None."""
    if not isinstance(cache, Tensor) or cache.device.type != "cpu" or cache.dim() != 5:
        return None
    return module() if cache.is_contiguous() else None


class PackedWeight:
    """A linear weight [N, K] in oneDNN's blocked layout: only `linear` reads it."""

    __slots__ = ("data", "shape", "dtype", "device")

    def __init__(self, w: Tensor):
        self.data = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        self.shape, self.dtype, self.device = tuple(w.shape), w.dtype, w.device


class Q8Weight(PackedWeight):
    """An fp32 linear weight [N, K] that is exactly int8 blocks, w = q * scale + offset per 32 of a row
    (how GGUF's Q8_0 and Q4_1 weights dequantize: SmolLM2's file holds both), kept both ways: up to
    Q8_MAX_M rows of x (decode steps, small batches) multiply the int8 copy (linear_cpu.cpp: 1.25 bytes a
    weight to stream instead of 4, the same products summed in another order), more rows (prefill) the
    fp32 weight with torch's GEMM as before. The copy is in panels of 8 rows: q [N / 8, K, 8] int8,
    scales and offsets [N / 8, K / 32, 8] fp32."""

    __slots__ = ("q", "scales", "offsets")

    def __init__(self, w: Tensor, q: Tensor, scales: Tensor, offsets: Tensor):
        self.data, self.q, self.scales, self.offsets = w, q, scales, offsets
        self.shape, self.dtype, self.device = tuple(w.shape), w.dtype, w.device

    def dequantized(self) -> Tensor:
        """The copy as the fp32 weight [N, K] it stands for (q * scale + offset, rounded once)."""
        n, k = self.shape
        scales, offsets = (t.repeat_interleave(32, dim=1) for t in (self.scales, self.offsets))
        w = torch.addcmul(offsets.double(), self.q.double(), scales.double()).float()  # exact, then rounded
        return w.permute(0, 2, 1).reshape(-1, k)[:n]


class PanelWeight(PackedWeight):
    """A bf16 linear weight [N, K] kept both ways on AVX-512 BF16 CPUs without AMX: up to PANEL_MAX_M rows of
    x (decode steps, small batches) multiply `panels`, the weight in panels of 32 columns a pair of k apart
    ([N / 32, K / 2, 32, 2], linear_cpu.cpp's bf16_linear: one sequential stream a panel, read at the
    machine's streaming rate, each row's sums the same whatever M); more rows (prefill) oneDNN's packed
    copy in `data` as before. Twice a weight's memory, for the decode step's speed."""

    __slots__ = ("panels",)

    def __init__(self, w: Tensor, panels: Tensor):
        super().__init__(w)
        self.panels = panels


# Rows of x up to which the panels serve: a step's projections 1.35-2.0x faster than oneDNN's at 1-32 rows
# on an AVX-512 BF16 EPYC (experiments/bench/bench_bf16_linear.py, docs/results/engine-cpu.md); past them
# the prefill's GEMMs stay oneDNN's. AMX CPUs keep oneDNN's kernels, not measured against the panels there
PANEL_MAX_M = 32

# Rows of x up to which the int8 copy serves: below it the int8 product reads a quarter of the bytes and
# beats the fp32 GEMM; from about 64 rows the GEMM's arithmetic wins (timed: docs/results/engine-cpu.md)
Q8_MAX_M = 32


def pack(w: Tensor) -> Tensor | PackedWeight:
    """w packed for `linear` where that helps: bf16 in oneDNN's layout (oneDNN present) and, where
    panels_serve, as panels too (PanelWeight; an even K), fp32 that is exactly int8 blocks also as those
    (Q8Weight; the C++ extension built); otherwise w itself."""
    if not enabled() or w.device.type != "cpu":
        return w
    if w.dtype == torch.float32:
        ext = module()
        if ext is None or not hasattr(ext, "q8_quantize_exact"):  # built without AVX2: no int8 kernel
            return w
        exact = ext.q8_quantize_exact(w.contiguous())
        return Q8Weight(w, *exact) if exact is not None else w
    if w.dtype != torch.bfloat16:
        return w
    try:
        if panels_serve() and w.dim() == 2 and w.shape[1] % 2 == 0:
            return PanelWeight(w, module().bf16_pack_panels(w.contiguous()))
        return PackedWeight(w)
    except (RuntimeError, AttributeError) as e:  # a torch built without oneDNN, a CPU without bf16
        _unpacked(str(e))
        return w


def panels_serve() -> bool:
    """Whether `pack` gives bf16 weights panels too (PanelWeight): the extension built with AVX-512 BF16, on a
    CPU without AMX (by ISA, cpuinfo.isa)."""
    ext = module() if enabled() else None
    return ext is not None and hasattr(ext, "bf16_linear") and cpuinfo.isa() == "avx512_bf16"


@functools.cache
def _unpacked(why: str) -> None:
    """Said once a process, not once a weight (a model has hundreds)."""
    log.warning("bf16 weights stay unpacked (%s)", why)


def linear(x: Tensor, w: PackedWeight, out: Tensor | None = None) -> Tensor:
    """x [M, K] @ w^T."""
    if isinstance(w, Q8Weight):
        if x.shape[0] > Q8_MAX_M:
            return torch.mm(x, w.data.t(), out=out)
        x = x if x.stride(-1) == 1 else x.contiguous()
        y = module().q8_linear(x, w.q, w.scales, w.offsets, w.shape[0])
    elif isinstance(w, PanelWeight) and x.shape[0] <= PANEL_MAX_M:
        x = x if x.stride(-1) == 1 and x.stride(0) % 2 == 0 else x.contiguous()
        y = module().bf16_linear(x, w.panels, w.shape[0])
    elif (ext := module()) is not None:
        y = ext.packed_linear(x, w.data)
    else:
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), w.data, None, "none", [], "")
    return y if out is None else out.copy_(y)
