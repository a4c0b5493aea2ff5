"""What this CPU computes with, read off its feature flags: what `dtype: auto` picks, which fast path serves,
and the ISA a measured figure is put beside. No torch here: the server's front asks it too."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

# PDKERNELS_CPU_ISA: "native" (the default) computes with all this CPU has; "avx2" makes this process see
# it as an AVX2-only CPU (no AVX-512, no AMX: what `dtype: auto` picks and which fast paths serve) and builds
# the C++ extension without them (pdkernels.cpu), so that a CPU with both runs, and tests, the AVX2 paths
FORCED_ISAS = ("native", "avx2")


def forced_isa() -> str:
    """PDKERNELS_CPU_ISA's value (FORCED_ISAS), or a ValueError naming the allowed ones."""
    value = os.environ.get("PDKERNELS_CPU_ISA", "native")
    if value not in FORCED_ISAS:
        raise ValueError(f"PDKERNELS_CPU_ISA={value!r}: the allowed values are {', '.join(FORCED_ISAS)}")
    return value


@functools.cache
def flags() -> str:
    """This CPU's feature flags (/proc/cpuinfo), or what platform says where there is none; under
    PDKERNELS_CPU_ISA=avx2 without the AVX-512 and AMX ones. Read once: native_bf16 asks on every extend
    attention call, and reading /proc/cpuinfo took 50-240 us (7 ms of a 128-token prompt's prefill,
    measured here)."""
    try:
        line = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        line = platform.processor() or platform.machine()
    if forced_isa() == "avx2":
        line = " ".join(f for f in line.split(" ") if not f.startswith(("avx512", "amx")))
    return line


def native_bf16() -> bool:
    """Whether this CPU computes in bf16 (AVX-512 BF16 or AMX): there bf16 weights halve what a step
    streams; without it every bf16 GEMM converts, and float32 is faster (5x on an AVX2-only EPYC)."""
    have = set(flags().split())
    return bool(have & {"avx512_bf16", "amx_bf16"})


def auto_dtype() -> str:
    """What `dtype: auto` computes in on this CPU: bfloat16 where it has bf16 arithmetic, else float32."""
    return "bfloat16" if native_bf16() else "float32"


def isa() -> str:
    """The widest vector ISA this CPU computes with, as the fast paths pick by it: amx (AMX tiles for bf16),
    avx512_bf16, avx512, avx2 or baseline. What a measured figure is put beside, with the CPU's model."""
    have = set(flags().split())
    for name, needs in (
        ("amx", "amx_bf16"),
        ("avx512_bf16", "avx512_bf16"),
        ("avx512", "avx512f"),
        ("avx2", "avx2"),
    ):
        if needs in have:
            return name
    return "baseline"


def amx_bf16() -> bool:
    """Whether this CPU has AMX tiles for bf16 (Xeon from Sapphire Rapids on): oneDNN's and torch's own
    bf16 kernels use them, and what suits AVX-512 BF16 alone may not suit them."""
    return "amx_bf16" in set(flags().split())
