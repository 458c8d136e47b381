"""`FitToMemory`'s decisions as pure functions of the evidence and the frozen settings (no engine, no meter).

`choose` is the rule (module docstring of `toma.sizing.fit_to_memory`): the model proposes `(1 - margin)` of
the largest size it predicts to fit, the bracket disposes (never a size that failed under the same budget,
nor above halving's next size from the start); a model found wrong or unable to explain an error leaves the
choice to the bracket. `at_start`, `after_fit` and `after_failure` turn its choice into what the hook of that
name does with the call site's size.
"""

import math
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional, Sequence, Tuple

from toma.sizing.bracket import SAME_BUDGET, Bracket, Evidence, Failure, bracket_text
from toma.sizing.need import Need, fit_need, format_bytes
from toma.sizing.settings import FitSettings
from toma.sizing.trust import Trust, Verdict

__all__ = ["Findings", "Choice", "Decision", "choose", "at_start", "after_fit", "after_failure"]

Point = Tuple[float, float]  # (size in items, bytes)


@dataclass(frozen=True)
class Findings:
    """What a call site's attempts showed, as the decisions read it: the fits and failures per budget, the
    bytes the measured fits needed (items, bytes), and the model's standing."""

    evidence: Evidence
    measured: Tuple[Point, ...] = ()
    trust: Trust = Trust()

    def model(self) -> Optional[Need]:
        return fit_need(self.measured, self.evidence.bounds())


@dataclass(frozen=True)
class Choice:
    """The size (items) to run at, the rule that chose it (for the log), and whether it is the one probe of
    a smaller size that learns how the need grows (the call site's trust then records it)."""

    items: float
    rule: str
    probe: bool = False


@dataclass(frozen=True)
class Decision:
    """What a hook does with the call site's size: `size` (rows; None: keep it, or after an error: nothing is
    left below the failure), why (for the log), and whether the choice was the probe."""

    size: Optional[int]
    why: str = ""
    probe: bool = False


class _Search(NamedTuple):
    """What the bracket alone says under one budget."""

    bracket: Bracket
    upper: float  # nothing that failed, nothing halving would not try, unless it fit
    searched: float  # the bracket's next size: halving's, or bisection's
    halving: float  # halving's largest size below the smallest failure (0: none)


def _bisect(low: float, high: float) -> float:
    """The middle of [low, high]: geometric while they are far apart (fewer steps over wide brackets)."""
    if high <= low:
        return low
    return math.sqrt(low * high) if high > 4 * low else (low + high) / 2


def _search(evidence: Evidence, budget: float, scale: float) -> _Search:
    bracket = evidence.bracket(budget, scale)
    low, high = bracket.low, bracket.high
    upper = min(high - scale, max(bracket.ceiling, low))
    # Near halving's next size (not one that failed), bisection tries that size itself: it costs no error
    # halving would not pay, and halving would end there.
    near = low < upper < high - scale and upper <= 2 * low
    searched = upper if near else _bisect(low, upper)
    halving = next(iter(evidence.halving_below(high, scale)), 0.0)
    if low < halving < searched:  # halving's size first: it fails only where the middle would too
        searched = halving
    return _Search(bracket, upper, searched, halving)


def _explains(model: Optional[Need], failures: Sequence[Failure]) -> bool:
    """The model says every failure under the budget needed more than its budget (within `SAME_BUDGET`)."""
    return model is not None and all(model.need(f.items) > f.budget * (1 - SAME_BUDGET) for f in failures)


def choose(findings: Findings, budget: float, scale: float, settings: FitSettings) -> Choice:
    """The size (items, rows of `scale` items) to run at under `budget`, and the rule that chose it."""
    evidence = findings.evidence
    search = _search(evidence, budget, scale)
    low, high = search.bracket.low, search.bracket.high
    model = findings.model()
    explained = _explains(model, evidence.failures_under(budget))
    # a model found wrong at a size the bracket still holds (not after memory freed: no failure bounds it)
    doubting = findings.trust.doubted > 0 and math.isfinite(high)
    if model is not None and explained and findings.measured:
        choice = _modelled(findings, model, budget, search, scale, settings, doubting)
    elif model is not None and explained:
        # errors alone miss the work an attempt never reached; not so far below them that a call crawls
        items = max(model.largest_within(budget * settings.errors_share), high / settings.errors_drop)
        choice = Choice(items, f"a quarter of the budget by the errors' floor {model}")
    elif low > 0:
        choice = Choice(search.searched, "bisection: the model cannot explain an error")
    else:  # halving's next size below the smallest failure
        choice = Choice(search.halving or high / 2, "halving: nothing measured explains the error")
    items, rule = min(choice.items, max(search.upper, scale)), choice.rule
    if (doubting or not explained) and low > 0 and items > low:
        items, rule = _step_up(evidence, items, rule, budget, scale, search, settings)
    return Choice(items, f"{rule}; bracket {bracket_text(search.bracket, scale)}", choice.probe)


def _modelled(
    findings: Findings,
    model: Need,
    budget: float,
    search: _Search,
    scale: float,
    settings: FitSettings,
    doubting: bool,
) -> Choice:
    """The choice where the model explains every failure and some fit was measured."""
    largest = float(model.largest_within(budget))
    low, high, margin = search.bracket.low, search.bracket.high, settings.margin
    verdict = findings.trust.verdict
    if verdict is Verdict.OVERESTIMATED:  # the model is far too cautious here
        return Choice(search.searched, f"bisection: model {model} needed far more than measured")
    if (verdict is Verdict.MISPREDICTED or doubting) and low > 0:  # it was wrong here: the bracket decides
        # never above what the model, refitted to what proved it wrong, proposes now
        items = min(search.searched, (1 - margin) * high, max((1 - margin) * largest, low))
        return Choice(items, f"bisection: model {model} was wrong at {findings.trust.doubted / scale:.0f}")
    if largest < low:  # it says a size that fit would not: near M, which is at least that size
        return Choice(low, f"the largest size that fit, which model {model} says is too large")
    choice = _trusted(findings, model, largest, search, scale, settings, doubting)
    measured = [size for size, _ in findings.measured]
    if _pinned_by_a_guess(model, budget, largest, choice, search, scale, settings, measured):
        # the bend is an error's guess, never measured: where it holds the size at the largest one measured
        # while halving still has a size above it, measure between them (an error there halving pays too)
        return Choice(
            search.searched, f"bisection: only the bend of model {model} keeps the size near {low / scale:.0f}"
        )
    return choice


def _pinned_by_a_guess(
    model: Need,
    budget: float,
    largest: float,
    choice: Choice,
    search: _Search,
    scale: float,
    settings: FitSettings,
    measured: Sequence[float],
) -> bool:
    """The model's proposal is within `far` of the largest size measured only because of its bend (what the
    nearest error above says, a guess no attempt measured), and a failure lies more than twice above: the size would
    never move from there to learn how the need really grows."""
    low, high = search.bracket.low, search.bracket.high
    if model.bend <= 0 or choice.probe or not low < search.searched < high or high <= 2 * low:
        return False
    proposed = settings.rows(choice.items, scale) * scale  # the rows it would run
    # a size measured already (within noise) teaches nothing new, and the bend, not the measured line, is
    # what holds it there: without it the model would allow more than twice the size
    known = any(abs(proposed - size) <= settings.noise * size for size in measured)
    return known and proposed <= settings.far * low and replace(model, bend=0.0).largest_within(budget) > 2 * largest


def _trusted(
    findings: Findings,
    model: Need,
    largest: float,
    search: _Search,
    scale: float,
    settings: FitSettings,
    doubting: bool,
) -> Choice:
    """A model that has been right: its proposal, a probe of a smaller size, or halving's size where the model
    says it fits with half the margin to spare."""
    sizes = [size for size, _ in findings.measured]
    high = search.bracket.high
    spare, rule = settings.margin, f"model {model}"
    if (1 - spare) * min(largest, high - scale) > settings.far * max(sizes) and spare < settings.far_margin:
        # far above every measurement a small error of the slope is a large one of the size: land
        # with the wider margin, and measure there before closing in
        spare = settings.far_margin
        rule = f"{rule} (far above the sizes measured: {spare:.0%} to spare first)"
    items = (1 - spare) * min(largest, high - scale)
    alone = max(sizes) < 1.1 * min(sizes) and not findings.trust.probed and not doubting
    same_rows = settings.rows(items, scale) == settings.rows(sizes[-1], scale)
    if alone and (same_rows or abs(items - sizes[-1]) < 0.1 * sizes[-1]):
        # one size says nothing of the fixed part: measure another, once (one row more where no fewer is left)
        probe = _learning_size(sizes[-1], largest, scale, settings)
        if probe is not None:
            return Choice(probe, f"another size, to learn how the need grows beside model {model}", probe=True)
    for size in findings.evidence.halving_below(high, scale):
        if size <= items:
            break
        # halving would end there, and the model says it fits with half the margin to spare (a size
        # at the very edge of what it predicts fails as often as not)
        if size <= search.upper and size <= (1 - spare / 2) * largest:
            return Choice(size, f"halving's size, which model {model} predicts to fit")
    return Choice(items, rule)


def _learning_size(measured: float, largest: float, scale: float, settings: FitSettings) -> Optional[float]:
    """The size that measures the slope beside the one size measured: `learn` of it, or where that runs the
    same rows, one row more where the model says it fits (None: neither)."""
    smaller = settings.learn * measured
    if settings.rows(smaller, scale) < settings.rows(measured, scale):
        return smaller
    larger = (settings.rows(measured, scale) + 1) * scale
    return larger if larger <= largest else None


def _step_up(
    evidence: Evidence, items: float, rule: str, budget: float, scale: float, search: _Search, settings: FitSettings
) -> Tuple[float, str]:
    """Where one more error would leave halving no size above the largest fit: from a model found wrong (or
    none), grow by the margin's share, so that the search ends within it."""
    low = search.bracket.low
    if evidence.ceiling_if_failed(items, budget, scale) > low:
        return items, rule
    step = max(low / (1 - max(settings.margin, settings.least_step)), low + scale)
    if step < search.halving <= items:  # halving's own size costs no error halving would not pay
        step = search.halving
    if step < items:
        return step, f"{rule}, a step: one more error ends the search"
    return items, rule


def at_start(
    findings: Findings,
    remembered: Optional[float],
    budget: float,
    scale: float,
    asked: int,
    settings: FitSettings,
) -> Decision:
    """A call's first size under `budget`, for rows of `scale` items, never above `asked`: the size kept where
    `remembered` (the budget the size file's size was found with) is about `budget`, else the one chosen."""
    margin = settings.margin
    if remembered is not None and remembered * (1 - margin / 2) <= budget <= remembered * (1 + margin):
        return Decision(None)
    choice = choose(findings, budget, scale, settings)
    why = f"predicted for {format_bytes(budget)} free and {scale:g} items per row: {choice.rule}"
    return Decision(min(asked, settings.rows(choice.items, scale)), why, choice.probe)


def after_fit(findings: Findings, current: int, budget: float, scale: float, settings: FitSettings) -> Decision:
    """After a measured attempt at the call site's size (`current` rows) fit: the size to move to, or None
    where the change would be noise (a size that creeps is worse than none)."""
    choice = choose(findings, budget, scale, settings)
    best = settings.rows(choice.items, scale)
    settled = abs(best - current) <= settings.noise * current
    return Decision(None if settled else best, choice.rule, choice.probe)


def after_failure(
    findings: Findings, failed: int, bound: float, budget: float, scale: float, settings: FitSettings
) -> Decision:
    """After `failed` rows ran out of memory under `budget`, needing at least `bound` bytes (the failure is in
    `findings`): the size to retry at, below `failed`, or None where nothing is left below it."""
    choice = choose(findings, budget, scale, settings)
    chosen = max(settings.minimum, min(failed - 1, settings.rows(choice.items, scale)))
    why = f"needed >= {format_bytes(bound)} of {format_bytes(budget)}; {choice.rule}"
    return Decision(chosen if chosen < failed else None, why, choice.probe)
