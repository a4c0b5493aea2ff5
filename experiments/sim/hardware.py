"""Accelerator presets for the cost model. Every number is the vendor's datasheet figure (dense, no
sparsity), marked as such: the cost model's efficiency factors turn peaks into what kernels reach."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

CONF_HARDWARE = Path(__file__).resolve().parents[2] / "conf" / "hardware"
GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # peak dense bf16/fp16 FLOP/s of one device
    hbm_bw: float  # bytes/s
    hbm_bytes: float
    nvlink_bw: float  # bytes/s one way per device (all-reduce bandwidth within a node)
    nic_bw: float  # bytes/s per device across nodes (KV transfer between nodes)
    devices_per_node: int = 8
    source: str = "datasheet"
    # latency of one small all-reduce, and of one all-to-all exchange, between the ranks (0: none counted,
    # as a datasheet gives none; measured on a CPU by experiments.sim.calibrate.measure_collectives)
    allreduce_s: float = 0.0
    alltoall_s: float = 0.0
    # a streaming read's bytes/s (what a decode step's weight and KV reads are bounded by; a copy, hbm_bw,
    # also writes); 0: not measured (a datasheet gives one figure, hbm_bw)
    read_bw: float = 0.0
    # whether it computes in bf16 (a GPU, a CPU with AVX-512 BF16 or AMX): a CPU without converts in every
    # GEMM, and chunk_size auto gives it another budget (serving.config.prefill_budget)
    bf16: bool = True

    def __post_init__(self):
        for key in ("flops", "hbm_bw", "hbm_bytes", "nvlink_bw", "nic_bw", "devices_per_node"):
            if not getattr(self, key) > 0:
                raise ValueError(f"hardware.{key} must be > 0, got {getattr(self, key)!r}")
        for key in ("allreduce_s", "alltoall_s", "read_bw"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"hardware.{key} must be >= 0, got {getattr(self, key)!r}")


HARDWARE = {
    # NVIDIA A100 80GB SXM datasheet: 312 TFLOPS bf16 dense, 2039 GB/s HBM2e, NVLink 600 GB/s total
    # (300 GB/s each way); DGX A100: one 200 Gb/s HDR NIC per GPU.
    "a100-80gb": Hardware("a100-80gb", 312 * TFLOPS, 2039 * GB, 80 * GB, 300 * GB, 25 * GB),
    # NVIDIA H100 SXM datasheet: 989 TFLOPS bf16 dense, 3.35 TB/s HBM3, NVLink 900 GB/s total;
    # DGX H100: one 400 Gb/s NIC per GPU.
    "h100": Hardware("h100", 989 * TFLOPS, 3350 * GB, 80 * GB, 450 * GB, 50 * GB),
    # NVIDIA H200 SXM datasheet: 989 TFLOPS bf16 dense, 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s total.
    "h200": Hardware("h200", 989 * TFLOPS, 4800 * GB, 141 * GB, 450 * GB, 50 * GB),
}


def hardware(name: str) -> Hardware:
    if name not in HARDWARE:
        raise ValueError(f"hardware must be one of {sorted(HARDWARE)}, got {name!r}")
    return HARDWARE[name]


def hardware_of(cfg: dict) -> Hardware:
    """conf/hardware/: a preset by name, a machine's measured figures in full, or `measure:` this machine
    (measured_here)."""
    from serving.config import of_dict

    if "measure" in cfg:
        return measured_here(cfg)
    return hardware(cfg["name"]) if set(cfg) == {"name"} else of_dict(Hardware, "hardware", cfg)


DTYPES = ("bfloat16", "float32")


def best_time(fn, device: str = "cpu", rounds: int = 5) -> float:
    """The fastest of `rounds` calls of fn (after one to warm up), synchronising a GPU around each."""
    import torch

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    fn()
    times = []
    for _ in range(rounds):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(threads: int, device: str = "cpu", dtype: str = "bfloat16") -> Hardware:
    """This device as the cost model sees one: a square GEMM's FLOP/s in dtype (oneDNN picks AMX, AVX-512
    or AVX2 by the CPU's ISA), a memory copy's bandwidth and a streaming read's (a sum over a buffer far
    larger than the caches), with `threads` threads."""
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    torch.set_num_threads(threads)
    n = 8192 if device.startswith("cuda") else 1024
    a, b = (torch.randn(n, n, dtype=getattr(torch, dtype), device=device) for _ in range(2))
    flops = 2 * n**3 / best_time(lambda: a @ b, device)
    x = torch.empty((1 << 30) if device.startswith("cuda") else (64 << 20), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    bw = 2 * x.numel() / best_time(lambda: y.copy_(x), device)  # read + write
    x = y = None  # freed before the next buffer
    z = torch.ones((1 << 28) if device.startswith("cuda") else (64 << 20), dtype=torch.float32, device=device)
    read = z.numel() * 4 / best_time(lambda: z.sum(), device)  # 256 MB on a CPU: far past its caches
    figures = dict(devices_per_node=1, source="measured here", read_bw=read)
    if device.startswith("cuda"):
        mem = torch.cuda.get_device_properties(device).total_memory
        return Hardware("cuda-measured", flops, bw, mem, bw, bw, **figures)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware("cpu-measured", flops, bw, mem, bw, bw, **figures)


def cpu_model(default: str | None = "unknown") -> str | None:
    """/proc/cpuinfo's model name (what the cache of measured machines is keyed by), or default."""
    try:
        with open("/proc/cpuinfo") as f:
            names = (line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
            return next(names, default)
    except OSError:
        return default


def cache_dir() -> Path:
    """Where measured machines are kept: $PDK_CACHE_DIR, else $XDG_CACHE_HOME/pdkernels (~/.cache)."""
    base = os.environ.get("PDK_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdkernels"
    )
    return Path(base) / "machines"


def measured_here(cfg: dict) -> Hardware:
    """A machine model of the CPU the simulator runs on (conf/hardware/cpu-this-machine.yaml): its GEMM
    peak in `measure.dtype` (auto: what the engine computes in here, bf16 where the CPU has it, else
    float32, as model.dtype auto) and its copy bandwidth with `measure.threads` threads, measured once per
    CPU model and ISA (two EPYCs both named "AMD EPYC" differ 80x in bf16 GEMMs with and without AVX-512)
    and kept in cache_dir(); the memory size and the NIC (the messenger's rate) come from cfg."""
    from pdkernels.cpuinfo import auto_dtype, isa, native_bf16

    spec = cfg["measure"] or {}
    threads, dtype = int(spec.get("threads", 1)), str(spec.get("dtype", "auto"))
    if threads < 1 or dtype not in (*DTYPES, "auto"):
        raise ValueError(
            f"hardware.measure must have threads >= 1 and dtype one of {(*DTYPES, 'auto')}, got {threads}, "
            f"{dtype!r}"
        )
    if dtype == "auto":
        dtype = auto_dtype()
    cpu, vector = cpu_model(), isa()
    key = f"{cpu}-{vector}-{threads}t-{dtype}"
    path = cache_dir() / (re.sub(r"[^A-Za-z0-9]+", "-", key).strip("-") + ".json")
    try:
        figures = json.loads(path.read_text())
        flops, bw, when = float(figures["flops"]), float(figures["hbm_bw"]), str(figures["measured"])
        read = float(figures["read_bw"])
    except (OSError, ValueError, KeyError, TypeError):
        hw = measure(threads, "cpu", dtype)
        flops, bw, read, when = hw.flops, hw.hbm_bw, hw.read_bw, time.strftime("%Y-%m-%d")
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "cpu": cpu,
            "isa": vector,
            "threads": threads,
            "dtype": dtype,
            "flops": flops,
            "hbm_bw": bw,
            "read_bw": read,
            "measured": when,
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(path)
    return Hardware(
        str(cfg["name"]), flops, bw, float(cfg["hbm_bytes"]), bw, float(cfg["nic_bw"]), devices_per_node=1,
        source=f"measured here: {cpu} ({vector}), {threads} thread(s), {dtype}, {when} ({path})",
        bf16=native_bf16(), read_bw=read,
    )  # fmt: skip


def load_hardware(name: str) -> Hardware:
    """conf/hardware/NAME.yaml."""
    path = CONF_HARDWARE / f"{name}.yaml"
    if not path.exists():
        choices = sorted(p.stem for p in CONF_HARDWARE.glob("*.yaml"))
        raise ValueError(f"hardware must be one of {choices}, got {name!r}")
    return hardware_of(yaml.safe_load(path.read_text()))
