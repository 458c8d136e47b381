"""Free CPU and GPU memory, read at most every `interval` seconds so that a call can ask for it every time.

A full reading costs tens of microseconds (psutil reads /proc); a throttled one costs a clock read.
"""

import time
from typing import Dict, Optional, Tuple

import torch

from toma.memory.backends import CPU, accelerator_free_memory

__all__ = ["FreeMemoryGauge", "GAUGE"]

# toma's own clock, taken once: a program that patches `time.monotonic` to simulate time (Lightning's tests do,
# so may a user's timer) counts its own reads, never toma's
_clock = time.monotonic

Reading = Tuple[int, Optional[int]]


class FreeMemoryGauge:
    """Caches `(free CPU bytes, free GPU bytes or None)` for `interval` seconds, per device read."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self._reading: Reading = (0, None)  # the reading without a device: the one every cached call asks for
        self._expires = float("-inf")
        self._readings: Dict[torch.device, Tuple[Reading, float]] = {}

    def read(self, device: Optional[torch.device] = None) -> Reading:
        """Free CPU memory, and free memory of the CUDA `device` (None for a device that is not CUDA;
        `device` None: the current CUDA device where CUDA is in use)."""
        now = _clock()
        if device is None:
            if now >= self._expires:
                self._reading = (CPU.free_memory(), accelerator_free_memory())
                self._expires = now + self.interval
            return self._reading
        cached = self._readings.get(device)
        if cached is not None and now < cached[1]:
            return cached[0]
        reading = (CPU.free_memory(), accelerator_free_memory(device))
        self._readings[device] = (reading, now + self.interval)
        return reading

    def invalidate(self) -> None:
        """Force fresh readings next time, e.g. after memory was released."""
        self._expires = float("-inf")
        self._readings = {}


GAUGE = FreeMemoryGauge()
