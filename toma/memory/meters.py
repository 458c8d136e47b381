"""Memory meters: what one attempt used and what it had, for policies that size from measurements.

A meter is a small object per device: `begin()` before an attempt returns a mark (with the budget, the
bytes the attempt could still allocate); after an attempt that finished, `used(mark)` returns the peak
bytes it allocated above what was in use when it began, or None when the meter cannot tell this time;
after one that ran out of memory, `at_least(mark)` is a lower bound of what it held at its peak, `held(mark)`
what it holds now (its traceback alive), `failed_bytes(error)` reads the allocation that failed from an
out-of-memory message, and `bound(mark, error)` puts them together: what the attempt needed at least. A meter never destroys a statistic that
the user or an enclosing measurement reads. A new backend is a new class; tests inject a simulated one.
"""

import re
import threading
from collections import deque
from typing import Any, Deque, Dict, List, NamedTuple, Optional, Tuple

import torch

from toma.memory.cpu import get_available_cpu_memory

__all__ = ["Mark", "MemoryMeter", "NoMeter", "CpuMeter", "CudaMeter", "failed_bytes"]

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
    """What a meter noted when an attempt began: the bytes in use, the budget it had, and what the meter
    needs to read the attempt's peak later (`since`: its own business)."""

    start: int
    budget: int
    since: Any = None


class MemoryMeter:
    """Base class of the meters (see the module's docstring)."""

    def begin(self) -> Optional[Mark]:
        """A mark, or None when nothing can be measured now."""
        raise NotImplementedError

    def used(self, mark: Mark) -> Optional[int]:
        """Peak bytes the finished attempt allocated above `mark.start`; None: not measured this time."""
        raise NotImplementedError

    def at_least(self, mark: Mark) -> int:
        """After an attempt that ran out of memory (its traceback still alive): bytes it held above
        `mark.start`, at least (its peak where the meter can read it)."""
        used = self.used(mark)
        return 0 if used is None else used

    def held(self, mark: Mark) -> Optional[int]:
        """After an attempt that ran out of memory: bytes it holds now above `mark.start` (None: unknown)."""
        return None

    def failed_bytes(self, error: BaseException) -> Optional[int]:
        return failed_bytes(error)

    def bound(self, mark: Mark, error: BaseException) -> int:
        """What an attempt that ran out of memory needed at least: its peak; and where the error names the
        allocation that failed, what it held plus that allocation. Not its peak plus the allocation: the peak may have passed (temporaries freed)
        before the allocation that failed."""
        peak, failed = self.at_least(mark), self.failed_bytes(error)
        if failed is None:
            return peak
        return max(peak, failed + (self.held(mark) or 0))


class NoMeter(MemoryMeter):
    """A device no meter knows how to read: nothing is measured (a learning policy then halves)."""

    def begin(self) -> Optional[Mark]:
        return None

    def used(self, mark: Mark) -> Optional[int]:
        return None


def _status_kib(fields: str, names: Tuple[str, ...]) -> List[int]:
    values = []
    for name in names:
        start = fields.index(name + ":") + len(name) + 1
        values.append(int(fields[start : fields.index("kB", start)]) * 1024)
    return values


def _read_status() -> Tuple[int, int, int]:
    """(peak resident bytes since the last reset, resident bytes now, address space now)"""
    with open("/proc/self/status", encoding="ascii") as status:
        peak, now, mapped = _status_kib(status.read(), ("VmHWM", "VmRSS", "VmSize"))
    return peak, now, mapped


class _HighWater:
    """The process's peak resident size (`VmHWM`), shared by all CPU measurements. Each measurement resets
    it when it begins, and the peak a reset drops is kept for the measurements that began before it, so
    that a measurement nested inside another (a toma call inside a measured attempt) leaves the outer's
    result whole."""

    KEPT = 64  # resets remembered: an attempt with more nested measurements than this is not measured

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._resets = 0
        self._dropped: Deque[Tuple[int, int]] = deque(maxlen=self.KEPT)  # (reset number, the peak before it)

    def reset(self) -> Tuple[int, int, int]:
        """Start a measurement: (its reset number, resident bytes now, address space now). OSError/ValueError
        without procfs."""
        with self._lock:
            peak, rss, mapped = _read_status()
            with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
                clear.write("5")  # the peak resident size starts again from the current one
            self._resets += 1
            self._dropped.append((self._resets, peak))
            return self._resets, rss, mapped

    def peak_since(self, reset: int) -> Optional[int]:
        """The peak resident bytes since reset number `reset`; None when too many resets came since."""
        with self._lock:
            peak, _, _ = _read_status()
            later = [dropped for number, dropped in self._dropped if number > reset]
            if len(later) < self._resets - reset:
                return None
            return max([peak, *later])


class _CpuSince(NamedTuple):
    reset: int  # the high-water reset the attempt's measurement began with
    mapped: int  # the address space when it began


class CpuMeter(MemoryMeter):
    """The process's memory on Linux: the peak resident size during the attempt (`VmHWM`, reset through
    `/proc/self/clear_refs`: only toma reads it, and nested measurements keep each other's peaks), and
    the budget left under the address-space limit and in available RAM."""

    _high_water = _HighWater()  # one per process, as VmHWM is

    def __init__(self) -> None:
        self.works: Optional[bool] = None

    def begin(self) -> Optional[Mark]:
        if self.works is False:
            return None
        try:
            reset, rss, mapped = self._high_water.reset()
        except (OSError, ValueError):
            self.works = False  # not Linux, or no procfs: no measurements
            return None
        self.works = True
        return Mark(rss, get_available_cpu_memory(), _CpuSince(reset, mapped))

    def used(self, mark: Mark) -> Optional[int]:
        peak = self._high_water.peak_since(mark.since.reset)
        return None if peak is None else max(0, peak - mark.start)

    def held(self, mark: Mark) -> Optional[int]:
        """The address space mapped since the attempt began: what an allocation refused under an address-space
        limit (the CPU's out-of-memory error) came on top of."""
        try:
            _, _, mapped = _read_status()
        except (OSError, ValueError):
            return None
        return max(0, mapped - mark.since.mapped)


def _cuda_device(device: Any) -> torch.device:
    """A CUDA device with its index (None, or no index: the current device)."""
    if isinstance(device, int):
        resolved = torch.device("cuda", device)
    else:
        resolved = torch.device("cuda" if device is None else device)
    if resolved.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device!r}")
    return resolved if resolved.index is not None else torch.device("cuda", torch.cuda.current_device())


class _CudaSince(NamedTuple):
    """The allocator's statistics when an attempt began, besides the bytes allocated."""

    peak: int
    reserved: int
    releases: Optional[Tuple[int, int]]  # (failed cudaMallocs that freed the cache, device frees); None: unknown


def _releases(stats: Dict[str, Any]) -> Optional[Tuple[int, int]]:
    retries, frees = stats.get("num_alloc_retries"), stats.get("num_device_free")
    return None if retries is None or frees is None else (int(retries), int(frees))


class CudaMeter(MemoryMeter):
    """One CUDA device, through the caching allocator; as budget the device's free memory plus the
    allocator's cached free blocks (within a per-process fraction).

    It never resets the allocator's peak, which the user's `max_memory_allocated()`, the Trainer's epoch
    peak and an enclosing attempt's measurement all read. An attempt that raised the device's peak is
    measured exactly: the new peak is its own. One that stayed below an earlier peak is measured by the
    memory the allocator reserves, which only grows while nothing is released: the bytes reserved after
    it bound its peak from above, tightly when almost nothing was cached as it began (as after an OOM,
    when the engine empties the cache). Otherwise it is not measured (`used` is None)."""

    TIGHT = 0.05  # the most cached memory, as a share of the bound, for which reserved bytes measure an attempt

    def __init__(self, device: Any = None) -> None:
        self.device = _cuda_device(device)

    def __repr__(self) -> str:
        return f"CudaMeter({str(self.device)!r})"

    def begin(self) -> Optional[Mark]:
        device = self.device
        stats = torch.cuda.memory_stats(device)
        allocated = int(stats.get("allocated_bytes.all.current", 0))
        reserved = int(stats.get("reserved_bytes.all.current", 0))
        free, total = torch.cuda.mem_get_info(device)
        budget = free + reserved - allocated
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if fraction is not None:
            budget = min(budget, int(total * fraction(device)) - allocated)
        since = _CudaSince(int(stats.get("allocated_bytes.all.peak", 0)), reserved, _releases(stats))
        return Mark(allocated, max(0, budget), since)

    def used(self, mark: Mark) -> Optional[int]:
        stats = torch.cuda.memory_stats(self.device)
        since: _CudaSince = mark.since
        peak = int(stats.get("allocated_bytes.all.peak", 0))
        if peak > since.peak:
            return peak - mark.start
        reserved = int(stats.get("reserved_bytes.all.current", 0))
        bound = reserved - mark.start
        unreleased = since.releases is not None and _releases(stats) == since.releases and reserved >= since.reserved
        if unreleased and bound >= 0 and since.reserved - mark.start <= self.TIGHT * bound:
            return bound
        return None  # below an earlier peak, with too much cached to tell how far below

    def at_least(self, mark: Mark) -> int:
        stats = torch.cuda.memory_stats(self.device)
        peak = int(stats.get("allocated_bytes.all.peak", 0))
        if peak > mark.since.peak:
            return peak - mark.start
        return self.held(mark)

    def held(self, mark: Mark) -> int:
        return max(0, int(torch.cuda.memory_stats(self.device).get("allocated_bytes.all.current", 0)) - mark.start)
