"""Host tensors page-locked in place, for tables that live on the host and are copied to a CUDA device.

PyTorch's pinned allocator (`pin_memory=True`, `.pin_memory()`) rounds every block up to a power of two and
keeps freed blocks cached: a table of 1 GiB + 1 MiB pins 2 GiB, and a replaced table stays pinned. `empty()`
maps ordinary memory instead and page-locks exactly that (`cudaHostRegister`); the memory is unlocked when the
last tensor on it is freed, just before it is unmapped. Page-locking that fails leaves the memory pageable,
with one WARNING: it is host memory, so its failure is never an out-of-memory error of the device.
"""

import logging
import math
import mmap
import os
import threading
from typing import Optional, Protocol, Sequence

import torch

__all__ = ["Registrar", "CudaRegistrar", "PinnedHost", "HOST", "empty"]

log = logging.getLogger("toma")


class Registrar(Protocol):
    """Page-locks host memory for copies to CUDA devices, and unlocks it."""

    def register(self, address: int, nbytes: int, device: torch.device) -> None:
        """Page-lock `nbytes` bytes at `address`; raises when it cannot."""

    def unregister(self, address: int) -> None:
        """Unlock the memory `register` locked at `address`."""


class CudaRegistrar:
    """The CUDA runtime's `cudaHostRegister` and `cudaHostUnregister`."""

    def register(self, address: int, nbytes: int, device: torch.device) -> None:
        with torch.cuda.device(device):
            code = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))
            if code != 0:
                _clear_cuda_error(device)
                raise torch.cuda.CudaError(code)

    def unregister(self, address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)


def _clear_cuda_error(device: torch.device) -> None:
    """A failed runtime call stays the thread's last CUDA error, which the next kernel launch would report as
    its own (a failed registration's "out of memory" as the device's). A launch reads it, and so clears it."""
    try:
        torch.empty(1, device=device).fill_(0)
    except RuntimeError:
        pass


class PinnedHost:
    """Makes page-locked host tensors through `registrar` and counts the bytes locked (`registered_bytes`)."""

    def __init__(self, registrar: Registrar) -> None:
        self.registrar = registrar
        self.registered_bytes = 0
        self.failures = 0  # registrations that failed (the first one is logged as a WARNING)
        self._lock = threading.RLock()  # RLock: a region freed by the collector while the lock is held

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised host tensor page-locked for copies to `device` (pageable if that fails)."""
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        region = _Region(-1, nbytes, **_PRIVATE)
        # The storage holds `region` for as long as any tensor uses it, so its `__del__` runs exactly then.
        tensor = torch.frombuffer(region, dtype=dtype, count=count)
        address = tensor.data_ptr()
        try:
            self.registrar.register(address, nbytes, device)
        except Exception as error:  # host memory: fall back to pageable, never an OOM for the engine
            self._failed(nbytes, error)
        else:
            with self._lock:
                self.registered_bytes += nbytes
            region.host, region.address, region.nbytes, region.pid = self, address, nbytes, os.getpid()
        return tensor.view(tuple(shape))

    def _failed(self, nbytes: int, error: Exception) -> None:
        with self._lock:
            self.failures += 1
            first = self.failures == 1
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "could not page-lock %d bytes of host memory (%s: %s); the table stays in pageable memory%s",
            nbytes,
            type(error).__name__,
            error,
            " (further failures are logged at DEBUG)" if first else "",
        )

    def release(self, address: int, nbytes: int) -> None:
        """Unlock a region being freed."""
        try:
            self.registrar.unregister(address)
        except Exception:  # CUDA shutting down with the interpreter: the memory is unmapped next anyway
            pass
        with self._lock:
            self.registered_bytes -= nbytes


class _Region(mmap.mmap):
    """Anonymous memory that unlocks itself when freed, before `mmap` unmaps it; once, in the process that
    locked it (a forked child's copy is not locked)."""

    host: Optional[PinnedHost] = None
    address = 0
    nbytes = 0
    pid = 0

    def __del__(self) -> None:
        try:
            host, self.host = self.host, None
            if host is not None and self.pid == os.getpid():
                host.release(self.address, self.nbytes)
        except Exception:
            pass


_PRIVATE = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}

HOST = PinnedHost(CudaRegistrar())


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`HOST.empty(...)`: an uninitialised host tensor page-locked for copies to the CUDA device `device`."""
    return HOST.empty(shape, dtype, device)
