"""`FitToMemory`: a sizing policy that measures attempts, models the need, and searches inside the bracket.

Each measured attempt is evidence: one that fit gives its need (peak bytes above what was in use when it
began, where the meter can tell, `toma.memory.meters`) and a size that fits under its budget; one that ran out
of memory gives a lower bound of the need *at its size* (its peak, or what it still held, plus the
allocation that failed) and a size that fails under its budget. From the needs it fits a model
(`toma.sizing.need.Need`: a line, or a curve once the measurements bend away from one); from the sizes, per
budget, the bracket (`toma.sizing.bracket`): the largest size that fit and the smallest that failed.

The model proposes: the size it predicts for the budget, less the margin (`(1 - margin)` of the largest
size predicted to fit, whatever the fixed part). The bracket disposes: a proposal never reaches a size
that failed under the same budget, nor above halving's next size from the call site's start, so no
workload whose need grows with the size pays more out-of-memory errors than `Halving`; where halving
would end higher and the model predicts it fits, that size is taken. When the model cannot explain an
error (memory the meter cannot see, an injected OOM), the next size comes from the bracket alone:
bisection above a size that fit, else halving. After a measured success the call site's size moves to
what the same rule chooses (growth back after memory frees, never above what a call asks for).
"""

import math
import numbers
from typing import Any, Callable, Optional, Tuple

import torch

from toma.core.caches import Batchsize
from toma.core.policy import LearningPolicy, shrink_below
from toma.memory.backends import default_meter
from toma.memory.free import GAUGE, FreeMemoryGauge
from toma.memory.meters import Mark, MemoryMeter
from toma.sizing.bracket import KEPT, SAME_BUDGET, Bracket
from toma.sizing.learned import Learned, bracket_text, describe_remembered, read_remembered
from toma.sizing.need import Need, format_bytes

__all__ = ["FitToMemory", "Need", "describe_remembered"]

_bytes = format_bytes  # the name `python -m toma sizes` imported before `toma.sizing.need` existed
_ERRORS_SHARE = 0.25  # with errors alone, which miss the work an attempt never reached: a quarter of the budget
_LEARN = 0.8  # with one size measured, the next call runs this much smaller to learn how the need grows
_ERRORS_DROP = 1024  # errors alone never send the size further below the smallest failure than this
_LEAST_STEP = 0.02  # the smallest step of growth when one more error would end the search
_RARELY = 64  # a settled size kept at every measurement is measured at least every this many `measure_every`s
_FAR, _FAR_MARGIN = 1.1, 0.05  # a proposal this far above every measured size keeps at least this margin
_RIGHT_AGAIN = 0.03  # a doubted model that predicts a new largest size this closely is trusted again
_FAR_MORE = 0.2  # a success above every measured size that needed this share more than predicted: the model is wrong

Token = Tuple[MemoryMeter, Mark, float]


def _bisect(low: float, high: float) -> float:
    """The middle of [low, high]: geometric while they are far apart (fewer steps over wide brackets)."""
    if high <= low:
        return low
    return math.sqrt(low * high) if high > 4 * low else (low + high) / 2


def _check_margin(margin: Any) -> float:
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not 0 <= float(margin) < 0.5:
        raise ValueError(f"margin must be a number in [0, 0.5), got {margin!r}")
    return float(margin)


def _moved(reading: Any, before: Any, step: int = 2**26) -> bool:
    """Free memory moved by more than `step` bytes (64 MiB) of some kind since `before`."""
    if before is None:
        return True
    return any((a is None) != (b is None) or (a is not None and abs(a - b) > step) for a, b in zip(reading, before))


class FitToMemory(LearningPolicy):
    """Size from measurements: `(1 - margin)` of the largest size predicted to fit, safeguarded by the
    bracket of sizes that fit and failed, never more out-of-memory errors than halving.

    `meter` measures attempts (None: the meter of the device the work runs on, `toma.memory.backends.default_meter`);
    once a call site's size has settled, a call is measured when free memory moves and otherwise every
    `measure_every`-th call, half as often each time a measurement keeps the size (to one in 64 of those).
    """

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
            raise TypeError(f"meter must be a toma.memory.meters.MemoryMeter, got {meter!r}")
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
    def known(entry: Batchsize) -> Optional[Learned]:
        """What this kind of policy learned at `entry` (None: nothing yet)."""
        state = entry.learned
        return state if isinstance(state, Learned) else None

    @staticmethod
    def learned(entry: Batchsize) -> Learned:
        """What this kind of policy learned at `entry`, begun if nothing was."""
        state = entry.learned
        if not isinstance(state, Learned):
            state = entry.learned = Learned()
        return state

    def model(self, entry: Batchsize) -> Optional[Need]:
        """The need model of a call site's entry (None before anything was measured)."""
        state = self.known(entry)
        return None if state is None else state.model()

    def bracket(self, entry: Batchsize, budget: Optional[float] = None) -> Optional[Bracket]:
        """The bracket (items) of a call site's entry under `budget` (None: its last measured budget)."""
        state = self.known(entry)
        if state is None:
            return None
        return state.evidence.bracket(state.budget if budget is None else budget, state.scale)

    def restore(self, entry: Batchsize, text: str) -> None:
        """Take up what the size file remembers (`Learned.describe`'s JSON): the next call keeps the
        remembered size if its budget is the one it was found with, else chooses one for its budget."""
        remembered = read_remembered(text, entry.value)
        if remembered is None:
            return  # a model this version cannot read: the remembered size alone
        evidence, measured, budget, scale = remembered
        if not (scale > 0 and budget > 0 and entry.value):
            return
        state = self.learned(entry)
        evidence.start = None  # halving in this run starts from the size this run's first call asks for
        state.evidence, state.measured = evidence, measured
        state.scale, state.budget, state.recalled = scale, budget, budget

    # --- the engine's hooks ----------------------------------------------------------------------------

    def start(
        self, entry: Batchsize, size: int, asked: int, scale: float, device: Optional[torch.device] = None
    ) -> int:
        """The size a call begins with when its rows hold `scale` items (elements) each: `size` (the entry's)
        when the scale is the one it was found for, else the size chosen for the budget now on `device`
        (never above `asked`, the size the call asked for). Padded batches of other widths need no new search."""
        state = self.known(entry)
        if state is not None and scale == state.scale and not state.fresh and state.recalled is None:
            if state.evidence.start is not None:  # the call site's size, as it is: the common case, kept fast
                return size
        state = self.learned(entry)
        if state.evidence.start is None:
            state.evidence.start = asked
        recalled, state.recalled = state.recalled, None
        fresh, state.fresh = state.fresh, False
        if scale == state.scale and recalled is None and not fresh:
            return size
        state.scale, state.quiet = scale, 0
        if not state.measured:
            return size
        mark = self._meter_for(device).begin()
        if mark is None:
            return size
        if recalled is not None and recalled * (1 - self.margin / 2) <= mark.budget <= recalled * (1 + self.margin):
            return size  # about the budget the remembered size was found with: keep it
        items, rule = self._choose(state, mark.budget, scale)
        chosen = min(asked, self._rows(items, scale))
        entry.set(chosen)
        state.note = f"predicted for {_bytes(mark.budget)} free and {scale:g} items per row: {rule}"
        return chosen

    def quick(self, entry: Batchsize, scale: float) -> bool:
        """True when this call runs at the entry's size unmeasured (a settled call site between measurements,
        free memory where it was): the engine then skips `start`, `begin` and finding the call's device."""
        state = entry.learned
        if type(state) is not Learned or state.fresh or state.recalled is not None or state.evidence.start is None:
            return False
        return self._between_measurements(state, scale, state.device)

    def _between_measurements(self, state: Learned, scale: float, device: Optional[torch.device]) -> bool:
        quiet = state.quiet
        if quiet >= 2 and quiet % (state.every or self.measure_every) and scale == state.scale:  # settled
            reading = self.gauge.read(device)  # throttled: a clock read most of the time
            if reading is state.reading or reading == state.reading or not _moved(reading, state.reading):
                state.quiet = quiet + 1
                return True
        return False

    def begin(
        self, entry: Batchsize, size: int, scale: float = 1.0, device: Optional[torch.device] = None
    ) -> Optional[Token]:
        """A measurement of the attempt on `device` (None: not measured this time)."""
        state = self.learned(entry)
        if self._between_measurements(state, scale, device):
            return None
        state.reading, state.device = self.gauge.read(device), device
        state.scale = scale
        meter = self._meter_for(device)
        mark = meter.begin()
        return None if mark is None else (meter, mark, scale)

    def _record_fit(self, state: Learned, token: Token, ran: int) -> Optional[float]:
        """Note an attempt of `ran` rows that fit; returns the bytes it needed (None: not measured)."""
        meter, mark, scale = token
        state.budget = mark.budget
        used = meter.used(mark)
        items = ran * scale
        state.evidence.fitted(items, mark.budget)
        if used is not None:
            before = state.model() if state.measured else None  # errors alone give a floor, not a prediction
            state.overestimated = False
            if before is not None:
                predicted = before.need(items)
                state.overestimated = used < 0.5 * predicted
                # far less than it said, or (above every size measured: no fixed part explains it) far more
                above = items > max(size for size, _ in state.measured)
                if state.overestimated or above and used > (1 + _FAR_MORE) * predicted:
                    state.doubted = max(state.doubted, items)
                elif above and abs(used - predicted) <= _RIGHT_AGAIN * used:
                    state.doubted = 0.0  # right where it had to extrapolate: trusted again
            state.mispredicted = False
            # one measurement per size, the newest: sizes measured once stay, so the model keeps its slope
            others = [(size, need) for size, need in state.measured if abs(size - items) > 0.01 * items]
            state.measured = (others + [(items, float(used))])[-KEPT:]
        return None if used is None else float(used)

    def observed(self, entry: Batchsize, token: Optional[Token], ran: int) -> None:
        """An attempt of `ran` rows that finished on this rank while the ranks agreed to redo it smaller
        (another rank ran out of memory): evidence for this rank, no change of the agreed size."""
        if token is not None and ran >= 1:
            self._record_fit(self.learned(entry), token, ran)

    def succeeded(self, entry: Batchsize, token: Optional[Token], ran: int) -> Optional[str]:
        if token is None or ran < 1:
            return None
        state = self.learned(entry)
        used = self._record_fit(state, token, ran)
        if used is None and not state.measured:  # not measured: nothing to size from
            state.quiet += 1
            return None
        current = entry.value or ran
        if ran < current:  # a short batch: evidence, not a verdict on the size
            state.quiet += 1
            return None
        _, mark, scale = token
        items, rule = self._choose(state, mark.budget, scale)
        best = self._rows(items, scale)
        if abs(best - current) <= 0.02 * current:  # not for noise: a size that creeps is worse than none
            if state.quiet >= 2:  # a settled size measured again and kept: measure it half as often, to a floor
                state.every = min(2 * (state.every or self.measure_every), _RARELY * self.measure_every)
            state.quiet += 1
            return None
        state.every = 0
        entry.set(best)
        if best == state.announced:  # another rank holds the agreed size below this one's: said already
            state.quiet += 1
            return None
        state.quiet, state.announced = 0, best
        measured = f"needed {_bytes(used)} of" if used is not None else "fit (not measured: below an earlier peak) in"
        return (
            f"{ran} {measured} {_bytes(mark.budget)}; {'growing' if best > current else 'shrinking'} to {best} ({rule})"
        )

    def explain(self, entry: Batchsize) -> str:
        state = self.known(entry)
        return "" if state is None else str(state.note)

    def after_oom(
        self,
        entry: Batchsize,
        token: Optional[Token],
        size: int,
        failed: int,
        error: BaseException,
    ) -> Optional[int]:
        state = self.learned(entry)
        halved = shrink_below(self, size, failed)
        state.quiet, state.note, state.announced, state.every = 0, "", 0, 0
        if token is None or halved is None:  # not measured (a throttled call: the retry is), or at the minimum
            return halved
        meter, mark, scale = token
        state.budget, state.overestimated = mark.budget, False
        bound = float(meter.bound(mark, error))
        before = state.model() if state.measured else None
        state.mispredicted = before is not None and before.need(failed * scale) <= mark.budget
        if state.mispredicted:
            state.doubted = max(state.doubted, failed * scale)
        state.evidence.failed(failed * scale, bound, mark.budget, short=failed < size)
        items, rule = self._choose(state, mark.budget, scale)
        chosen = max(self.minimum, min(failed - 1, self._rows(items, scale)))
        state.note = f"needed >= {_bytes(bound)} of {_bytes(mark.budget)}; {rule}"
        return chosen if chosen < failed else None

    # --- the choice ----------------------------------------------------------------------------------------

    def _choose(self, state: Learned, budget: float, scale: float) -> Tuple[float, str]:
        """The size (items) to run at under `budget`, and the rule that chose it, for the log."""
        evidence = state.evidence
        bracket = evidence.bracket(budget, scale)
        # nothing that failed, nothing halving would not try, unless it fit
        upper = min(bracket.high - scale, max(bracket.ceiling, bracket.low))
        model = state.model()
        failures = evidence.failures_under(budget)
        explained = model is not None and all(model.need(f.items) > f.budget * (1 - SAME_BUDGET) for f in failures)
        where = bracket_text(bracket, scale)
        # Near halving's next size (not one that failed), bisection tries that size itself: it costs no error
        # halving would not pay, and halving would end there.
        top = upper if bracket.low < upper < bracket.high - scale and upper <= 2 * bracket.low else None
        searched = _bisect(bracket.low, upper) if top is None else top
        halving = next(iter(evidence.halving_below(bracket.high, scale)), 0.0)
        if bracket.low < halving < searched:  # halving's size first: it fails only where the middle would too
            searched = halving
        # a model found wrong at a size the bracket still holds (not after memory freed: no failure bounds it)
        doubting = state.doubted > 0 and math.isfinite(bracket.high)
        if model is not None and explained and state.measured:
            largest = float(model.largest_within(budget))
            if state.overestimated:  # the model is far too cautious here
                items, rule = searched, f"bisection: model {model} needed far more than measured"
            elif (state.mispredicted or doubting) and bracket.low > 0:  # it was wrong here: the bracket decides
                # never above what the model, refitted to what proved it wrong, proposes now
                items = min(searched, (1 - self.margin) * bracket.high, max((1 - self.margin) * largest, bracket.low))
                rule = f"bisection: model {model} was wrong at {state.doubted / scale:.0f}"
            elif largest < bracket.low:  # it says a size that fit would not: near M, which is at least that size
                items, rule = bracket.low, f"the largest size that fit, which model {model} says is too large"
            else:
                items, rule, probing = self._trusted(state, model, largest, bracket, upper, scale, doubting)
                if probing:
                    return min(items, max(upper, scale)), f"{rule}; bracket {where}"
        elif model is not None and explained:
            # errors alone miss the work an attempt never reached; not so far below them that a call crawls
            items = max(model.largest_within(budget * _ERRORS_SHARE), bracket.high / _ERRORS_DROP)
            rule = f"a quarter of the budget by the errors' floor {model}"
        elif bracket.low > 0:
            items, rule = searched, "bisection: the model cannot explain an error"
        else:  # halving's next size below the smallest failure
            items = halving or bracket.high / 2
            rule = "halving: nothing measured explains the error"
        items = min(items, max(upper, scale))
        if (doubting or not explained) and bracket.low > 0 and items > bracket.low:
            if evidence.ceiling_if_failed(items, budget, scale) <= bracket.low:
                # one more error would leave halving no size above the largest fit: from a model found wrong,
                # grow by the margin's share, so that the search ends within it
                step = max(bracket.low / (1 - max(self.margin, _LEAST_STEP)), bracket.low + scale)
                if step < halving <= items:  # halving's own size costs no error halving would not pay
                    step = halving
                if step < items:
                    items, rule = step, f"{rule}, a step: one more error ends the search"
        return items, f"{rule}; bracket {where}"

    def _trusted(
        self,
        state: Learned,
        model: Need,
        largest: float,
        bracket: Bracket,
        upper: float,
        scale: float,
        doubting: bool,
    ) -> Tuple[float, str, bool]:
        """A model that has been right: its proposal, a probe of a smaller size (True: return it as it is), or
        halving's size where the model says it fits with half the margin to spare."""
        sizes = [size for size, _ in state.measured]
        spare, rule = self.margin, f"model {model}"
        if (1 - spare) * min(largest, bracket.high - scale) > _FAR * max(sizes) and spare < _FAR_MARGIN:
            # far above every measurement a small error of the slope is a large one of the size: land
            # with the wider margin, and measure there before closing in
            spare, rule = (
                _FAR_MARGIN,
                f"{rule} (far above the sizes measured: {_FAR_MARGIN:.0%} to spare first)",
            )
        items = (1 - spare) * min(largest, bracket.high - scale)
        alone = max(sizes) < 1.1 * min(sizes) and not state.probed and not doubting
        if alone and abs(items - sizes[-1]) < 0.1 * sizes[-1]:
            # one size says nothing of the fixed part: measure another, once
            items, state.probed = _LEARN * sizes[-1], True
            rule = f"a smaller size, to learn how the need grows beside model {model}"
            return items, rule, True
        for size in state.evidence.halving_below(bracket.high, scale):
            if size <= items:
                break
            # halving would end there, and the model says it fits with half the margin to spare (a size
            # at the very edge of what it predicts fails as often as not)
            if size <= upper and size <= (1 - spare / 2) * largest:
                items, rule = size, f"halving's size, which model {model} predicts to fit"
                break
        return items, rule, False

    def _rows(self, items: float, scale: float) -> int:
        """The rows of `scale` items each that `items` make, at least `minimum`."""
        return max(self.minimum, int(math.floor(items / scale + 1e-9)))
