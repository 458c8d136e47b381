"""The memory a call site needs as a function of its size, fitted to measurements.

`Need` is `fixed + per_item * size + per_square * size**2` bytes with non-negative terms: a straight line for
activations that grow with the rows, bending upwards for work that grows faster (pairwise distances,
attention over the batch), or a line above a step (a workspace needed above some size). `fit_need` fits it to what attempts showed: the bytes an attempt that fit
needed, and the lower bound an attempt that ran out of memory gave *at its own size*.
"""

import math
import sys
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Need", "fit_need", "format_bytes"]

Point = Tuple[float, float]  # (size in items, bytes)

_POWERS = (2, 3)  # the powers of the size a curve may grow with (the square first: it wins ties)
_BENDS = 0.03  # a line that misses a measurement by more than this share is replaced by a curve that fits better


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class Need:
    """`fixed + per_item * size + per_square * size**2 + per_power * size**power` bytes, plus
    `bend * size * (size - knee)` above `knee`: what an error above the largest measured size (`knee`) says
    the need grows to, without changing it at the sizes measured."""

    fixed: float
    per_item: float
    per_square: float = 0.0
    bend: float = 0.0
    knee: float = 0.0
    per_power: float = 0.0
    power: float = 0.0

    def need(self, size: float) -> float:
        extra = self.bend * size * (size - self.knee) if size > self.knee else 0.0
        if self.per_power > 0:
            extra += self.per_power * size**self.power
        return self.fixed + size * (self.per_item + self.per_square * size) + extra

    def largest_within(self, budget: float) -> int:
        """The largest size whose need fits in `budget` (0 when none does)."""
        room = budget - self.fixed
        if room <= 0:
            return 0
        if self.per_power > 0:
            return self._search(budget)
        largest = _root(room, self.per_item, self.per_square)
        if self.bend > 0 and largest > self.knee:  # above the knee: the bent quadratic's root
            largest = max(self.knee, _root(room, self.per_item - self.bend * self.knee, self.per_square + self.bend))
        if largest >= sys.maxsize:  # nothing grows with the size
            return sys.maxsize
        return int(math.floor(largest * (1 + 1e-12)))

    def __str__(self) -> str:
        text = f"{format_bytes(self.fixed)} + {format_bytes(self.per_item)} per item"
        if self.per_square > 0:
            text += f" + {self.per_square:.3g} B per item squared"
        if self.per_power > 0:
            text += f" + {self.per_power:.3g} B per item to the power {self.power:g}"
        if self.bend > 0:
            text += f", bending up by {self.bend:.3g} B per item squared above {self.knee:.0f}"
        return text

    def _search(self, budget: float) -> int:
        """`largest_within` by bisection (the need grows with the size)."""
        low, high = 0, 1
        while self.need(high) <= budget:
            if high >= sys.maxsize // 2:
                return sys.maxsize
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self.need(middle) <= budget else (low, middle)
        return low


def _root(room: float, a: float, q: float) -> float:
    """The positive size at which `a * size + q * size**2` reaches `room` (> 0); inf when nothing grows."""
    if q > 0:
        return 2 * room / (a + math.sqrt(a * a + 4 * q * room))  # without cancellation, for either sign of a
    return room / a if a > 0 else math.inf


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


def _least_squares(points: Sequence[Point], powers: Tuple[float, ...]) -> Optional[Need]:
    """The sum of powers of the size (0: fixed, 1: per item, 2: per square, another: per power; at most one
    other) closest to `points` in relative error; None when it needs a negative term or cannot be solved."""
    scales = [max(s for s, _ in points) ** power for power in powers]  # keeps the equations well conditioned
    rows = [[(s**power) / scale / b for power, scale in zip(powers, scales)] for s, b in points]
    solution = _solve(rows, [1.0] * len(points))
    if solution is None or any(value < 0 for value in solution):
        return None
    terms = {power: value / scale for power, scale, value in zip(powers, scales, solution)}
    other = next((power for power in powers if power not in (0, 1, 2)), None)
    per_power = 0.0 if other is None else terms[other]
    return Need(terms.get(0, 0.0), terms.get(1, 0.0), terms.get(2, 0.0), per_power=per_power, power=other or 0.0)


def _worst_miss(model: Need, points: Sequence[Point]) -> float:
    """The largest share of a measurement the model misses it by, either way."""
    return max(abs(b - model.need(s)) / b for s, b in points)


def _ceiling(model: Need, points: Sequence[Point]) -> Need:
    """The model lifted so that no measurement needed more than it says."""
    lift = max(0.0, max(b - model.need(s) for s, b in points))
    return replace(model, fixed=model.fixed + lift)


def _line(points: Sequence[Point]) -> Need:
    if len(points) == 1:
        ((s, b),) = points
        return Need(0.0, b / s)  # the fixed part counted per item: safe above the measured size
    line = _least_squares(points, (0, 1))
    if line is None or line.per_item <= 0:  # noise: the steepest line through the origin
        return Need(0.0, max(b / s for s, b in points))
    return line


def _curve(points: Sequence[Point]) -> Optional[Need]:
    """The best curve that bends upwards: a fixed part, a line, and a power of the size above one."""
    candidates = [
        _least_squares(points, terms) for power in _POWERS for terms in ((0, 1, power), (0, power), (1, power))
    ]
    fitted = [c for c in candidates if c is not None and c.per_square + c.per_power > 0]
    return min(fitted, key=lambda c: _worst_miss(c, points), default=None)


def _step(points: Sequence[Point]) -> Optional[Need]:
    """A line through the sizes above the highest step up in `points` (a library switching to a way that
    needs a workspace): the longest run of the largest sizes a line explains, where the line through the
    sizes below runs under them. With one size above the step, the slope below it; None when no step explains
    the points."""
    for split in range(1, len(points)):
        below, above = points[:split], points[split:]
        under = _line(below)
        if _worst_miss(under, below) > _BENDS:
            continue
        line = _line(above) if len(above) >= 2 else replace(under, fixed=above[0][1] - under.per_item * above[0][0])
        if len(above) >= 2 and (_worst_miss(line, above) > _BENDS or line.fixed < 0):
            continue
        if line.fixed >= 0 and line.need(below[-1][0]) > below[-1][1] * (1 + _BENDS):  # a step up, not noise
            return line
    return None


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
    if len(points) >= 3 and _worst_miss(model, points) > _BENDS:
        curve = _curve(points)
        if curve is not None and _worst_miss(curve, points) < _worst_miss(model, points) / 2:
            model = curve
        step = _step(points) if _worst_miss(model, points) > _BENDS else None
        if step is not None:
            model = step
    model = _ceiling(model, points)
    top = points[-1][0]
    for size, bound in bounds:  # an error at or below a size that fit (memory moved): the fixed part is larger
        if 0 < size <= top and bound > model.need(size) * (1 + 1e-6):  # not for rounding
            model = replace(model, fixed=model.fixed + bound - model.need(size))
    # an error above: the need bends up from the largest measured size, as much as the nearest error says
    # (the one that says most of the sizes between: a bend through a far error's bound rises too steeply
    # near the knee for a need that grows faster than a square, and the nearest error's bend reaches every
    # farther size's budget anyway)
    above = [(size, bound) for size, bound in bounds if size > top and bound > model.need(size) * (1 + 1e-6)]
    nearest = min((size for size, _ in above), default=0.0)
    bend = max(
        [(bound - model.need(size)) / (size * (size - top)) for size, bound in above if size == nearest], default=0.0
    )
    if bend > 0:
        model = replace(model, bend=bend, knee=top)
    if model.per_item <= 0 and model.per_square <= 0 and model.per_power <= 0 and model.bend <= 0:
        return None
    return model
