"""Free CPU and GPU memory, read at most every `interval` seconds so that a call can ask for it every time.

A full reading costs tens of microseconds (psutil reads /proc); a throttled one costs a clock read.
"""

import time
from typing import Optional, Tuple

from toma.cpu_memory import get_available_cpu_memory
from toma.torch_cuda_memory import get_cuda_free_memory_if_initialized

__all__ = ["FreeMemoryGauge", "GAUGE"]


class FreeMemoryGauge:
    """Caches `(free CPU bytes, free GPU bytes or None)` for `interval` seconds."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self._reading: Tuple[int, Optional[int]] = (0, None)
        self._expires = float("-inf")

    def read(self) -> Tuple[int, Optional[int]]:
        now = time.monotonic()
        if now >= self._expires:
            self._reading = (get_available_cpu_memory(), get_cuda_free_memory_if_initialized())
            self._expires = now + self.interval
        return self._reading

    def invalidate(self) -> None:
        """Force a fresh reading next time, e.g. after memory was released."""
        self._expires = float("-inf")


GAUGE = FreeMemoryGauge()
