"""The simple sizing policies: how a batch or step size shrinks after an out-of-memory error.

A policy is a small object with one method, `shrink(size)`, so a new back-off is a new class, not a new loop.
"""

import math
import numbers
from typing import Optional, SupportsIndex

from toma.core.arguments import check_size
from toma.core.halving import halved
from toma.core.policy import SizePolicy, check_policy, shrink_below

__all__ = [
    "SizePolicy",
    "ShrinkByFactor",
    "Halving",
    "check_policy",
    "shrink_below",
]


class ShrinkByFactor(SizePolicy):
    """Multiply the size by `factor` (rounding down, always shrinking by at least one), never below `minimum`.

    `ShrinkByFactor(0.9)` is a gentler back-off than halving: 256 -> 230 -> 207 -> 186 ...
    """

    def __init__(self, factor: float = 0.5, minimum: SupportsIndex = 1) -> None:
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
            raise TypeError(f"factor must be a number between 0 and 1, got {factor!r}")
        factor = float(factor)
        if not 0 < factor < 1:
            raise ValueError(f"factor must be between 0 and 1 (exclusive), got {factor!r}")
        self.factor: float = factor
        self.minimum: int = check_size(minimum, "minimum")

    def shrink(self, size: int) -> Optional[int]:
        if self.factor == 0.5:
            return halved(size, self.minimum)
        if size <= self.minimum:
            return None
        return max(self.minimum, min(math.floor(size * self.factor), size - 1))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(factor={self.factor!r}, minimum={self.minimum!r})"


class Halving(ShrinkByFactor):
    """toma's classic back-off: 512 -> 256 -> 128 ... -> 1."""

    def __init__(self, minimum: SupportsIndex = 1) -> None:
        super().__init__(0.5, minimum)

    def __repr__(self) -> str:
        return f"Halving(minimum={self.minimum!r})"
