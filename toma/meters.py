"""Memory meters: what one attempt used and what it had, for policies that size from measurements.

A meter is a small object per device kind: `begin()` before an attempt returns a mark (with the budget,
the bytes the attempt could still allocate), `used(mark)` after it returns the peak bytes it allocated
above what was in use when it began, and `failed_bytes(error)` reads the allocation that failed from an
out-of-memory message. A new backend is a new class; tests inject a simulated one.
"""

import re
from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from toma.cpu_memory import get_available_cpu_memory

__all__ = ["Mark", "MemoryMeter", "CpuMeter", "CudaMeter", "default_meter", "failed_bytes"]

_UNITS = {"B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "BYTES": 1}
# CUDA: "Tried to allocate 2.00 GiB"; CPU: "you tried to allocate 123456 bytes"
_TRIED = re.compile(r"tried to allocate ([\d.]+) ?(bytes|[KMGT]iB|B)\b", re.IGNORECASE)


def failed_bytes(error: BaseException) -> Optional[int]:
    """The size of the allocation an out-of-memory error reports, following `__cause__` (None: unknown)."""
    seen = 0
    current: Optional[BaseException] = error
    while current is not None and seen < 8:
        match = _TRIED.search(str(current))
        if match:
            return int(float(match.group(1)) * _UNITS[match.group(2).upper()])
        current, seen = current.__cause__, seen + 1
    return None


class Mark(NamedTuple):
    """What a meter noted when an attempt began: the bytes in use, and the budget it had."""

    start: int
    budget: int


class MemoryMeter:
    """Base class of the meters (see the module's docstring)."""

    def begin(self) -> Optional[Mark]:
        """A mark, or None when nothing can be measured now."""
        raise NotImplementedError

    def used(self, mark: Mark) -> int:
        """Peak bytes the attempt allocated above `mark.start`."""
        raise NotImplementedError

    def failed_bytes(self, error: BaseException) -> Optional[int]:
        return failed_bytes(error)


def _status_kib(fields: str, names: Tuple[str, ...]) -> List[int]:
    values = []
    for name in names:
        start = fields.index(name + ":") + len(name) + 1
        values.append(int(fields[start : fields.index("kB", start)]) * 1024)
    return values


class CpuMeter(MemoryMeter):
    """The process's memory on Linux: the peak resident size during the attempt (`VmHWM`, reset through
    `/proc/self/clear_refs`), and the budget left under the address-space limit and in available RAM."""

    def __init__(self) -> None:
        self.works: Optional[bool] = None

    def _read(self) -> Tuple[int, int]:
        """(peak resident bytes since the last reset, resident bytes now)"""
        with open("/proc/self/status", encoding="ascii") as status:
            peak, now = _status_kib(status.read(), ("VmHWM", "VmRSS"))
        return peak, now

    def begin(self) -> Optional[Mark]:
        if self.works is False:
            return None
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
                clear.write("5")  # the peak resident size starts again from the current one
            _, rss = self._read()
        except (OSError, ValueError):
            self.works = False  # not Linux, or no procfs: no measurements
            return None
        self.works = True
        return Mark(rss, get_available_cpu_memory())

    def used(self, mark: Mark) -> int:
        peak, _ = self._read()
        return max(0, peak - mark.start)


class CudaMeter(MemoryMeter):
    """One CUDA device, through the caching allocator: the peak allocated during the attempt, and as budget
    the device's free memory plus the allocator's cached free blocks (within a per-process fraction)."""

    def __init__(self, device: Any = None) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)

    def begin(self) -> Optional[Mark]:
        device = self.device
        torch.cuda.reset_peak_memory_stats(device)
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        free, total = torch.cuda.mem_get_info(device)
        budget = free + reserved - allocated
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if fraction is not None:
            budget = min(budget, int(total * fraction(device)) - allocated)
        return Mark(allocated, max(0, budget))

    def used(self, mark: Mark) -> int:
        return max(0, int(torch.cuda.max_memory_allocated(self.device)) - mark.start)


_CPU = CpuMeter()


def default_meter() -> MemoryMeter:
    """The current CUDA device's meter in a process that uses CUDA, the CPU meter otherwise."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return CudaMeter()
    return _CPU
