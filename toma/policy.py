"""Sizing policies: how a batch or step size shrinks after an out-of-memory error.

A policy is a small object with one method, `shrink(size)`, so a new back-off is a new class, not a new loop.
"""

import math
from typing import Optional

__all__ = ["SizePolicy", "ShrinkByFactor", "Halving", "DEFAULT_POLICY"]


class SizePolicy:
    """Base class: `shrink(size)` returns the next smaller size to try, or None when none is left."""

    def shrink(self, size: int) -> Optional[int]:
        raise NotImplementedError


class ShrinkByFactor(SizePolicy):
    """Multiply the size by `factor` (rounding down, always shrinking by at least one), never below `minimum`.

    `ShrinkByFactor(0.9)` is a gentler back-off than halving: 256 -> 230 -> 207 -> 186 ...
    """

    def __init__(self, factor: float = 0.5, minimum: int = 1) -> None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"factor must be a number between 0 and 1, got {factor!r}")
        if not 0 < factor < 1:
            raise ValueError(f"factor must be between 0 and 1 (exclusive), got {factor!r}")
        if isinstance(minimum, bool) or not isinstance(minimum, int):
            raise TypeError(f"minimum must be an int, got {minimum!r}")
        if minimum < 1:
            raise ValueError(f"minimum must be at least 1, got {minimum!r}")
        self.factor = factor
        self.minimum = minimum

    def shrink(self, size: int) -> Optional[int]:
        if size <= self.minimum:
            return None
        smaller = size // 2 if self.factor == 0.5 else math.floor(size * self.factor)
        return max(self.minimum, min(smaller, size - 1))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(factor={self.factor!r}, minimum={self.minimum!r})"


class Halving(ShrinkByFactor):
    """toma's classic back-off: 512 -> 256 -> 128 ... -> 1."""

    def __init__(self, minimum: int = 1) -> None:
        super().__init__(0.5, minimum)

    def __repr__(self) -> str:
        return f"Halving(minimum={self.minimum!r})"


DEFAULT_POLICY: SizePolicy = Halving()
