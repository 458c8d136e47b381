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

from typing import Any, Callable, Optional, Tuple

import torch

from toma.core.arguments import check_size
from toma.core.caches import Batchsize
from toma.core.halving import halved
from toma.core.policy import CallState, LearningPolicy, shrink_below
from toma.memory.backends import default_meter
from toma.memory.free import GAUGE, FreeMemoryGauge
from toma.memory.meters import Mark, MemoryMeter
from toma.sizing.bracket import Bracket
from toma.sizing.decision import after_failure, after_fit, at_start
from toma.sizing.learned import Learned, Origin, describe_remembered, read_remembered
from toma.sizing.need import Need, format_bytes
from toma.sizing.settings import FitSettings, check_margin

__all__ = ["FitToMemory", "Need", "describe_remembered"]


Token = Tuple[MemoryMeter, Mark, float]


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
    The hooks gather the evidence and apply what the pure decisions of `toma.sizing.decision` say.
    """

    gauge: FreeMemoryGauge = GAUGE  # a settled call site is measured again when free memory moves

    def __init__(
        self,
        margin: float = 0.05,
        meter: Optional[MemoryMeter] = None,
        measure_every: int = 64,
        minimum: int = 1,
    ) -> None:
        self.margin = check_margin(margin)
        if meter is not None and not isinstance(meter, MemoryMeter):
            raise TypeError(f"meter must be a toma.memory.meters.MemoryMeter, got {meter!r}")
        measure_every, minimum = check_size(measure_every, "measure_every"), check_size(minimum, "minimum")
        self.meter, self.measure_every, self.minimum = meter, measure_every, minimum
        self.settings = FitSettings(margin=self.margin, measure_every=measure_every, minimum=minimum)
        self._meter_for: Callable[[Optional[torch.device]], MemoryMeter] = (
            default_meter if meter is None else lambda device: meter
        )

    def __repr__(self) -> str:
        return f"FitToMemory(margin={self.margin!r}, meter={self.meter!r})"

    def shrink(self, size: int) -> Optional[int]:
        """Halving: what the ranks of a process group and the fallback use."""
        return halved(size, self.minimum)

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
        state.scale, state.budget, state.origin = scale, budget, Origin.RECALLED

    # --- the engine's hooks: gather the evidence, ask `toma.sizing.decision`, apply its decision ---------------

    def start(self, call: CallState[Any]) -> int:
        """The size a call begins with when its rows hold `scale` items (elements) each: `size` (the entry's)
        when the scale is the one it was found for, else the size chosen for the budget now on `device`
        (never above `asked`, the size the call asked for). Padded batches of other widths need no new search."""
        entry, size, asked, scale, device = call.entry, call.size, call.initial, call.scale, call.device
        state = self.known(entry)
        if state is not None and scale == state.scale and state.origin is None:
            if state.evidence.start is not None:  # the call site's size, as it is: the common case, kept fast
                return size
        state = self.learned(entry)
        if state.evidence.start is None:
            state.evidence.start = asked
        origin, state.origin = state.origin, None
        if scale == state.scale and origin is None:
            return size
        # settled with free memory where it was: the last budget measured holds, no meter is read, and the call
        # site stays settled while the size does (padded batches of every width under a size that fits them all,
        # as a micro-batch size asked for that fits: not measured each)
        settled = origin is None and state.measured and state.quiet >= 2 and state.budget > 0
        if settled and _moved(self.gauge.read(device), state.reading):
            settled = False
        state.scale = scale
        if settled:
            budget = state.budget
        else:
            mark = self._meter_for(device).begin() if state.measured else None
            if mark is None:
                return size
            budget = mark.budget
        remembered = state.budget if origin is Origin.RECALLED else None
        decision = at_start(state.findings(), remembered, budget, scale, asked, self.settings)
        state.probed(decision.probe)
        if decision.size is None or decision.size == size:  # about the remembered budget, or the same: keep it
            return size
        state.quiet = 0  # a new size is measured before it counts as settled
        entry.set(decision.size)
        state.note = decision.why
        return decision.size

    def quick(self, call: CallState[Any]) -> bool:
        """True when this call runs at the entry's size unmeasured (a settled call site between measurements,
        free memory where it was): the engine then skips `start`, `begin` and finding the call's device."""
        entry, scale = call.entry, call.scale
        state = entry.learned
        if type(state) is not Learned or state.origin is not None or state.evidence.start is None:
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

    def begin(self, call: CallState[Any]) -> Optional[Token]:
        """A measurement of the attempt on `device` (None: not measured this time)."""
        entry, scale, device = call.entry, call.scale, call.device
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
        measured = meter.used(mark)
        used = None if measured is None else float(measured)
        state.fitted(ran * scale, mark.budget, used, self.settings)
        return used

    def observed(self, call: CallState[Any]) -> None:
        """An attempt of `ran` rows that finished on this rank while the ranks agreed to redo it smaller
        (another rank ran out of memory): evidence for this rank, no change of the agreed size."""
        entry, token, ran = call.entry, call.token, call.ran
        if token is not None and ran >= 1:
            self._record_fit(self.learned(entry), token, ran)

    def succeeded(self, call: CallState[Any]) -> Optional[str]:
        entry, token, ran = call.entry, call.token, call.ran
        if token is None or ran < 1:
            return None
        state = self.learned(entry)
        used = self._record_fit(state, token, ran)
        current = entry.value or ran
        if used is None and not state.measured or ran < current:  # nothing to size from, or a short batch
            state.quiet += 1  # (evidence, not a verdict on the size)
            return None
        _, mark, scale = token
        decision = after_fit(state.findings(), current, mark.budget, scale, self.settings)
        state.probed(decision.probe)
        best = decision.size
        if best is None:  # a change within the noise
            call.confirmed = state.quiet == 0 and used is not None  # the first measurement at this size
            state.kept(self.settings)
            return None
        entry.set(best)
        if not state.moved(best):  # said already
            return None
        measured = (
            f"needed {format_bytes(used)} of" if used is not None else "fit (not measured: below an earlier peak) in"
        )
        change = "growing" if best > current else "shrinking"
        return f"{ran} {measured} {format_bytes(mark.budget)}; {change} to {best} ({decision.why})"

    def explain(self, call: CallState[Any]) -> str:
        entry = call.entry
        state = self.known(entry)
        return "" if state is None else str(state.note)

    def after_oom(self, call: CallState[Any]) -> Optional[int]:
        entry, token, size, failed, error = call.entry, call.token, call.size, call.failed, call.error
        assert failed is not None and error is not None
        state = self.learned(entry)
        halved = shrink_below(self, size, failed)
        state.unsettled()
        if token is None or halved is None:  # not measured (a throttled call: the retry is), or at the minimum
            return halved
        meter, mark, scale = token
        bound = float(meter.bound(mark, error))
        state.failed(failed * scale, bound, mark.budget, short=failed < size)
        decision = after_failure(state.findings(), failed, bound, mark.budget, scale, self.settings)
        state.probed(decision.probe)
        state.note = decision.why
        return decision.size
