"""`FitToMemory`: a sizing policy that measures attempts and jumps to the largest size predicted to fit.

Each measured attempt gives a point of `need(size) = fixed + per_item * size`: an attempt that fit gives
its peak bytes above what was in use when it began (where the meter can tell, `toma.meters`); one that ran
out of memory gives a lower bound (its peak, or what it still held, plus the allocation that failed).
Attempts are measured on the device the work runs on (the step's `device`). After an out-of-memory error
the policy jumps to the largest size whose predicted need fits in `budget * (1 - margin)`; after a
success with room left the call site's size grows for the next call (never above what a call asks for).
Without a meter, or with nothing measured, it halves, as toma always did; when an error contradicts the
model it shrinks at least as fast as halving and trusts the model again only after a new measurement.
"""

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch

from toma.batchsize_cache import Batchsize
from toma.free_memory import GAUGE, FreeMemoryGauge
from toma.meters import Mark, MemoryMeter, default_meter
from toma.policy import SizePolicy, shrink_below

__all__ = ["FitToMemory", "LinearNeed"]

_KEPT = 16  # measurements kept per call site: the newest, so that the model follows a drifting workload


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


@dataclass
class LinearNeed:
    """`fixed + per_item * size` bytes: the model of a call site's memory need."""

    fixed: float
    per_item: float

    def need(self, size: float) -> float:
        return self.fixed + self.per_item * size

    def largest_within(self, budget: float) -> int:
        """The largest size whose need fits in `budget` (0 when none does)."""
        room = budget - self.fixed
        return 0 if room <= 0 else int(math.floor(room / self.per_item))

    def __str__(self) -> str:
        return f"{_bytes(self.fixed)} + {_bytes(self.per_item)} per item"


@dataclass
class _Learned:
    """What a call site's attempts showed (kept on its cache entry)."""

    # sizes in items: rows times items per row (1 for the forms; elements per row in accumulation)
    fits: List[Tuple[float, float]] = field(default_factory=list)  # (items, bytes they needed)
    bounds: List[Tuple[float, float]] = field(default_factory=list)  # (items, at least this many bytes)
    # (size, the budget it failed with, the largest size to try again with no more budget than that)
    failures: List[Tuple[float, int, float]] = field(default_factory=list)
    distrust: bool = False  # an error contradicted the model: halve until measured again
    quiet: int = 0  # calls since the size last changed
    reading: Any = None  # the free-memory gauge's reading at the last measurement
    note: str = ""  # why the last size after an error was chosen, for the log line
    announced: int = 0  # the last size this call site grew to (ranks that agree may hold it smaller)
    scale: float = 1.0  # items per row (elements per row in accumulation) that the entry's size is for
    budget: float = 0.0  # the budget of the last measured attempt
    recalled: Optional[float] = None  # the budget a size restored from the size file was found with
    fresh: bool = False  # a new free-memory level's copy: its first call predicts its size

    def fork(self) -> "_Learned":
        """A copy for a new free-memory level of the call site (what the default cache asks for)."""
        return _Learned(
            fits=list(self.fits), bounds=list(self.bounds), failures=list(self.failures), scale=self.scale,
            budget=self.budget, fresh=True,
        )

    def model(self) -> Optional[LinearNeed]:
        sizes = {size for size, _ in self.fits}
        if len(sizes) >= 2:
            n = len(self.fits)
            mean_x = sum(s for s, _ in self.fits) / n
            mean_y = sum(b for _, b in self.fits) / n
            var = sum((s - mean_x) ** 2 for s, _ in self.fits)
            per = sum((s - mean_x) * (b - mean_y) for s, b in self.fits) / var
            fixed = mean_y - per * mean_x
            if per <= 0 or fixed < 0:  # noise: fall back to the steepest line through the origin
                fixed, per = 0.0, max(b / s for s, b in self.fits)
            else:  # no point may need more than the line says: the line is a ceiling
                fixed += max(b - (fixed + per * s) for s, b in self.fits)
        elif self.fits:
            fixed, per = 0.0, max(b / s for s, b in self.fits)  # the fixed part counted per item: safe
        elif self.bounds:
            fixed, per = 0.0, max(b / s for s, b in self.bounds)  # a floor on the need: an optimistic model
        else:
            return None
        for size, bound in self.bounds:  # never below what an error showed
            if fixed + per * size < bound:
                per = (bound - fixed) / size
        return LinearNeed(fixed, per) if per > 0 else None


def _moved(reading: Any, before: Any, step: int = 2**26) -> bool:
    """Free memory moved by more than `step` bytes (64 MiB) of some kind since `before`."""
    if before is None:
        return True
    return any((a is None) != (b is None) or (a is not None and abs(a - b) > step) for a, b in zip(reading, before))


def _check_margin(margin: Any) -> float:
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not 0 <= float(margin) < 0.5:
        raise ValueError(f"margin must be a number in [0, 0.5), got {margin!r}")
    return float(margin)


class FitToMemory(SizePolicy):
    """Size from measurements: jump to the largest size predicted to fit in `budget * (1 - margin)`.

    `meter` measures attempts (None: the meter of the device the work runs on, `toma.meters.default_meter`);
    once a call site's size has settled, only every `measure_every`-th call is measured.
    """

    learns = True
    gauge: FreeMemoryGauge = GAUGE  # a settled call site is measured again when free memory moves

    def __init__(
        self,
        margin: float = 0.05,
        meter: Optional[MemoryMeter] = None,
        measure_every: int = 64,
        minimum: int = 1,
    ) -> None:
        self.margin = _check_margin(margin)
        if meter is not None and not isinstance(meter, MemoryMeter):
            raise TypeError(f"meter must be a toma.meters.MemoryMeter, got {meter!r}")
        if isinstance(measure_every, bool) or not isinstance(measure_every, int) or measure_every < 1:
            raise ValueError(f"measure_every must be a positive int, got {measure_every!r}")
        if isinstance(minimum, bool) or not isinstance(minimum, int) or minimum < 1:
            raise ValueError(f"minimum must be a positive int, got {minimum!r}")
        self.meter, self.measure_every, self.minimum = meter, measure_every, minimum
        self._meter_for: Callable[[Optional[torch.device]], MemoryMeter] = (
            default_meter if meter is None else lambda device: meter
        )

    def __repr__(self) -> str:
        return f"FitToMemory(margin={self.margin!r}, meter={self.meter!r})"

    def shrink(self, size: int) -> Optional[int]:
        """Halving: what the ranks of a process group and the fallback use."""
        return None if size <= self.minimum else max(self.minimum, size // 2)

    @staticmethod
    def learned(entry: Batchsize) -> _Learned:
        state = entry.learned
        if state is None:
            state = entry.learned = _Learned()
        return state  # type: ignore[no-any-return]

    def model(self, entry: Batchsize) -> Optional[LinearNeed]:
        """The need model of a call site's entry (None before anything was measured)."""
        state = entry.learned
        return None if state is None else state.model()

    def restore(self, entry: Batchsize, text: str) -> None:
        """Take up a model remembered in the size file (`toma.size_store.describe_model`'s JSON): the next
        call keeps the remembered size if its budget is the one it was found with, else predicts one."""
        try:
            data = json.loads(text)
            fixed, per_item = float(data["fixed"]), float(data["per_item"])
            budget, scale = float(data.get("budget") or 0), float(data.get("scale") or 1)
        except (ValueError, TypeError, KeyError, AttributeError):
            return  # a model this version cannot read: the remembered size alone
        if not (per_item > 0 and fixed >= 0 and scale > 0 and budget > 0 and entry.value):
            return
        state = self.learned(entry)
        items = entry.value * scale
        state.fits = [(items, fixed + per_item * items), (items / 2, fixed + per_item * items / 2)]
        state.scale, state.budget, state.recalled = scale, budget, budget

    # --- the engine's hooks ----------------------------------------------------------------------------

    def start(
        self, entry: Batchsize, size: int, asked: int, scale: float, device: Optional[torch.device] = None
    ) -> int:
        """The size a call begins with when its rows hold `scale` items (elements) each: `size` (the entry's)
        when the scale is the one it was found for, else the largest the model predicts to fit now on
        `device` (never above `asked`, the size the call asked for). Padded batches of other widths need no
        new search."""
        state = self.learned(entry)
        recalled, state.recalled = state.recalled, None
        fresh, state.fresh = state.fresh, False
        if scale == state.scale and recalled is None and not fresh:
            return size
        model = state.model()
        state.scale, state.quiet = scale, 0
        mark = None if model is None else self._meter_for(device).begin()
        if model is None or mark is None:
            return size
        if recalled is not None and recalled * (1 - self.margin / 2) <= mark.budget <= recalled * (1 + self.margin):
            return size  # about the budget the remembered size was found with: keep it
        fits = min(asked, self._rows(self._best(state, model, mark.budget, 1 - self.margin), scale))
        entry.set(fits)
        state.note = f"predicted for {_bytes(mark.budget)} free and {scale:g} items per row: {model}"
        return fits

    def begin(
        self, entry: Batchsize, size: int, scale: float = 1.0, device: Optional[torch.device] = None
    ) -> Optional[Tuple[MemoryMeter, Mark, float]]:
        """A measurement of the attempt on `device` (None: not measured this time)."""
        state = self.learned(entry)
        settled = state.quiet >= 2 and not state.distrust and scale == state.scale
        if settled and state.quiet % self.measure_every:
            reading = self.gauge.read(device)  # throttled: a clock read most of the time
            if reading == state.reading or not _moved(reading, state.reading):
                state.quiet += 1
                return None
        state.reading = self.gauge.read(device)
        state.scale = scale
        meter = self._meter_for(device)
        mark = meter.begin()
        return None if mark is None else (meter, mark, scale)

    def succeeded(
        self, entry: Batchsize, token: Optional[Tuple[MemoryMeter, Mark, float]], ran: int
    ) -> Optional[str]:
        state = self.learned(entry)
        if token is None or ran < 1:
            return None
        meter, mark, scale = token
        state.budget = mark.budget
        used = meter.used(mark)
        if used is not None:
            state.fits = (state.fits + [(ran * scale, float(used))])[-_KEPT:]
            state.distrust = False
        elif state.distrust or not state.fits:  # not measured: nothing to trust a model of errors alone with
            state.quiet += 1
            return None
        model = state.model()
        current = entry.value or ran
        if model is None or ran < current:  # a short batch: a point for the model, not a verdict on the size
            state.quiet += 1
            return None
        best = self._rows(self._best(state, model, mark.budget, 1 - self.margin), scale)
        if abs(best - current) <= 0.02 * current:  # not for noise: a size that creeps is worse than none
            state.quiet += 1
            return None
        entry.set(best)
        if best == state.announced:  # another rank holds the agreed size below this one's: said already
            state.quiet += 1
            return None
        state.quiet, state.announced = 0, best
        measured = f"needed {_bytes(used)} of" if used is not None else "fit (not measured: below an earlier peak) in"
        return (
            f"{ran} {measured} {_bytes(mark.budget)}; "
            f"{'growing' if best > current else 'shrinking into the margin'} to {best} ({model})"
        )

    def explain(self, entry: Batchsize) -> str:
        state = entry.learned
        return "" if state is None else str(state.note)

    def after_oom(
        self,
        entry: Batchsize,
        token: Optional[Tuple[MemoryMeter, Mark, float]],
        size: int,
        failed: int,
        error: BaseException,
    ) -> Optional[int]:
        state = self.learned(entry)
        halved = shrink_below(self, size, failed)
        state.quiet, state.note, state.announced = 0, "", 0
        if token is None:
            return halved
        meter, mark, scale = token
        state.budget = mark.budget
        items = failed * scale
        before = state.model() if state.fits else None
        if before is not None and before.need(items) <= mark.budget * (1 - self.margin):
            state.distrust = True  # it was predicted to fit: memory the meter cannot see, fragmentation...
        known = meter.failed_bytes(error)
        bound = float(meter.at_least(mark) + (known or 0))
        if bound > 0:
            state.bounds = (state.bounds + [(items, bound)])[-_KEPT:]
        model = state.model()
        if model is None or halved is None:
            state.failures = (state.failures + [(items, mark.budget, (halved or 1) * scale)])[-_KEPT:]
            return halved
        # Measured fits make the model a ceiling; errors alone make it a floor (the layers an attempt never
        # reached are missing from it), so it is aimed at half the budget and the size grows once measured.
        share = 1 - self.margin if state.fits else 0.5
        best = self._rows(self._best(state, model, mark.budget, share), scale)
        if model.largest_within(mark.budget * share) >= items:
            state.distrust = True  # what the meter saw would have fit: the error came from memory it cannot see
        chosen = min(failed - 1, max(self.minimum, min(best, halved) if state.distrust else best))
        # An error the model explains bars only the failed size; one it cannot explain bars growing above
        # the size chosen now, until the budget grows. Kept in items: they hold for any width.
        ceiling = chosen if state.distrust else failed - 1
        state.failures = (state.failures + [(items, mark.budget, ceiling * scale)])[-_KEPT:]
        state.note = f"needed >= {_bytes(bound)} of {_bytes(mark.budget)}: {model}"
        return chosen

    def _best(self, state: _Learned, model: LinearNeed, budget: int, share: float) -> float:
        """The most items predicted to fit in `share` of the budget, below every size that failed with
        no more memory than there is now."""
        best: float = model.largest_within(budget * share)
        for _, failed_budget, ceiling in state.failures:
            if failed_budget >= budget * (1 - self.margin / 2):
                best = min(best, ceiling)
        return best

    def _rows(self, items: float, scale: float) -> int:
        """The rows of `scale` items each that `items` make, at least `minimum`."""
        return max(self.minimum, int(math.floor(items / scale + 1e-9)))
