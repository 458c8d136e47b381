"""Sizing policies: how a batch or step size shrinks after an out-of-memory error.

A policy is a small object with one method, `shrink(size)`, so a new back-off is a new class, not a new loop.
"""

import math
import numbers
from typing import Any, Optional, SupportsIndex

from toma.arguments import check_size

__all__ = [
    "SizePolicy",
    "ShrinkByFactor",
    "Halving",
    "DEFAULT_POLICY",
    "get_default_policy",
    "set_default_policy",
    "check_policy",
    "shrink_below",
]


class SizePolicy:
    """Base class: `shrink(size)` returns the next smaller size to try, or None when none is left.

    A policy that learns from measurements sets `learns = True`; the engine then asks, per call,
    `quick(entry, scale)` (True: a settled call site between measurements; the call runs at the entry's size
    with no `start`, no `begin` and a token of None), else calls `start(entry, size, asked, scale, device)` (the size to begin with, at most `asked`; `scale`: the items
    each row holds, the step's `row_items`, 1 unless a step says otherwise; `device`: where the step's work
    runs, a `torch.device`, or None when not known), and per attempt `begin(entry, size, scale, device)` (a
    token, or None when it measures nothing this time), and after it either `succeeded(entry, token, ran)`
    (`ran`: the rows the attempt's first chunk had; returns a description of a size change to log, or None)
    or `after_oom(entry, token, size, failed, error)`, which returns the next size (below `failed`) or None,
    and `explain(entry)` says why for the log line. `entry` is the call site's cache entry: a policy keeps
    what it learned there, and may grow its size. A policy measures `device`, not the current CUDA device
    (a model on `cuda:1` runs where the current device is 0), and never initialises CUDA for a device that
    is not CUDA. Ranks that agree on sizes use `shrink` alone, and a learning policy may define
    `observed(entry, token, ran)`: this rank's attempt fit, but the ranks agreed to redo it smaller.
    """

    learns = False

    def shrink(self, size: int) -> Optional[int]:
        raise NotImplementedError


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
        if size <= self.minimum:
            return None
        smaller = size // 2 if self.factor == 0.5 else math.floor(size * self.factor)
        return max(self.minimum, min(smaller, size - 1))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(factor={self.factor!r}, minimum={self.minimum!r})"


class Halving(ShrinkByFactor):
    """toma's classic back-off: 512 -> 256 -> 128 ... -> 1."""

    def __init__(self, minimum: SupportsIndex = 1) -> None:
        super().__init__(0.5, minimum)

    def __repr__(self) -> str:
        return f"Halving(minimum={self.minimum!r})"


DEFAULT_POLICY: SizePolicy = Halving()  # toma 1.1.0's sequences: the forms' default until one is set
_default_policy: SizePolicy = DEFAULT_POLICY


def get_default_policy() -> SizePolicy:
    """The policy of the forms where none is given (what `toma.DEFAULT_POLICY` reads), read at call time."""
    return _default_policy


def check_policy(policy: Any, name: str) -> Optional[SizePolicy]:
    """A sizing policy, or None for the default at call time."""
    if policy is None:
        return None
    if not callable(getattr(policy, "shrink", None)):
        raise TypeError(f"{name} must be a sizing policy such as toma.policy.ShrinkByFactor(0.8), got {policy!r}")
    return policy  # type: ignore[no-any-return]


def set_default_policy(policy: SizePolicy) -> None:
    """Change the forms' default policy (what assigning `toma.DEFAULT_POLICY` does)."""
    global _default_policy
    checked = check_policy(policy, "DEFAULT_POLICY")
    if checked is None:
        raise TypeError("DEFAULT_POLICY must be a sizing policy such as toma.Halving(), got None")
    _default_policy = checked


def shrink_below(policy: SizePolicy, size: int, failed: int) -> Optional[int]:
    """The policy's first size below `failed` (the work that ran out of memory) going down from `size`, or None
    when there is none: the policy's own sequence (512, 256, ... for halving), and never the same chunk again
    when the chunk was shorter than `size`."""
    while True:
        smaller = policy.shrink(size)
        if smaller is not None and not 1 <= smaller < size:
            raise ValueError(
                f"{policy!r}.shrink({size}) returned {smaller!r}: a policy must return a smaller size "
                "of at least 1, or None when there is none"
            )
        if smaller is None or smaller < failed:
            return smaller
        size = smaller
