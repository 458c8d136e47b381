"""What `FitToMemory` learned at a call site (kept on its cache entry), and that state's text in the size file:
written by `describe`, read back by `read_remembered` (for `FitToMemory.restore`) and shown by
`describe_remembered` (`python -m toma sizes`): the one home of the format."""

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch

from toma.core.caches import LearnedState
from toma.sizing.bracket import KEPT, Bracket, Evidence
from toma.sizing.need import Need, fit_need, format_bytes

__all__ = ["Learned", "read_remembered", "describe_remembered", "bracket_text"]


@dataclass
class Learned(LearnedState):
    """What a call site's attempts showed (kept on its cache entry)."""

    evidence: Evidence = field(default_factory=Evidence)
    # (items, bytes) of the attempts that fit and were measured; items: rows times items per row (1 for the
    # forms, elements per row in accumulation)
    measured: List[Tuple[float, float]] = field(default_factory=list)
    quiet: int = 0  # calls since the size last changed
    every: int = 0  # a settled size is measured every this many calls (0: the policy's `measure_every`)
    reading: Any = None  # the free-memory gauge's reading at the last measurement
    note: str = ""  # why the last size after an error was chosen, for the log line
    announced: int = 0  # the last size this call site grew to (ranks that agree may hold it smaller)
    scale: float = 1.0  # items per row that the entry's size is for
    budget: float = 0.0  # the budget of the last measured attempt
    recalled: Optional[float] = None  # the budget a size restored from the size file was found with
    fresh: bool = False  # a new free-memory level's copy: its first call predicts its size
    overestimated: bool = False  # the last success needed less than half what the model said: grow by bisection
    probed: bool = False  # a smaller size was tried beside the one size measured, to learn the slope
    mispredicted: bool = False  # a size the model predicted to fit failed: the next size comes from the bracket
    # the largest size (items) at which the model was wrong (a predicted fit failed, a success needed far less
    # or far more): while a failure bounds the bracket, the bracket decides (0: never wrong, or right again above it)
    doubted: float = 0.0
    device: Optional[torch.device] = None  # where the last measured attempt ran: the settled path reads it

    def fork(self) -> "Learned":
        """A copy for a new free-memory level of the call site (what the default cache asks for)."""
        return Learned(
            evidence=self.evidence.copy(),
            measured=list(self.measured),
            scale=self.scale,
            budget=self.budget,
            fresh=True,
            doubted=self.doubted,
        )

    def model(self) -> Optional[Need]:
        bounds = [(f.items, f.bound) for f in self.evidence.failures if f.bound > 0]
        return fit_need(self.measured, bounds)

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


def bracket_text(bracket: Bracket, scale: float) -> str:
    low = f"{bracket.low / scale:.0f}" if bracket.low else "-"
    high = f"{bracket.high / scale:.0f}" if math.isfinite(bracket.high) else "-"
    return f"fit {low}, failed {high}"


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
