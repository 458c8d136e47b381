"""What a call site's attempts showed, and the bracket that evidence gives under a budget.

An attempt that fit under a budget fits under any larger one; an attempt that ran out of memory fails
under any smaller one. So under a budget `B` the evidence brackets M, the largest size that fits: `low`,
the largest size that fit with no more than about `B`, and `high`, the smallest that failed with at least
about `B`. The failures also bound what `Halving` from the same start pays: it fails at every one of its
sizes at or above `high`. After `c` failures, a failure at no more than halving's `c`-th size below the
start (`start >> c`) is one halving pays too, so sizes up to that `ceiling` never cost more errors than
halving. A short attempt (fewer rows than the size: the end of a range, a short batch) is one attempt
for halving whatever its size, so after one the ceiling is halving's largest size below `high`.
"""

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

__all__ = ["Fit", "Failure", "Bracket", "Evidence", "SAME_BUDGET", "bracket_text"]

SAME_BUDGET = 0.05  # budgets within this share of each other count as the same: free memory is never still
KEPT = 16  # records kept of each kind: the newest, so that the evidence follows a drifting workload


class Fit(NamedTuple):
    items: float  # rows times items per row
    budget: float


class Failure(NamedTuple):
    items: float
    bound: float  # the bytes it needed at least (0: nothing seen)
    budget: float
    short: bool = False  # fewer rows than the size it was asked to run at


class Bracket(NamedTuple):
    """Under one budget: M lies in [low, high) (items; low 0 and high inf when not known); `ceiling` is the
    largest size that costs no error halving would not pay."""

    low: float
    high: float
    ceiling: float


@dataclass
class Evidence:
    """The fits and failures of one call site (its cache entry), with the budget each happened under."""

    fits: List[Fit] = field(default_factory=list)
    failures: List[Failure] = field(default_factory=list)
    start: Optional[int] = None  # the rows the call site's first call began with: halving's start

    def copy(self) -> "Evidence":
        return Evidence(list(self.fits), list(self.failures), self.start)

    def fitted(self, items: float, budget: float) -> None:
        """An attempt of `items` fit: failures at or below it are out of date (memory moved)."""
        self.failures = [f for f in self.failures if f.items > items]
        self.fits = (self.fits + [Fit(items, budget)])[-KEPT:]

    def failed(self, items: float, bound: float, budget: float, short: bool = False) -> None:
        """An attempt of `items` ran out of memory: fits at or above it are out of date (memory moved)."""
        self.fits = [f for f in self.fits if f.items < items]
        self.failures = (self.failures + [Failure(items, bound, budget, short)])[-KEPT:]

    def bracket(self, budget: float, scale: float) -> Bracket:
        """The bracket under `budget`, for rows of `scale` items."""
        low = max((f.items for f in self.fits if _same_or_more(budget, f.budget)), default=0.0)
        under = [f for f in self.failures if _same_or_more(f.budget, budget)]
        high = min((f.items for f in under), default=math.inf)
        if self.start is None:
            ceiling = math.inf
        else:
            ceiling = next(iter(self.halving_below(high, scale)), 0.0)
            if not any(f.short for f in under):  # failures above the start (an earlier run's) are not halving's
                counted = sum(1 for f in under if f.items <= self.start * scale)
                ceiling = max(ceiling, (self.start >> min(counted, 62)) * scale)
        return Bracket(low, high, ceiling)

    def ceiling_if_failed(self, items: float, budget: float, scale: float) -> float:
        """The ceiling under `budget` after one more failure, at `items`."""
        after = self.copy()
        after.failed(items, 0.0, budget)
        return after.bracket(budget, scale).ceiling

    def bounds(self) -> List[Tuple[float, float]]:
        """(items, bytes) of the failures that say how much they needed at least: the need model's floors."""
        return [(f.items, f.bound) for f in self.failures if f.bound > 0]

    def failures_under(self, budget: float) -> List[Failure]:
        return [f for f in self.failures if _same_or_more(f.budget, budget)]

    def halving_below(self, high: float, scale: float) -> List[float]:
        """Halving's sizes (items, rows of `scale`) from the start below `high`, largest first."""
        if self.start is None:
            return []
        sizes = [(self.start >> j) * scale for j in range(self.start.bit_length())]
        return [size for size in sizes if size < high]

    def to_dict(self) -> Dict[str, Any]:
        return dict(
            start=self.start,
            fits=[[f.items, f.budget] for f in self.fits],
            failures=[[f.items, f.bound, f.budget, f.short] for f in self.failures],
        )

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Evidence":
        """The evidence `to_dict` wrote (ValueError, TypeError or KeyError when it is not that)."""
        start = data.get("start")
        fits = [Fit(float(i), float(b)) for i, b in data["fits"]]
        failures = [Failure(float(i), float(u), float(b), bool(short)) for i, u, b, short in data["failures"]]
        if start is not None and (not isinstance(start, int) or start < 1):
            raise ValueError(f"start must be a positive int, got {start!r}")
        if any(f.items <= 0 or f.budget < 0 for f in fits) or any(f.items <= 0 or f.budget < 0 for f in failures):
            raise ValueError("sizes must be positive and budgets not negative")
        return cls(fits[-KEPT:], failures[-KEPT:], start)


def bracket_text(bracket: Bracket, scale: float) -> str:
    """The bracket in rows of `scale` items, for the log and `python -m toma sizes` ("-": not known)."""
    low = f"{bracket.low / scale:.0f}" if bracket.low else "-"
    high = f"{bracket.high / scale:.0f}" if math.isfinite(bracket.high) else "-"
    return f"fit {low}, failed {high}"


def _same_or_more(budget: float, than: float) -> bool:
    """`budget` is at least about `than`."""
    return budget >= than * (1 - SAME_BUDGET)
