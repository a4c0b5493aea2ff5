"""Accelerator presets for the cost model. Every number is the vendor's datasheet figure (dense, no
sparsity), marked as such: the cost model's efficiency factors turn peaks into what kernels reach."""

from __future__ import annotations

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

    def __post_init__(self):
        for key in ("flops", "hbm_bw", "hbm_bytes", "nvlink_bw", "nic_bw", "devices_per_node"):
            if not getattr(self, key) > 0:
                raise ValueError(f"hardware.{key} must be > 0, got {getattr(self, key)!r}")
        for key in ("allreduce_s", "alltoall_s"):
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
    """conf/hardware/: a preset by name, or a machine's measured figures in full."""
    from experiments.deploy.config import of_dict

    return hardware(cfg["name"]) if set(cfg) == {"name"} else of_dict(Hardware, "hardware", cfg)


def load_hardware(name: str) -> Hardware:
    """conf/hardware/NAME.yaml."""
    path = CONF_HARDWARE / f"{name}.yaml"
    if not path.exists():
        choices = sorted(p.stem for p in CONF_HARDWARE.glob("*.yaml"))
        raise ValueError(f"hardware must be one of {choices}, got {name!r}")
    return hardware_of(yaml.safe_load(path.read_text()))
