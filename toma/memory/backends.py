"""Device backends: what toma asks of each kind of device, in one list.

Every place whose work depends on the kind of device asks the backend of that kind here: whether an error means
the device ran out of memory, emptying its allocator's cache after one, its random number generator (saved
and put back around a failed attempt), its free memory and peak, the meter that measures an attempt on it, the
name a size is remembered under, and whether copies to it go through pinned staging and side streams. A new
kind of device is a new `DeviceBackend` subclass handed to `register_backend`; nothing else changes.

This module is the list and the questions that pick from it; the interface is `toma.memory.device_backend`, the
built-in backends `toma.memory.host_backend` and `toma.memory.accelerator_backends` (their names re-exported here).
No backend starts a device: a process that has not used CUDA is never made to initialise it here.
"""

import threading
from typing import Dict, List, Optional, Tuple

import torch

from toma.memory.accelerator_backends import CudaBackend, HpuBackend, MpsBackend, XpuBackend
from toma.memory.device_backend import DeviceBackend, DeviceLike
from toma.memory.host_backend import CpuBackend
from toma.memory.meters import MemoryMeter

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
