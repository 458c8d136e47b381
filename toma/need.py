"""The memory a call site needs as a function of its size, fitted to measurements.

`Need` is `fixed + per_item * size + per_square * size**2` bytes with non-negative terms: a straight line for
activations that grow with the rows, bending upwards for work that grows faster (pairwise distances,
attention over the batch). `fit_need` fits it to what attempts showed: the bytes an attempt that fit
needed, and the lower bound an attempt that ran out of memory gave *at its own size*.
"""

import math
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Need", "fit_need", "format_bytes"]

Point = Tuple[float, float]  # (size in items, bytes)

_BENDS = 0.03  # a line that under-predicts a measurement by more than this share is replaced by a curve


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class Need:
    """`fixed + per_item * size + per_square * size**2` bytes."""

    fixed: float
    per_item: float
    per_square: float = 0.0

    def need(self, size: float) -> float:
        return self.fixed + size * (self.per_item + self.per_square * size)

    def largest_within(self, budget: float) -> int:
        """The largest size whose need fits in `budget` (0 when none does)."""
        room = budget - self.fixed
        if room <= 0:
            return 0
        a, q = self.per_item, self.per_square
        if q > 0:
            largest = 2 * room / (a + math.sqrt(a * a + 4 * q * room))  # the positive root, without cancellation
        elif a > 0:
            largest = room / a
        else:
            return sys.maxsize  # nothing grows with the size
        return int(min(math.floor(largest * (1 + 1e-12)), sys.maxsize))

    def __str__(self) -> str:
        text = f"{format_bytes(self.fixed)} + {format_bytes(self.per_item)} per item"
        if self.per_square > 0:
            text += f" + {self.per_square:.3g} B per item squared"
        return text


def _solve(rows: List[List[float]], values: List[float]) -> Optional[List[float]]:
    """The least-squares solution of `rows @ x = values` (normal equations, Gaussian elimination), or None."""
    n = len(rows[0])
    matrix = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    vector = [sum(r[i] * v for r, v in zip(rows, values)) for i in range(n)]
    for column in range(n):
        pivot = max(range(column, n), key=lambda row: abs(matrix[row][column]))
        if abs(matrix[pivot][column]) < 1e-300:
            return None
        matrix[column], matrix[pivot] = matrix[pivot], matrix[column]
        vector[column], vector[pivot] = vector[pivot], vector[column]
        for row in range(n):
            if row != column:
                factor = matrix[row][column] / matrix[column][column]
                matrix[row] = [x - factor * y for x, y in zip(matrix[row], matrix[column])]
                vector[row] -= factor * vector[column]
    return [vector[i] / matrix[i][i] for i in range(n)]


def _least_squares(points: Sequence[Point], terms: Tuple[bool, bool, bool]) -> Optional[Need]:
    """The curve with the chosen terms (fixed, per item, per square) closest to `points` in relative error;
    None when it needs a negative term or cannot be solved."""
    powers = [power for power, used in enumerate(terms) if used]
    scales = [max(s for s, _ in points) ** power for power in powers]  # keeps the equations well conditioned
    rows = [[(s**power) / scale / b for power, scale in zip(powers, scales)] for s, b in points]
    solution = _solve(rows, [1.0] * len(points))
    if solution is None:
        return None
    coefficients = [0.0, 0.0, 0.0]
    for power, scale, value in zip(powers, scales, solution):
        if value < 0:
            return None
        coefficients[power] = value / scale
    return Need(*coefficients)


def _worst_shortfall(model: Need, points: Sequence[Point]) -> float:
    """The largest share of a measurement the model falls short of."""
    return max((b - model.need(s)) / b for s, b in points)


def _ceiling(model: Need, points: Sequence[Point]) -> Need:
    """The model lifted so that no measurement needed more than it says."""
    lift = max(0.0, max(b - model.need(s) for s, b in points))
    return Need(model.fixed + lift, model.per_item, model.per_square)


def _line(points: Sequence[Point]) -> Need:
    if len(points) == 1:
        (s, b), = points
        return Need(0.0, b / s)  # the fixed part counted per item: safe above the measured size
    line = _least_squares(points, (True, True, False))
    if line is None or line.per_item <= 0:  # noise: the steepest line through the origin
        return Need(0.0, max(b / s for s, b in points))
    return line


def _curve(points: Sequence[Point]) -> Optional[Need]:
    """The best curve that bends upwards, of the non-negative forms with two or three terms."""
    candidates = [
        _least_squares(points, terms) for terms in ((True, True, True), (True, False, True), (False, True, True))
    ]
    fitted = [c for c in candidates if c is not None and c.per_square > 0]
    return min(fitted, key=lambda c: max(abs(b - c.need(s)) / b for s, b in points), default=None)


def _bend(model: Need, size: float, bound: float, pivot: float) -> Need:
    """The model bent upwards so that it needs `bound` at `size` (> `pivot`), keeping its need at `pivot`:
    an error says what a size needs at least, not what every item costs."""
    short = bound - model.need(size)
    q = short / (size * (size - pivot))
    per_item = model.per_item - q * pivot
    if per_item < 0:  # the pivot cannot be kept without a negative slope: all growth in the square term
        return Need(model.fixed, 0.0, (bound - model.fixed) / (size * size))
    return Need(model.fixed, per_item, model.per_square + q)


def fit_need(fits: Sequence[Point], bounds: Sequence[Point] = ()) -> Optional[Need]:
    """The need that explains `fits` (what attempts that fit needed) and `bounds` (what attempts that ran out
    of memory needed at least, at their size): a line, or a curve once measurements bend away from a line;
    never below a measurement. With bounds alone, a line through the origin below them (a floor: errors
    miss the work an attempt never reached). None when there is nothing to fit."""
    largest: Dict[float, float] = {}
    for size, used in fits:
        if size > 0 and used > 0:
            largest[size] = max(used, largest.get(size, 0.0))
    points = sorted(largest.items())
    if not points:
        floors = [b / s for s, b in bounds if s > 0 and b > 0]
        return Need(0.0, max(floors)) if floors else None
    model = _line(points)
    if len(points) >= 3 and _worst_shortfall(model, points) > _BENDS:
        curve = _curve(points)
        if curve is not None and _worst_shortfall(curve, points) < _worst_shortfall(model, points) / 2:
            model = curve
    model = _ceiling(model, points)
    top = points[-1][0]
    for size, bound in sorted(bounds):
        if size > 0 and bound > model.need(size) * (1 + 1e-6):  # not for rounding
            if size > top:
                model = _ceiling(_bend(model, size, bound, top), points)
            else:  # an error below a size that fit (memory moved): the fixed part is larger
                model = Need(model.fixed + bound - model.need(size), model.per_item, model.per_square)
    if model.per_item <= 0 and model.per_square <= 0:
        return None
    return model
