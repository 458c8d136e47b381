"""What one more micro-batch costs, in padded positions: the time a micro-batch takes is about
`overhead + per_position x padded area`, and splitting a micro-batch pays only where the padding it saves is worth
more than `overhead / per_position`. On a CPU a micro-batch's fixed cost is small and splitting at every large
step in length pays; on a GPU a small micro-batch costs about as much as a larger one (kernel launches, the
Python of the forward and backward run ahead of the device only so far), and splitting it to save padding makes
an epoch slower.

The ratio is measured, not assumed. The first micro-batches of a call site (after `WARMUP` of them) are timed as
they run, back to back: on CUDA by events in the stream, so a micro-batch's time is what it adds to the device's
timeline, launch-bound or compute-bound, without stopping the pipeline. A line `seconds = overhead + per_position
x area` is fitted to them by least squares; after that nothing is timed (the hot path reads one number). While
timing, micro-batches from odd sorted rows are packed to a quarter of the budget, so that the areas timed
differ. Until the line is fitted, and where the areas timed never differ enough to fit one, a split must save a
quarter of the budget."""

import threading
from typing import Any, Dict, List, Optional, Tuple

import torch

from toma.memory.backends import DeviceBackend, backend_for

__all__ = ["MicroBatchCost", "MicroBatchTimer"]

WARMUP = 2  # micro-batches not counted first: the allocator grows, kernels are chosen
SAMPLES = 8  # timed micro-batches the line is fitted to
GIVE_UP = 48  # timed micro-batches after which areas that never differ leave the default
NEVER = 1 << 62  # the overhead where time does not grow with the area: a split never pays
CPU = torch.device("cpu")


def _fitted(samples: List[Tuple[int, float]]) -> Optional[int]:
    """overhead / per_position of the least-squares line through (area, seconds); None if the areas are too alike."""
    areas = [float(area) for area, _ in samples]
    low, high = min(areas), max(areas)
    if high < 1.25 * low:
        return None
    count = float(len(samples))
    mean_area, mean_time = sum(areas) / count, sum(t for _, t in samples) / count
    spread = sum((a - mean_area) ** 2 for a in areas)
    per_position = sum((a - mean_area) * (t - mean_time) for a, (_, t) in zip(areas, samples)) / spread
    if per_position <= 0:
        return NEVER
    overhead = mean_time - per_position * mean_area
    return max(0, min(NEVER, round(overhead / per_position)))


class MicroBatchCost:
    """One call site's overhead of a micro-batch in padded positions: `fixed` where given (tests, reproducible
    runs), else measured as the module says. Shared by the calls of a decorated function, a Trainer, a map call."""

    __slots__ = ("fixed", "timing", "_seen", "_samples", "_lock")

    def __init__(self, fixed: Optional[int] = None) -> None:
        if fixed is not None and (isinstance(fixed, bool) or not isinstance(fixed, int) or fixed < 0):
            raise ValueError(f"a micro-batch's overhead must be a whole number of positions >= 0, got {fixed!r}")
        self.fixed = fixed
        self.timing = fixed is None  # whether micro-batches are still timed
        self._seen = 0
        self._samples: List[Tuple[int, float]] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "measuring" if self.timing else "default" if self.fixed is None else f"{self.fixed} positions"
        return f"MicroBatchCost({state})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MicroBatchCost):
            return NotImplemented
        return (self.fixed, self.timing, self._samples) == (other.fixed, other.timing, other._samples)

    __hash__ = None  # type: ignore[assignment]  # it changes as it measures

    def __getstate__(self) -> Dict[str, Any]:
        """What a copy or a pickle keeps: everything but the lock (callbacks and trainers are copied)."""
        return {name: getattr(self, name) for name in self.__slots__ if name != "_lock"}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self._lock = threading.Lock()

    def overhead(self, budget: int) -> int:
        """The padded positions a split must save, for micro-batches within `budget`."""
        return budget // 4 if self.fixed is None else self.fixed

    def timer(self, device: Optional[torch.device]) -> Optional["MicroBatchTimer"]:
        """A timer for one run of micro-batches on `device` (None: the host) while timing; None once measured."""
        return MicroBatchTimer(self, device or CPU) if self.timing else None

    def add(self, timed: List[Tuple[int, float]]) -> None:
        """Micro-batches that ran, as (padded area, seconds): counted, and the line fitted once there are enough."""
        with self._lock:
            for area, seconds in timed:
                if not self.timing:
                    return
                self._seen += 1
                if self._seen <= WARMUP:
                    continue
                self._samples.append((area, seconds))
                if len(self._samples) % SAMPLES == 0:
                    found = _fitted(self._samples)
                    if found is not None or len(self._samples) >= GIVE_UP:
                        self.fixed, self.timing = found, False
                        self._samples = []


class MicroBatchTimer:
    """Marks at the start of each micro-batch of one run and after the last; a micro-batch's time is the span
    from its mark to the next. A run that fails is dropped with its timer: only finished micro-batches count."""

    __slots__ = ("cost", "device", "backend", "marks", "areas")

    def __init__(self, cost: MicroBatchCost, device: torch.device) -> None:
        self.cost, self.device = cost, device
        self.backend: DeviceBackend = backend_for(device)
        self.marks: List[Any] = []
        self.areas: List[int] = []

    def begin(self, area: int) -> None:
        """A micro-batch of `area` padded positions starts (the one before it, if any, ends here). Spans are
        measured every SAMPLES micro-batches, so a long run (a map's chunks) stops being timed once measured."""
        self.marks.append(self.backend.timestamp(self.device))
        self.areas.append(area)
        if len(self.marks) > SAMPLES:
            self._measure()

    def end(self) -> None:
        """The last micro-batch has ended: every span measured (waiting for the device where it must) and added."""
        if self.marks:
            self.marks.append(self.backend.timestamp(self.device))
            self._measure()
        self.marks, self.areas = [], []

    def drop(self) -> None:
        """The micro-batch in flight failed: the spans before it are measured, its own time is no sample."""
        if len(self.marks) > 1:
            self._measure()
        self.marks, self.areas = [], []

    def _measure(self) -> None:
        """Add the spans between the marks so far; the last mark starts the next span."""
        spans = [self.backend.seconds_between(a, b) for a, b in zip(self.marks, self.marks[1:])]
        self.cost.add(list(zip(self.areas, spans)))
        self.marks, self.areas = self.marks[-1:], self.areas[len(spans) :]
