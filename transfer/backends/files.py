"""A file of fixed-size slots behind NIXL's POSIX backend (the nixl wheel we ship has it; Dynamo KVBM's disk
tier uses it too): slots are read into and written from one registered host buffer. No KV byte goes
through hand-written file I/O; the file is only created (never through a symlink), sized (its free space
checked, then fallocate, so a full disk fails here and not mid-run, and gives back what it took) and
closed by this module.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat

import numpy as np
from torch import Tensor

from transfer.backends.base import TransferError
from transfer.backends.nixl import _nixl

log = logging.getLogger(__name__)
_names = itertools.count()


def _reserve(fd: int, path: str, size: int) -> None:
    """Size the file to `size` bytes with its blocks allocated: refused before anything is written when
    the file is not this user's regular file or its file system has not that much room, and given back
    (truncated to what it was) when allocating fails part way."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise OSError(errno.EPERM, f"{path} is not a regular file of this user's")
    missing = max(0, size - st.st_blocks * 512)
    fs = os.fstatvfs(fd)
    free = fs.f_bavail * fs.f_frsize
    if missing > free:
        raise OSError(errno.ENOSPC, f"{path} needs {missing} more bytes and its file system has {free} free")
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.ftruncate(fd, st.st_size)  # what a failed fallocate allocated past the old end goes back
        raise


def open_nofollow(path: str, flags: int, mode: int = 0o600) -> int:
    """os.open that never follows a symlink (a planted link fails with ELOOP: OSError)."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


class NixlFiles:
    def __init__(self, path: str, num_slots: int, slot_bytes: int, memory: Tensor):
        """Open (or create) path as num_slots slots of slot_bytes each; memory: the host buffer (uint8,
        contiguous) every transfer reads from or writes into. Raises OSError when the file cannot be
        made that large (a full disk) and TransferError when NIXL cannot register it."""
        if memory.is_cuda or not memory.is_contiguous():
            raise ValueError("NixlFiles needs a contiguous host buffer")
        self.path, self.num_slots, self.slot_bytes = path, num_slots, slot_bytes
        # never through a symlink (ELOOP), and only a regular file of this user's
        self.fd = open_nofollow(path, os.O_RDWR | os.O_CREAT)
        try:
            _reserve(self.fd, path, num_slots * slot_bytes)
            api = _nixl()
            config = api.nixl_agent_config(enable_prog_thread=False, backends=["POSIX"])
            self.agent = api.nixl_agent(f"files-{os.getpid()}-{next(_names)}", config)
            if "POSIX" not in self.agent.backends:
                raise TransferError("NIXL could not start its POSIX backend on this machine")
            self.memory, self.base = memory, memory.data_ptr()
            self.agent.register_memory([(self.base, memory.numel(), 0, "")], "DRAM")
            self.agent.register_memory([(0, num_slots * slot_bytes, self.fd, "")], "FILE")
        except Exception:
            os.close(self.fd)
            raise

    def start(self, op: str, pairs: list[tuple[int, int]], nbytes: int) -> object:
        """Begin op ("READ": file -> memory, "WRITE": memory -> file) of nbytes for each (memory offset,
        slot) pair; returns a handle for state()/release()."""
        mem = np.array([(self.base + m, nbytes, 0) for m, _ in pairs], dtype=np.uint64)
        file = np.array([(s * self.slot_bytes, nbytes, self.fd) for _, s in pairs], dtype=np.uint64)
        try:
            local = self.agent.get_xfer_descs(mem, "DRAM")
            far = self.agent.get_xfer_descs(file, "FILE")
            handle = self.agent.initialize_xfer(op, local, far, self.agent.name)
            if self.agent.transfer(handle) == "ERR":
                self.agent.release_xfer_handle(handle)
                raise TransferError(f"NIXL refused a {op} of {len(pairs)} slots of {self.path}")
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(f"NIXL refused a {op} of {len(pairs)} slots of {self.path}: {e}") from e
        return handle

    def state(self, handle: object) -> str:
        """'DONE', 'PROC' (in progress) or 'ERR'."""
        try:
            return self.agent.check_xfer_state(handle)
        except Exception as e:
            log.warning("NIXL lost track of a file transfer on %s: %s", self.path, e)
            return "ERR"

    def release(self, handle: object) -> None:
        self.agent.release_xfer_handle(handle)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
