"""`FitToMemory`'s settings, frozen: its constructor's arguments and the constants its decisions read.

`toma.sizing.decision` decides from these and the evidence alone, so a test can change one constant (or
margin) and feed evidence without the engine. The evidence's own constants (which budgets count as the same,
how many records are kept) belong to `toma.sizing.bracket`, and the need model's to `toma.sizing.need`.
"""

import math
import numbers
from dataclasses import dataclass
from typing import Any

__all__ = ["FitSettings", "check_margin", "UNBOUNDED_ROWS"]

UNBOUNDED_ROWS = 2**30  # the size where measurements set no bound (a call still never runs above what it asks)


def check_margin(margin: Any) -> float:
    """`margin` as a float in [0, 0.5) (ValueError naming it otherwise)."""
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not 0 <= float(margin) < 0.5:
        raise ValueError(f"margin must be a number in [0, 0.5), got {margin!r}")
    return float(margin)


@dataclass(frozen=True)
class FitSettings:
    """What `FitToMemory` decides by, besides the evidence (sizes in items, shares of a size or of bytes)."""

    margin: float = 0.05  # the share of the rows below the largest size predicted to fit
    measure_every: int = 64  # a settled size is measured every this many calls (while free memory is still)
    minimum: int = 1  # never fewer rows
    rarely: int = 64  # ... and, kept at every measurement, at least every this many `measure_every`s
    noise: float = 0.02  # a change of the size by no more than this share is noise: the size stays
    errors_share: float = 0.25  # with errors alone, which miss the work an attempt never reached: this share
    errors_drop: float = 1024  # errors alone never send the size further below the smallest failure than this
    learn: float = 0.8  # with one size measured, the next call runs this much smaller to learn the slope
    least_step: float = 0.02  # the smallest step of growth when one more error would end the search
    far: float = 1.1  # a proposal this far above every measured size keeps at least `far_margin`
    far_margin: float = 0.05
    right_again: float = 0.03  # a doubted model that predicts a new largest size this closely is trusted again
    far_more: float = 0.2  # a success above every measured size that needed this share more: the model is wrong
    far_less: float = 0.5  # a success that needed under this share of what the model said: it overestimates

    def rows(self, items: float, scale: float) -> int:
        """The rows of `scale` items each that `items` make, at least `minimum`."""
        rows = items / scale
        if not math.isfinite(rows):  # a need per item measured as nothing (the heap had room): no bound from it
            return UNBOUNDED_ROWS
        return max(self.minimum, int(math.floor(rows + 1e-9)))

    def slower(self, every: int) -> int:
        """The measurement period after a settled size was measured again and kept: twice `every` (0: the
        policy's `measure_every`), to at most `rarely` times `measure_every`."""
        return min(2 * (every or self.measure_every), self.rarely * self.measure_every)
