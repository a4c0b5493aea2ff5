"""Random packet loss on a host's link without netem: a six-instruction eBPF classifier on the NIC's egress.

Kernels built without sch_netem (and without the gact action a classic filter would drop with) still run
eBPF traffic-control programs: `cls_bpf` in direct-action mode returns TC_ACT_SHOT for a packet to drop.
The program draws bpf_get_prandom_u32() per packet and drops it when the draw is below loss x 2^32, so
each packet is lost independently with that probability (netem's plain `loss p%`). It is loaded with the
bpf(2) system call, pinned for a moment in a bpf filesystem mounted in a private folder (tc takes a
program by its pinned path: `pinned`), attached to each NIC (netns.Hosts), then unpinned and unmounted:
the filters keep it alive, and it goes with the NICs when the namespaces are deleted. Nothing here reads a
packet's contents.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import struct
import subprocess
import tempfile

SYS_BPF = 321  # x86-64
BPF_PROG_LOAD, BPF_OBJ_PIN = 5, 6
BPF_PROG_TYPE_SCHED_CLS = 3
TC_ACT_OK, TC_ACT_SHOT = 0, 2
HELPER_GET_PRANDOM_U32 = 7


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def program(loss_pct: float) -> bytes:
    """The classifier's instructions: drop with probability loss_pct / 100."""
    if not 0 <= loss_pct <= 100:
        raise ValueError(f"loss_pct={loss_pct!r} is not allowed: a percentage in [0, 100]")
    if loss_pct >= 100:
        return _insn(0xB7, dst=0, imm=TC_ACT_SHOT) + _insn(0x95)  # r0 = SHOT; exit
    below = round(loss_pct / 100 * 2**32)  # draws in [0, below) are dropped
    signed = below - 2**32 if below >= 2**31 else below  # the immediate is 32 bits, compared unsigned
    return b"".join(
        [
            _insn(0x85, imm=HELPER_GET_PRANDOM_U32),  # r0 = bpf_get_prandom_u32()
            _insn(0xA6, dst=0, off=2, imm=signed),  # if (u32) r0 < below: goto drop (BPF_JMP32 | JLT | K)
            _insn(0xB7, dst=0, imm=TC_ACT_OK),  # r0 = OK
            _insn(0x95),  # exit
            _insn(0xB7, dst=0, imm=TC_ACT_SHOT),  # drop: r0 = SHOT
            _insn(0x95),  # exit
        ]
    )


def _bpf(cmd: int, attr: bytes) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(attr.ljust(128, b"\0"), 128)
    result = libc.syscall(SYS_BPF, cmd, buf, 128)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf({cmd}): {os.strerror(err)}")
    return result


def load(loss_pct: float) -> int:
    """The loaded program's file descriptor (the caller closes it)."""
    code = ctypes.create_string_buffer(program(loss_pct))
    license_ = ctypes.create_string_buffer(b"GPL")  # bpf_get_prandom_u32 is offered to any license
    log = ctypes.create_string_buffer(4096)
    attr = struct.pack(
        "<IIQQIIQ",
        BPF_PROG_TYPE_SCHED_CLS,
        (len(code) - 1) // 8,  # create_string_buffer adds a NUL
        ctypes.addressof(code),
        ctypes.addressof(license_),
        1,  # log level: the verifier says why, if it refuses
        len(log),
        ctypes.addressof(log),
    )
    try:
        return _bpf(BPF_PROG_LOAD, attr)
    except OSError as e:
        raise RuntimeError(
            f"cluster.link.loss_pct needs eBPF traffic-control programs (bpf(2) and cls_bpf), which this "
            f"machine refused: {e}; {log.value.decode(errors='replace').strip()}"
        ) from None


@contextlib.contextmanager
def pinned(loss_pct: float):
    """The loaded program pinned in a bpf filesystem mounted in a private folder, for as long as the
    caller attaches it (`tc filter add dev D egress bpf da object-pinned <path>`, as many NICs as it
    likes); then unpinned and unmounted: each filter keeps it alive."""
    fd = load(loss_pct)
    folder = tempfile.mkdtemp(prefix="pdk-bpf-")
    mounted = False
    try:
        subprocess.run(["mount", "-t", "bpf", "bpf", folder], check=True, capture_output=True, text=True)
        mounted = True
        path = os.path.join(folder, "loss")
        name = ctypes.create_string_buffer(path.encode())
        _bpf(BPF_OBJ_PIN, struct.pack("<QI", ctypes.addressof(name), fd))
        yield path
    except subprocess.CalledProcessError as e:
        raise RuntimeError(
            f"cluster.link.loss_pct: mounting a bpf filesystem failed: {e.stderr.strip()}"
        ) from None
    finally:
        os.close(fd)
        if mounted:
            subprocess.run(["umount", folder], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)
