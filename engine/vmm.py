"""GPU memory that another process can map: CUDA VMM through cuda-python (the `gpu` extra).

With tensor parallelism on GPUs, each TP rank allocates its KV cache with `cuMemCreate` and exports it as a
POSIX file descriptor; the lead process imports the descriptor (`cuMemImportFromShareableHandle`), maps
it into its own address space (`cuMemMap`) and registers every rank's cache with one NIXL agent, so one
messenger reads and writes all ranks' pages. The descriptor travels over a Unix socket (SCM_RIGHTS:
`multiprocessing.reduction.send_handle`), never as bytes a peer could forge.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise ImportError("CUDA VMM needs cuda-python: pip install '.[gpu]'") from e
    return driver


def _ok(result):
    """cuda-python returns (error, values...): raise on an error, else the values."""
    driver = _driver()
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return values[0] if len(values) == 1 else tuple(values)


class _View:
    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class SharedAllocation:
    """nbytes of device memory (rounded up to the VMM granularity), mapped into this process."""

    def __init__(self, nbytes: int, device: int = 0, fd: int | None = None):
        """A new allocation, or (fd given) one exported by another process, imported and mapped here."""
        driver = _driver()
        torch.cuda.init()  # the primary context, current in this thread
        self.device = device
        fd_type = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        prop.requestedHandleTypes = fd_type
        granularity = _ok(
            driver.cuMemGetAllocationGranularity(
                prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            )
        )
        self.nbytes = -(-nbytes // granularity) * granularity
        if fd is None:
            self.handle = _ok(driver.cuMemCreate(self.nbytes, prop, 0))
        else:
            self.handle = _ok(driver.cuMemImportFromShareableHandle(fd, fd_type))
        self.ptr = _ok(driver.cuMemAddressReserve(self.nbytes, 0, 0, 0))
        _ok(driver.cuMemMap(self.ptr, self.nbytes, 0, self.handle, 0))
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _ok(driver.cuMemSetAccess(self.ptr, self.nbytes, [access], 1))
        self._fd_type = fd_type

    def export_fd(self) -> int:
        """A descriptor another process can import (send it with multiprocessing.reduction.send_handle)."""
        return _ok(_driver().cuMemExportToShareableHandle(self.handle, self._fd_type, 0))

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A CUDA tensor over the start of this allocation (it must outlive the tensor)."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.nbytes:
            raise ValueError(
                f"a {tuple(shape)} {dtype} tensor needs {nbytes} bytes; the allocation has {self.nbytes}"
            )
        with torch.cuda.device(self.device):
            raw = torch.as_tensor(_View(int(self.ptr), nbytes), device=f"cuda:{self.device}")
        return raw.view(dtype).view(shape)

    def close(self) -> None:
        driver = _driver()
        _ok(driver.cuMemUnmap(self.ptr, self.nbytes))
        _ok(driver.cuMemAddressFree(self.ptr, self.nbytes))
        _ok(driver.cuMemRelease(self.handle))
