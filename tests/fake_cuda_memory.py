"""A fake CUDA runtime for CPU tests: the `torch.cuda` functions toma reads, over per-device counters that
behave like the caching allocator's (allocated, peak, reserved, releases), recording which device every
call asks about. Work "allocates" through `allocate`/`free`; a request beyond a device's capacity raises
the allocator's out-of-memory error."""

from types import SimpleNamespace
from typing import Any, Dict, List, Tuple

import torch

from toma.memory.free import GAUGE

MiB = 2**20
GiB = 2**30


class FakeDevice:
    def __init__(self, index: int, capacity: int) -> None:
        self.index, self.capacity = index, capacity
        self.allocated = self.peak = self.reserved = 0
        self.retries = self.frees = 0

    def allocate(self, n: int) -> None:
        if self.allocated + n > self.capacity and self.reserved > self.allocated:
            self.retries, self.frees = self.retries + 1, self.frees + 1  # cudaMalloc failed: free the cache
            self.reserved = self.allocated
        if self.allocated + n > self.capacity:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {n / MiB:.2f} MiB. GPU {self.index} has a total "
                f"capacity of {self.capacity / GiB:.2f} GiB (fake)"
            )
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n

    def empty_cache(self) -> None:
        if self.reserved > self.allocated:
            self.frees += 1
            self.reserved = self.allocated


class FakeCuda:
    """Patches `torch.cuda` (through `monkeypatch`) so that CUDA looks initialised with `capacities`
    devices, `current` the current one. `asked` lists (function, device index) for every query."""

    def __init__(self, monkeypatch: Any, capacities: Tuple[int, ...] = (8 * GiB, 4 * GiB), current: int = 0) -> None:
        self.devices = [FakeDevice(index, capacity) for index, capacity in enumerate(capacities)]
        self.current = current
        self.asked: List[Tuple[str, int]] = []
        self.resets: List[int] = []
        self.contexts = {current}  # devices with a context: the current one, as after torch.cuda.init()
        cuda = torch.cuda
        for name, function in {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "device_count": lambda: len(self.devices),
            "current_device": self._current_device,
            "memory_stats": lambda device=None: self._stats(self._asked("memory_stats", device)),
            "memory_allocated": lambda device=None: self._device("memory_allocated", device).allocated,
            "max_memory_allocated": lambda device=None: self._device("max_memory_allocated", device).peak,
            "memory_reserved": lambda device=None: self._device("memory_reserved", device).reserved,
            "mem_get_info": self._mem_get_info,
            "reset_peak_memory_stats": self._reset_peak,
            "empty_cache": self._empty_cache,
            "get_device_properties": self._properties,
            "get_per_process_memory_fraction": lambda device=None: (self._asked("fraction", device), 1.0)[1],
        }.items():
            monkeypatch.setattr(cuda, name, function)
        monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda index: index in self.contexts, raising=False)
        GAUGE.invalidate()

    # --- what work does ------------------------------------------------------------------------------

    def allocate(self, index: int, n: int) -> None:
        self.devices[index].allocate(n)
        self.contexts.add(index)

    def free(self, index: int, n: int) -> None:
        self.devices[index].free(n)

    def indices_asked(self) -> set:
        return {index for _, index in self.asked}

    # --- the patched functions -----------------------------------------------------------------------

    def _current_device(self) -> int:
        self.asked.append(("current_device", self.current))
        return self.current

    def _index(self, device: Any) -> int:
        if device is None:
            return self.current
        if isinstance(device, int):
            return device
        resolved = torch.device(device)
        assert resolved.type == "cuda", f"a CUDA function was asked about {resolved}"
        return self.current if resolved.index is None else resolved.index

    def _asked(self, function: str, device: Any) -> int:
        index = self._index(device)
        self.asked.append((function, index))
        return index

    def _device(self, function: str, device: Any) -> FakeDevice:
        return self.devices[self._asked(function, device)]

    def _stats(self, index: int) -> Dict[str, int]:
        d = self.devices[index]
        return {
            "allocated_bytes.all.current": d.allocated,
            "allocated_bytes.all.peak": d.peak,
            "reserved_bytes.all.current": d.reserved,
            "num_alloc_retries": d.retries,
            "num_device_free": d.frees,
        }

    def _mem_get_info(self, device: Any = None) -> Tuple[int, int]:
        d = self._device("mem_get_info", device)
        self.contexts.add(d.index)  # cudaMemGetInfo creates the device's context
        return d.capacity - d.reserved, d.capacity

    def _reset_peak(self, device: Any = None) -> None:
        d = self._device("reset_peak_memory_stats", device)
        self.resets.append(d.index)
        d.peak = d.allocated

    def _empty_cache(self) -> None:
        for d in self.devices:
            d.empty_cache()

    def _properties(self, device: Any = None) -> Any:
        d = self._device("get_device_properties", device)
        return SimpleNamespace(name=f"Fake GPU {d.index}", total_memory=d.capacity)


class OnCuda(torch.Tensor):
    """A CPU tensor that says it lives on `cuda:1`: what a call's tensor argument on that GPU looks like to
    code that only reads `.device`."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 1)

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def on_cuda_1(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(OnCuda)
