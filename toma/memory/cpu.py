"""CPU memory: what is available to this process, a cap on it, and whether an error means it ran out."""

import ctypes
import gc
import logging
import math
import numbers
import sys
import time
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import psutil


__all__ = [
    "get_available_cpu_memory",
    "address_space_limit",
    "set_cpu_memory_limit",
    "set_cpu_memory_headroom",
    "settled_address_space",
    "predictable_heap",
    "is_out_of_cpu_memory",
]

log = logging.getLogger("toma")

try:
    import resource
except ImportError:  # Windows has no rlimits.
    resource = None  # type: ignore[assignment]

CPU_OOM_MARKERS = (
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
)

_process: Optional["psutil.Process"] = None


def address_space_limit() -> Optional[int]:
    """The enforced RLIMIT_AS in bytes, or None when there is none."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limits = [limit for limit in (soft, hard) if limit != resource.RLIM_INFINITY]
    return min(limits) if limits else None


def get_available_cpu_memory() -> int:
    """Bytes this process can still allocate: free system memory, or less under an address-space limit."""
    global _process
    import psutil  # here, not at `import toma`: psutil's import costs more than toma's own modules

    available = psutil.virtual_memory().available
    limit = address_space_limit()
    if limit is not None:
        if _process is None:
            _process = psutil.Process()
        available = min(available, limit - _process.memory_info().vms)
    return int(available)


def _gigabytes(num_gigabytes: Any) -> float:
    """A number of GiB as given: a positive, finite real number, numpy's included (not a bool)."""
    if isinstance(num_gigabytes, bool) or not isinstance(num_gigabytes, numbers.Real):
        raise TypeError(f"num_gigabytes must be a number of GiB, got {num_gigabytes!r}")
    value = float(num_gigabytes)
    if not 0 < value < math.inf:  # also NaN
        raise ValueError(f"num_gigabytes must be a positive, finite number of GiB, got {num_gigabytes!r}")
    return value


def set_cpu_memory_limit(num_gigabytes: float) -> None:
    """Cap this process's address space (RLIMIT_AS) at `num_gigabytes` GiB, soft and hard limit alike.

    Allocations beyond it fail with an error toma recognises instead of swapping or waking the OOM
    killer. The cap counts virtual memory, not resident memory, and a process cannot raise it again.
    A CUDA process reserves a very large virtual range when CUDA starts, so under a cap CUDA may fail
    to initialise, and once CUDA is up a cap below its reservation makes every allocation fail: use it in
    CPU-only processes, or set it well above the address space the process already has.
    Call `predictable_heap()` first, or freed memory and glibc's malloc arenas eat into the cap.
    """
    num_gigabytes = _gigabytes(num_gigabytes)
    if resource is None:
        log.warning("set_cpu_memory_limit is not supported on %s; no limit set", sys.platform)
        return
    num_bytes = int(num_gigabytes * 2**30)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        num_bytes = min(num_bytes, hard)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        log.warning("set_cpu_memory_limit in a process that uses CUDA; CUDA's address space counts too")
    resource.setrlimit(resource.RLIMIT_AS, (num_bytes, num_bytes))


def _glibc(function: str, *args: int) -> Any:
    try:
        return getattr(ctypes.CDLL(None), function)(*args)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return None


def predictable_heap(mmap_threshold: int = 2**20) -> None:
    """Make freed memory leave the address space at once, so that a cap set relative to it holds.

    glibc raises its mmap threshold after large frees; multi-MiB tensors then come from the heap, and their
    memory stays counted as address space until some later free trims the heap, hundreds of MiB at a time.
    A fixed threshold of `mmap_threshold` bytes (M_MMAP_THRESHOLD, 1 MiB) keeps large tensors in mappings that
    go when freed; a lower one keeps smaller tensors out of the heap too, whose holes between live pieces
    otherwise stay counted (tens of MiB from run to run where many small activations come and go).
    glibc also reserves 64 MiB of address space, for good, for every new malloc arena: one after the first
    failed allocation (it retries in a fresh arena) and one per thread that allocates. A single arena
    (M_ARENA_MAX) keeps the cap whole, at the price of threads sharing malloc's lock. Call it early, before
    the large allocations and threads; a no-op where the C library is not glibc.
    """
    if isinstance(mmap_threshold, bool) or not isinstance(mmap_threshold, int) or mmap_threshold <= 0:
        raise ValueError(f"mmap_threshold must be a positive number of bytes, got {mmap_threshold!r}")
    _glibc("mallopt", -3, mmap_threshold)  # M_MMAP_THRESHOLD
    _glibc("mallopt", -8, 1)  # M_ARENA_MAX


def settled_address_space() -> int:
    """This process's address space (bytes) once freed memory has left it: collects garbage, trims the
    heap, and waits until two readings 0.3 s apart agree."""
    import psutil

    process, last = psutil.Process(), -1
    while True:
        gc.collect()
        _glibc("malloc_trim", 0)
        vms = process.memory_info().vms
        if vms == last:
            return int(vms)
        last = vms
        time.sleep(0.3)


def set_cpu_memory_headroom(num_gigabytes: float) -> int:
    """Cap this process at its settled address space plus `num_gigabytes` GiB; returns the cap in bytes.

    The way to try out code under memory pressure: whatever the process holds already, it gets exactly
    this much more. `predictable_heap()` at the start makes the margin hold over time.
    """
    num_gigabytes = _gigabytes(num_gigabytes)
    cap = settled_address_space() + int(num_gigabytes * 2**30)
    set_cpu_memory_limit(cap / 2**30)
    return cap


def is_out_of_cpu_memory(exception: BaseException) -> bool:
    """True for PyTorch's CPU allocator failures and Python's MemoryError."""
    if isinstance(exception, MemoryError):
        return True
    if not isinstance(exception, RuntimeError):
        return False
    message = str(exception)
    return any(marker in message for marker in CPU_OOM_MARKERS)
