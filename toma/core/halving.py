"""Halving, written once: toma 1.1.0's back-off (512, 256, ..., 1), used by the `Halving` policy, FitToMemory's
fallback and a cache entry's `decrease_batchsize`."""

from typing import Optional

__all__ = ["halved"]


def halved(size: int, minimum: int = 1) -> Optional[int]:
    """Half of `size`, rounded down and at least `minimum`; None when `size` is `minimum` or less already."""
    return None if size <= minimum else max(minimum, size // 2)
