"""The device backend interface: what toma asks of one kind of device, with the answers for a device it knows
nothing about. The built-in backends subclass it (`toma.memory.host_backend`, `toma.memory.accelerator_backends`),
and `toma.memory.backends` keeps the list of them."""

import threading
import time
from typing import Any, Dict, Optional, Union

import torch

from toma.memory.meters import MemoryMeter, NoMeter

__all__ = ["DeviceBackend", "DeviceLike", "NO_METER"]

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
