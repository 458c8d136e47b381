"""Device backends: what toma asks of each kind of device, in one list.

Every place whose work depends on the kind of device asks the backend of that kind here: whether an error means
the device ran out of memory, emptying its allocator's cache after one, its random number generator (saved
and put back around a failed attempt), its free memory and peak, the meter that measures an attempt on it, the
name a size is remembered under, and whether copies to it go through pinned staging and side streams. A new
kind of device is a new `DeviceBackend` subclass handed to `register_backend`; nothing else changes.

No backend starts a device: a process that has not used CUDA is never made to initialise it here.
"""

import threading
import time
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from toma.memory.cpu import address_space_limit, get_available_cpu_memory, is_out_of_cpu_memory
from toma.memory.cuda import get_cuda_free_memory_if_initialized, is_cuda_out_of_memory, is_cudnn_snafu
from toma.memory.meters import CpuMeter, CudaMeter, MemoryMeter, NoMeter

__all__ = [
    "DeviceBackend",
    "CpuBackend",
    "CudaBackend",
    "XpuBackend",
    "MpsBackend",
    "HpuBackend",
    "CPU",
    "CUDA",
    "register_backend",
    "backend_for",
    "backends",
    "accelerators_in_use",
    "default_device",
    "default_meter",
    "accelerator_free_memory",
]

DeviceLike = Union[torch.device, str]


class DeviceBackend:
    """One kind of device (`kind`, as in `torch.device(kind)`). The defaults describe a device toma knows nothing
    about: never in use, nothing to free, no random state or memory figures of its own, nothing measured."""

    pins_host_memory = False  # copies from the host go through page-locked memory, a side stream and events

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._meters: Dict[int, MemoryMeter] = {}
        self._meters_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind!r})"

    def available(self) -> bool:
        """Whether this machine has such a device (initialises nothing). A kind without a backend of its own
        asks the module PyTorch registers for it (`torch.hpu` by Habana's plugin, ...)."""
        try:
            return bool(torch.get_device_module(self.kind).is_available())
        except (RuntimeError, AttributeError):  # no module, or one without is_available
            return False

    def device_count(self) -> Optional[int]:
        """How many such devices this machine has; None: unknown."""
        return None

    def in_use(self) -> bool:
        """Whether this process has started using the device (never starts it)."""
        return False

    def current(self) -> torch.device:
        """The current device of this kind, with its index where it has one."""
        return torch.device(self.kind)

    def resolve(self, device: torch.device) -> torch.device:
        """`device` with its index (none given: the current device)."""
        return device if device.index is not None else self.current()

    def is_out_of_memory(self, exception: BaseException) -> bool:
        """Whether `exception` is this device's out-of-memory error (beyond the texts every backend shares)."""
        return False

    def empty_cache(self) -> None:
        """Hand the allocator's cached, unused blocks back to the device, if the device is in use."""

    def rng_state(self, device: torch.device) -> Optional[torch.Tensor]:
        """The state of `device`'s random number generator; None: it has none of its own."""
        return None

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        """Put back a state `rng_state` returned."""

    def free_memory(self, device: Optional[torch.device]) -> Optional[int]:
        """Bytes a new tensor could get on `device` (None: the current device), the allocator's cached blocks
        included; None where unknown or the device is not in use."""
        return None

    def reset_peak(self, device: torch.device) -> None:
        """Start the allocator's peak over, where the device keeps one."""

    def synchronize(self, device: torch.device) -> None:
        """Wait until the work queued on `device` is done; nothing where the device runs in order."""

    def timestamp(self, device: torch.device) -> Any:
        """A mark of the moment the work queued on `device` so far is done, for `seconds_between`: the host's
        clock once the device is idle, where the device knows no timed events of its own."""
        self.synchronize(device)
        return time.perf_counter()

    def seconds_between(self, start: Any, end: Any) -> float:
        """The seconds from mark `start` to mark `end` (waiting for `end` where it is still to come)."""
        return float(end - start)

    def peak_allocated(self, device: torch.device) -> Optional[int]:
        """The allocator's peak bytes on `device` since it was last reset; None where unknown."""
        return None

    def figures(self, device: torch.device) -> Dict[str, int]:
        """What the device's allocator reports, in bytes, by name (`allocated`, `reserved`, `peak`, `free`,
        `total` where known); empty where the device is not in use."""
        return {}

    def meter(self, device: torch.device) -> MemoryMeter:
        """The meter of attempts on `device` (one per device, kept: meters carry state between attempts)."""
        index = -1 if device.index is None else device.index
        meter = self._meters.get(index)
        if meter is None:
            with self._meters_lock:
                meter = self._meters.setdefault(index, self._new_meter(device))
        return meter

    def _new_meter(self, device: torch.device) -> MemoryMeter:
        return NO_METER

    def identity(self, device: torch.device) -> str:
        """What decides which sizes fit on `device`, as text: the key sizes are remembered under."""
        return self.kind


NO_METER = NoMeter()


class CpuBackend(DeviceBackend):
    """The host: Python's and PyTorch's CPU allocator, the global generator, the address-space limit."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self._cpu_meter = CpuMeter()

    def available(self) -> bool:
        return True

    def device_count(self) -> Optional[int]:
        return 1

    def in_use(self) -> bool:
        return True

    def resolve(self, device: torch.device) -> torch.device:
        return device

    def is_out_of_memory(self, exception: BaseException) -> bool:
        return is_out_of_cpu_memory(exception)

    def rng_state(self, device: torch.device) -> Optional[torch.Tensor]:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        torch.set_rng_state(state)

    def free_memory(self, device: Optional[torch.device] = None) -> int:
        return get_available_cpu_memory()

    def meter(self, device: torch.device) -> MemoryMeter:
        return self._cpu_meter  # one process, one resident size: every CPU device shares it

    def identity(self, device: torch.device) -> str:
        limit = address_space_limit()  # in 64 MiB steps: a cap set from the settled address space moves a little
        return f"cpu:limit={'none' if limit is None else f'{limit >> 26} x 64MiB'}"


class CudaBackend(DeviceBackend):
    """NVIDIA (and ROCm) GPUs through PyTorch's caching allocator."""

    pins_host_memory = True

    def __init__(self) -> None:
        super().__init__("cuda")

    def available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> Optional[int]:
        return torch.cuda.device_count()

    def in_use(self) -> bool:
        return torch.cuda.is_initialized()

    def current(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def is_out_of_memory(self, exception: BaseException) -> bool:
        return is_cuda_out_of_memory(exception) or is_cudnn_snafu(exception)

    def empty_cache(self) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def rng_state(self, device: torch.device) -> Optional[torch.Tensor]:
        return torch.cuda.get_rng_state(device)

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        torch.cuda.set_rng_state(state, device)

    def free_memory(self, device: Optional[torch.device]) -> Optional[int]:
        return get_cuda_free_memory_if_initialized(device)

    def reset_peak(self, device: torch.device) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats(device)

    def synchronize(self, device: torch.device) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize(device)

    def timestamp(self, device: torch.device) -> Any:
        """An event recorded on the current stream: marks in the device's own timeline, no waiting."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def seconds_between(self, start: Any, end: Any) -> float:
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000.0

    def peak_allocated(self, device: torch.device) -> Optional[int]:
        if torch.cuda.is_initialized():
            return int(torch.cuda.max_memory_allocated(device))
        return None

    def figures(self, device: torch.device) -> Dict[str, int]:
        if not torch.cuda.is_initialized():
            return {}
        free, total = torch.cuda.mem_get_info(device)
        return dict(
            allocated=torch.cuda.memory_allocated(device),
            reserved=torch.cuda.memory_reserved(device),
            peak=torch.cuda.max_memory_allocated(device),
            free=free,
            total=total,
        )

    def meter(self, device: torch.device) -> MemoryMeter:
        return super().meter(self.resolve(device))

    def _new_meter(self, device: torch.device) -> MemoryMeter:
        return CudaMeter(device.index)

    def identity(self, device: torch.device) -> str:
        properties = torch.cuda.get_device_properties(self.resolve(device).index)
        return f"cuda:{properties.name}:{properties.total_memory}"


class XpuBackend(DeviceBackend):
    """Intel GPUs (`torch.xpu`)."""

    def __init__(self) -> None:
        super().__init__("xpu")

    def available(self) -> bool:
        return torch.xpu.is_available()

    def device_count(self) -> Optional[int]:
        return torch.xpu.device_count()

    def in_use(self) -> bool:
        return torch.xpu.is_available() and torch.xpu.is_initialized()

    def current(self) -> torch.device:
        return torch.device("xpu", torch.xpu.current_device())

    def empty_cache(self) -> None:
        if self.in_use():
            torch.xpu.empty_cache()

    def rng_state(self, device: torch.device) -> Optional[torch.Tensor]:
        return torch.xpu.get_rng_state(device)

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        torch.xpu.set_rng_state(state, device)

    def synchronize(self, device: torch.device) -> None:
        if self.in_use():
            torch.xpu.synchronize(device)


class MpsBackend(DeviceBackend):
    """Apple GPUs (`torch.mps`): one device, no index."""

    def __init__(self) -> None:
        super().__init__("mps")

    def available(self) -> bool:
        return torch.backends.mps.is_available()

    def device_count(self) -> Optional[int]:
        return 1 if self.available() else 0

    def in_use(self) -> bool:
        return self.available()  # torch.mps has no "initialised": asking costs nothing once it is there

    def resolve(self, device: torch.device) -> torch.device:
        return device

    def empty_cache(self) -> None:
        if self.available():
            torch.mps.empty_cache()

    def rng_state(self, device: torch.device) -> Optional[torch.Tensor]:
        return torch.mps.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        torch.mps.set_rng_state(state)

    def synchronize(self, device: torch.device) -> None:
        if self.available():
            torch.mps.synchronize()


class HpuBackend(DeviceBackend):
    """Intel Gaudi (`torch.hpu`, from Habana's plugin): its out-of-memory error, which says neither "out of
    memory" nor raises `torch.OutOfMemoryError`. Its allocator reserves the device's memory for the process, so
    there is no cache to empty."""

    OOM_MARKER = "MODULE:PT_DEVMEM Allocation failed"  # "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed ..."

    def __init__(self) -> None:
        super().__init__("hpu")

    def is_out_of_memory(self, exception: BaseException) -> bool:
        return isinstance(exception, RuntimeError) and self.OOM_MARKER in str(exception)


CPU = CpuBackend()
CUDA = CudaBackend()
_lock = threading.Lock()
_backends: Dict[str, DeviceBackend] = {
    backend.kind: backend for backend in (CPU, CUDA, XpuBackend(), MpsBackend(), HpuBackend())
}
_accelerators: Tuple[DeviceBackend, ...] = tuple(b for b in _backends.values() if b is not CPU)


def register_backend(backend: DeviceBackend) -> DeviceBackend:
    """Make `backend` the one toma asks for devices of `backend.kind` (replacing a built-in one)."""
    global _accelerators
    if not isinstance(backend, DeviceBackend):
        raise TypeError(f"backend must be a DeviceBackend, got {backend!r}")
    if backend.kind == "cpu":
        raise ValueError("backend.kind must not be 'cpu': the host's backend is built in")
    with _lock:
        _backends[backend.kind] = backend
        _accelerators = tuple(b for b in _backends.values() if b is not CPU)
    return backend


def backend_for(device: DeviceLike) -> DeviceBackend:
    """The backend of `device`'s kind; for a kind no backend knows (meta, ...), one that knows nothing."""
    kind = device.split(":", 1)[0] if isinstance(device, str) else device.type
    backend = _backends.get(kind)
    return backend if backend is not None else DeviceBackend(kind)


def backends() -> List[DeviceBackend]:
    """Every registered backend, the host's first."""
    return list(_backends.values())


def accelerators_in_use() -> List[DeviceBackend]:
    """The backends of the devices besides the host that this process has started."""
    return [backend for backend in _accelerators if backend.in_use()]


def default_device() -> torch.device:
    """Where work whose device is not known runs: the current CUDA device in a process that uses CUDA, else the
    CPU."""
    return CUDA.current() if CUDA.in_use() else torch.device("cpu")


def default_meter(device: Optional[torch.device] = None) -> MemoryMeter:
    """The meter of the device the work runs on: that device's (the CPU's for CPU work, also in a process that
    uses CUDA), one that measures nothing for a device no backend measures; `device` None: `default_device()`."""
    if device is None:
        device = default_device()
    return backend_for(device).meter(device)


def accelerator_free_memory(device: Optional[torch.device] = None) -> Optional[int]:
    """Free memory of the accelerator `device` (None for the host); `device` None: the current CUDA device
    where CUDA is in use and has a context there."""
    if device is None:
        return CUDA.free_memory(None)
    backend = backend_for(device)
    return None if backend is CPU else backend.free_memory(device)
