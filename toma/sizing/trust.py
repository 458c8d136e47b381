"""How far `FitToMemory` trusts its need model, and how each measured attempt changes that: pure functions
from the model as it was before the attempt and what the attempt showed to the new standing."""

from dataclasses import dataclass
from enum import Enum
from typing import Optional, Sequence, Tuple

from toma.sizing.need import Need
from toma.sizing.settings import FitSettings

__all__ = ["Verdict", "Trust", "judge_fit", "judge_failure"]

Point = Tuple[float, float]  # (size in items, bytes)


class Verdict(Enum):
    """What the last measured attempt said of the model."""

    AGREED = "agreed"  # nothing against it (or nothing measured yet)
    OVERESTIMATED = "overestimated"  # a success needed far less than it said: grow by bisection
    MISPREDICTED = "mispredicted"  # a size it predicted to fit failed: the next size comes from the bracket


@dataclass(frozen=True)
class Trust:
    """The model's standing at a call site."""

    verdict: Verdict = Verdict.AGREED
    # the largest size (items) at which the model was wrong (a predicted fit failed, a success needed far less
    # or far more): while a failure bounds the bracket, the bracket decides (0: never wrong, or right again above it)
    doubted: float = 0.0
    # a smaller size was tried once beside the one size measured, to learn how the need grows
    probed: bool = False


def judge_fit(
    trust: Trust,
    before: Optional[Need],
    measured: Sequence[Point],
    items: float,
    used: float,
    settings: FitSettings,
) -> Trust:
    """The standing after an attempt of `items` that fit and needed `used` bytes, judged by the model `before`
    it (None: none yet, or errors alone, which give a floor, not a prediction) and the sizes `measured`."""
    if before is None:
        return Trust(Verdict.AGREED, trust.doubted, trust.probed)
    predicted = before.need(items)
    overestimated = used < settings.far_less * predicted
    doubted = trust.doubted
    # far less than it said, or (above every size measured: no fixed part explains it) far more
    above = items > max((size for size, _ in measured), default=0.0)
    if overestimated or above and used > (1 + settings.far_more) * predicted:
        doubted = max(doubted, items)
    elif above and abs(used - predicted) <= settings.right_again * used:
        doubted = 0.0  # right where it had to extrapolate: trusted again
    return Trust(Verdict.OVERESTIMATED if overestimated else Verdict.AGREED, doubted, trust.probed)


def judge_failure(trust: Trust, before: Optional[Need], items: float, budget: float) -> Trust:
    """The standing after an attempt of `items` ran out of memory under `budget`, judged by the model `before` it."""
    if before is not None and before.need(items) <= budget:
        return Trust(Verdict.MISPREDICTED, max(trust.doubted, items), trust.probed)
    return Trust(Verdict.AGREED, trust.doubted, trust.probed)
