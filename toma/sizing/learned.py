"""What `FitToMemory` learned at a call site (kept on its cache entry), and that state's text in the size file:
written by `describe`, read back by `read_remembered` (for `FitToMemory.restore`) and shown by
`describe_remembered` (`python -m toma sizes`): the one home of the format."""

import dataclasses
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional, Tuple

import torch

from toma.core.caches import LearnedState
from toma.sizing.bracket import KEPT, Evidence, bracket_text
from toma.sizing.decision import Findings
from toma.sizing.need import Need, fit_need, format_bytes
from toma.sizing.settings import FitSettings
from toma.sizing.trust import Trust, judge_failure, judge_fit

__all__ = ["Learned", "Origin", "read_remembered", "describe_remembered"]

Point = Tuple[float, float]  # (size in items, bytes)


class Origin(Enum):
    """Where a call site's state came from, until the call site's next call has read it."""

    FORKED = "forked"  # a new free-memory level's copy: that call predicts its size
    RECALLED = "recalled"  # the size file's: that call keeps the size if its budget is about `Learned.budget`


@dataclass
class Learned(LearnedState):
    """What a call site's attempts showed (kept on its cache entry), and where the measurements stand."""

    evidence: Evidence = field(default_factory=Evidence)
    # (items, bytes) of the attempts that fit and were measured; items: rows times items per row (1 for the
    # forms, elements per row in accumulation)
    measured: List[Point] = field(default_factory=list)
    trust: Trust = Trust()  # how far the model is trusted
    origin: Optional[Origin] = None  # a copy or the size file's, not yet read by a call (None: neither)
    scale: float = 1.0  # items per row that the entry's size is for
    budget: float = 0.0  # the budget of the last measured attempt (or the size file's size was found with)
    quiet: int = 0  # calls since the size last changed
    every: int = 0  # a settled size is measured every this many calls (0: the policy's `measure_every`)
    reading: Any = None  # the free-memory gauge's reading at the last measurement
    device: Optional[torch.device] = None  # where the last measured attempt ran: the settled path reads it
    note: str = ""  # why the last size after an error was chosen, for the log line
    announced: int = 0  # the last size this call site grew to (ranks that agree may hold it smaller)

    def fork(self) -> "Learned":
        """A copy for a new free-memory level of the call site (what the default cache asks for)."""
        return Learned(
            evidence=self.evidence.copy(),
            measured=list(self.measured),
            trust=Trust(doubted=self.trust.doubted),
            origin=Origin.FORKED,
            scale=self.scale,
            budget=self.budget,
        )

    def findings(self) -> Findings:
        """What the decisions read (`toma.sizing.decision`)."""
        return Findings(self.evidence, tuple(self.measured), self.trust)

    def model(self) -> Optional[Need]:
        return fit_need(self.measured, self.evidence.bounds())

    def fitted(self, items: float, budget: float, used: Optional[float], settings: FitSettings) -> None:
        """An attempt of `items` fit under `budget`, needing `used` bytes (None: not measured): keep it as
        evidence, judge the model by it, and keep it as the one measurement of its size (sizes measured once
        stay, so the model keeps its slope)."""
        self.budget = budget
        self.evidence.fitted(items, budget)
        if used is None:
            return
        before = self.model() if self.measured else None  # errors alone give a floor, not a prediction
        self.trust = judge_fit(self.trust, before, self.measured, items, used, settings)
        others = [(size, need) for size, need in self.measured if abs(size - items) > 0.01 * items]
        self.measured = (others + [(items, used)])[-KEPT:]

    def failed(self, items: float, bound: float, budget: float, short: bool) -> None:
        """An attempt of `items` ran out of memory under `budget`, needing at least `bound` bytes: judge the
        model by it, and keep it as evidence."""
        self.budget = budget
        before = self.model() if self.measured else None
        self.trust = judge_failure(self.trust, before, items, budget)
        self.evidence.failed(items, bound, budget, short=short)

    def probed(self, probe: bool) -> None:
        """A choice was the one probe of a smaller size (`probe`): it is not made again."""
        if probe:
            self.trust = dataclasses.replace(self.trust, probed=True)

    def kept(self, settings: FitSettings) -> None:
        """A measurement kept the size: a settled size is measured half as often from now on, to a floor."""
        if self.quiet >= 2:
            self.every = settings.slower(self.every)
        self.quiet += 1

    def moved(self, size: int) -> bool:
        """A measurement moved the size to `size`: False when this call site announced that size already
        (another rank holds the agreed size below this one's)."""
        self.every = 0
        if size == self.announced:
            self.quiet += 1
            return False
        self.quiet, self.announced = 0, size
        return True

    def unsettled(self) -> None:
        """An attempt ran out of memory: the size is searched again, measured at every call."""
        self.quiet, self.note, self.announced, self.every = 0, "", 0, 0

    def describe(self) -> Optional[str]:
        """The model and the evidence as JSON text for the size file (None when nothing was learned)."""
        model = self.model()
        if model is None and not self.evidence.fits and not self.evidence.failures:
            return None
        line = {} if model is None else dataclasses.asdict(model)
        return json.dumps(
            dict(line, budget=self.budget, scale=self.scale, measured=self.measured, **self.evidence.to_dict())
        )


def describe_remembered(text: Optional[str]) -> str:
    """A size file's model as one line (`python -m toma sizes`); the text itself if it is not one."""
    if not text:
        return ""
    try:
        data = json.loads(text)
        parts = []
        if "per_item" in data:
            terms = ("fixed", "per_item", "per_square", "bend", "knee")
            parts.append(str(Need(*(float(data.get(term) or 0) for term in terms))))
        if data.get("budget"):
            parts.append(f"budget {format_bytes(float(data['budget']))}")
        if "fits" in data:
            evidence = Evidence.from_dict(data)
            budget = float(data.get("budget") or 0)
            bracket = evidence.bracket(budget, float(data.get("scale") or 1))
            parts.append(bracket_text(bracket, float(data.get("scale") or 1)))
        return "; ".join(parts)
    except (ValueError, TypeError, KeyError, AttributeError):
        return text


def read_remembered(
    text: str, size: Optional[int]
) -> Optional[Tuple[Evidence, List[Tuple[float, float]], float, float]]:
    """`Learned.describe`'s text read back: (evidence, measurements, budget, items per row), or None when this
    version cannot read it. A line from before the bracket was kept gives two points of it at `size`."""
    try:
        data = json.loads(text)
        budget, scale = float(data.get("budget") or 0), float(data.get("scale") or 1)
        if "fits" in data:
            evidence = Evidence.from_dict(data)
            measured = [(float(items), float(used)) for items, used in data.get("measured", [])][-KEPT:]
        else:
            fixed, per_item = float(data["fixed"]), float(data["per_item"])
            if not (per_item > 0 and fixed >= 0 and size):
                return None
            items = size * scale
            evidence = Evidence([], [], None)
            measured = [(items, fixed + per_item * items), (items / 2, fixed + per_item * items / 2)]
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return evidence, measured, budget, scale
