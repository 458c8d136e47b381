"""Before a loss function's first split of a logical batch trains anything: is the batch's loss what its parts add up
to?

toma's micro-batches give the full batch's gradients when the batch's loss is the weighted sum of its units'
(rows', groups', packed sequences') losses, weighted as toma weights them. A loss that relates rows to each
other (in-batch negatives, a contrastive or listwise loss, a statistic of the batch, a sort over it) is not, and
neither is a mean over something other than what `weight=` counts: split, either trains something else without a
word. So once per loss function (its code, where a form wraps it anew at each call), at the start of the first
attempt that splits a batch, toma runs the first micro-batch's units without gradients and with the model in eval
mode (no dropout draws), once together and once as two halves, and compares the first loss with the halves' losses
weighted as the micro-batches would be. A difference beyond rounding raises `CoupledRows` (again at every later
split: a refused loss is never trained split), which names the difference and the remedies; everything the
check changed (random state, a trainer's metric lists, modules' pending state) is rolled back with it.

It costs one extra forward pass over one micro-batch, without gradients, once per loss function (see
`benchmarks/split_check.py`). It is skipped where the rows' relation is declared (`groups=`). Where the micro-batch's
units run out of memory even without gradients, the attempt fails as any other and the next, smaller one is
checked; where micro-batches hold one unit and two do not fit, or the function fails without gradients or in eval
mode (a model that returns predictions there), a warning says the loss was not checked and the batch trains. With
several ranks each checks on its own: the passes of every gradient sync run no collective.
"""

import logging
import math
from typing import Any, Callable, List, Optional, Tuple

import torch

from toma.accumulation.chunk_speed import ChunkSpeed
from toma.core.oom import should_reduce_batch_size

__all__ = ["CoupledRows", "SplitCheck", "check_split_once", "tolerance"]

log = logging.getLogger("toma")

Arguments = Tuple[Tuple[Any, ...], dict]


class CoupledRows(ValueError):
    """A logical batch's loss is not the weighted sum of its parts' losses: split into micro-batches it would
    train something else. Raised before anything of the split batch trains."""


INCONCLUSIVE = 8  # checks whose parts all gave the same loss, after which the loss is taken as checked


class SplitCheck:
    """One loss function's check: done once it is conclusive (its outcome kept for the stats: the relative difference
    found). A check whose parts all gave the same loss (a loss that is constant at the start, as DPO's while the
    policy is its reference) says nothing, and the next split checks again, up to `INCONCLUSIVE` times. `coupled`:
    the loss was found coupling rows and trains by gradient caching (`toma.accumulation.gradient_cache`) from then
    on; `rows_checked`: the model was found treating rows independently there; `speed`: the micro-batch rows
    gradient caching settled on (`toma.accumulation.chunk_speed`)."""

    __slots__ = ("done", "difference", "inconclusive", "coupled", "rows_checked", "speed")

    def __init__(self) -> None:
        self.done = False
        self.difference: Optional[float] = None
        self.inconclusive = 0
        self.coupled = False
        self.rows_checked = False
        self.speed = ChunkSpeed()  # gradient caching's micro-batch rows, chosen by time per row

    def __repr__(self) -> str:
        state = "not yet" if not self.done else "skipped" if self.difference is None else f"{self.difference:.2g}"
        return f"SplitCheck({state}{', coupled: gradient caching' if self.coupled else ''})"

    def _key(self) -> Tuple[Any, ...]:
        return (self.done, self.difference, self.inconclusive, self.coupled, self.rows_checked)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SplitCheck):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # it changes once checked


def tolerance(model: torch.nn.Module) -> float:
    """The relative difference rounding may make between a batch's loss and its halves': fp32 sums in another
    order (about 1e-6), bf16/fp16 compute (autocast or half parameters) far more."""
    low = torch.is_autocast_enabled() or any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters())
    return 2e-2 if low else 1e-3


class _NoLoss(Exception):
    """The function returned no scalar loss: the training pass says so in its own words."""


def _loss(func: Callable[..., Any], arguments: Arguments) -> float:
    args, kwargs = arguments
    value = func(*args, **kwargs)
    # Without gradients nothing the model computes requires grad: a loss that does is a stand-in (a framework's
    # zero for a step that returned no loss), not one to compare.
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.requires_grad:
        raise _NoLoss
    return float(value.detach().float().reshape(()))


def _needs_gradients(error: BaseException) -> bool:
    """The error of a function that runs a backward pass itself, which the check's no-gradient passes cannot."""
    return isinstance(error, RuntimeError) and "does not require grad" in str(error)


class _EvalMode:
    """The model's modules in eval mode (no dropout draws), each put back as it was."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.modes: List[Tuple[torch.nn.Module, bool]] = []

    def __enter__(self) -> None:
        self.modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()

    def __exit__(self, *exc: Any) -> None:
        for module, training in self.modes:
            module.training = training


def check_split_once(
    check: SplitCheck,
    func: Callable[..., Any],
    model: torch.nn.Module,
    piece: Any,
    start: int,
    stop: int,
    width: Optional[int],
    arguments_of: Callable[[Any, int, int, Optional[int]], Arguments],
    unit_weight: Callable[[Any, int, int, Arguments], Optional[float]],
    summed: bool,
    name: str,
    cut_loss: Optional[Callable[[Arguments], Any]] = None,
) -> None:
    """Compare the loss of units `[start, stop)` of `piece` with its two halves' (`arguments_of(piece, a, b,
    width)`: a part's arguments where the micro-batches' are, on the model's device; `unit_weight(piece, a, b,
    arguments)`: what a part's loss averages over, None where it counts nothing; `summed`: the losses add up as
    they are). Raises `CoupledRows` where they differ; marks `check` done either way. `cut_loss(arguments)`: the
    loss of a part with the model's calls cut into single rows (gradient caching's first pass), for two units that
    do not fit together even without gradients."""
    extended = stop - start < 2  # micro-batches of one unit: the check takes two, which may not fit
    if extended:
        stop = min(piece.unit_count, start + 2)
        if stop - start < 2:
            return  # one unit in this piece: there is nothing to compare it with
    middle = (start + stop) // 2
    parts = [(start, stop), (start, middle), (middle, stop)]
    try:
        losses, weights = _part_losses(func, model, piece, parts, width, arguments_of, unit_weight)
    except _NoLoss:
        return  # the training pass refuses it in its own words
    except Exception as error:
        if not _cannot_check(error, extended):
            raise  # the attempt fails as any other (smaller is checked), or the user's error, untouched
        found = _with_calls_cut(error, extended, cut_loss, func, model, piece, parts, width, arguments_of, unit_weight)
        if found is None:
            check.done = True
            _warn_unchecked(name, stop - start, piece.unit_name, error)
            return
        losses, weights = found
    whole, first, second = losses
    parts_sum = _parts_sum(first, second, weights, summed)
    if parts_sum is None:
        return  # a half counts nothing: the comparison says nothing; the next split is checked
    # where the halves add up as the other reduction adds them, the loss is a sum given as a mean, or the other way
    other = _parts_sum(first, second, weights, not summed)
    other_reduction = other is not None and _relative_difference(whole, other) <= tolerance(model)
    _judge(
        check, model, name, (stop - start, piece.unit_name), whole, first, second, parts_sum, summed, other_reduction
    )


def _part_losses(
    func: Callable[..., Any],
    model: torch.nn.Module,
    piece: Any,
    parts: List[Tuple[int, int]],
    width: Optional[int],
    arguments_of: Callable[[Any, int, int, Optional[int]], Arguments],
    unit_weight: Callable[[Any, int, int, Arguments], Optional[float]],
) -> Tuple[List[float], List[Optional[float]]]:
    """The losses of `parts` (the whole first, then its halves) without gradients and in eval mode, and what each
    half's loss averages over."""
    with torch.no_grad(), _EvalMode(model):
        arguments = [arguments_of(piece, a, b, width) for a, b in parts]
        losses = [_loss(func, args) for args in arguments]
        weights = [unit_weight(piece, a, b, args) for (a, b), args in zip(parts[1:], arguments[1:])]
    return losses, weights


def _with_calls_cut(
    error: Exception,
    extended: bool,
    cut_loss: Optional[Callable[[Arguments], Any]],
    func: Callable[..., Any],
    model: torch.nn.Module,
    piece: Any,
    parts: List[Tuple[int, int]],
    width: Optional[int],
    arguments_of: Callable[[Any, int, int, Optional[int]], Arguments],
    unit_weight: Callable[[Any, int, int, Arguments], Optional[float]],
) -> Optional[Tuple[List[float], List[Optional[float]]]]:
    """Where two units do not fit together even without gradients: the whole's loss with the model's calls cut into
    single rows (`cut_loss`), each half's as it is; None where that cannot run either (then the check warns)."""
    if cut_loss is None or not extended or not should_reduce_batch_size(error):
        return None
    del error  # its traceback holds the failed pass's memory
    try:
        with torch.no_grad(), _EvalMode(model):
            arguments = [arguments_of(piece, a, b, width) for a, b in parts]
            whole = cut_loss(arguments[0])
            if not isinstance(whole, torch.Tensor) or whole.numel() != 1:
                return None
            losses = [float(whole.detach().float().reshape(())), *(_loss(func, args) for args in arguments[1:])]
            weights = [unit_weight(piece, a, b, args) for (a, b), args in zip(parts[1:], arguments[1:])]
    except (_NoLoss, CoupledRows):
        return None  # a loss that never calls the model: nothing to cut
    except Exception as cut_error:
        if should_reduce_batch_size(cut_error):
            return None
        raise
    return losses, weights


def _cannot_check(error: Exception, extended: bool) -> bool:
    """Whether `error` means the check cannot run here (then it warns and counts as done): the two units of an
    extended check do not fit, or the function fails without gradients or in eval mode (it runs a backward pass
    itself, or its model returns something else in eval mode, as detection models do). The training pass then
    runs as it would have: an error of the function's own is raised there, untouched. Only a micro-batch whose
    units do not fit even without gradients fails the attempt, and the next, smaller one is checked."""
    return not should_reduce_batch_size(error) or extended


def _warn_unchecked(name: str, units: int, unit_name: str, error: Exception) -> None:
    """Say that the loss was not checked, and why, and how to declare the rows independent."""
    if should_reduce_batch_size(error):
        why = "ran out of memory"
    elif _needs_gradients(error):
        why = "need gradients"
    else:
        why = f"raised {error!r}"
    log.warning(
        "toma: %s: could not check that its loss is what its parts add up to (%d %s %s without gradients, in "
        "eval mode); it trains split as if they were independent. If they are, pass groups='rows' to say so",
        name,
        units,
        unit_name,
        why,
    )


def _parts_sum(first: float, second: float, weights: List[Optional[float]], summed: bool) -> Optional[float]:
    """The halves' losses as the micro-batches would add them up; None where a half counts nothing."""
    if summed:
        return first + second
    if any(w is None for w in weights) or sum(weights) <= 0:  # type: ignore[arg-type]
        return None
    total = float(sum(weights))  # type: ignore[arg-type]
    return (weights[0] * first + weights[1] * second) / total  # type: ignore[operator]


def _relative_difference(a: float, b: float) -> float:
    scale = abs(a) + abs(b)
    return abs(a - b) / scale if scale > 0 else 0.0


def _judge(
    check: SplitCheck,
    model: torch.nn.Module,
    name: str,
    units: Tuple[int, str],
    whole: float,
    first: float,
    second: float,
    parts_sum: float,
    summed: bool,
    other_reduction: bool,
) -> None:
    """Record the relative difference between the whole's loss and its halves' sum on `check`: inconclusive where
    the halves gave the same loss, done otherwise; `CoupledRows` where it is beyond rounding (`other_reduction`:
    naming `reduction=` as the remedy)."""
    difference = _relative_difference(whole, parts_sum)
    allowed = tolerance(model)
    spread = _relative_difference(first, second)
    check.difference = difference
    if not math.isnan(difference) and difference <= allowed and spread <= allowed / 100:
        # the parts gave the same loss to the rounding (DPO's, while the policy is its reference, is log 2 for any
        # part): that says nothing about how they relate. Merely close losses (a fresh model's) do say
        check.inconclusive += 1
        check.done = check.inconclusive >= INCONCLUSIVE
        log.debug("toma: %s: its parts gave the same loss; the next split checks again", name)
        return
    if math.isnan(difference) or difference > allowed:
        # not done: a caller that catches the error and calls again is refused again, never trained split
        raise _coupled_rows(name, units, whole, parts_sum, summed, difference, other_reduction)
    check.done = True
    log.info(
        "toma: %s: its loss is what its parts add up to (checked once: relative difference %.2g)", name, difference
    )


def _coupled_rows(
    name: str,
    units: Tuple[int, str],
    whole: float,
    parts_sum: float,
    summed: bool,
    difference: float,
    other_reduction: bool,
) -> CoupledRows:
    """The error that names the difference found and the remedies (`other_reduction`: the halves add up as the
    other `reduction=` adds them, which is then the remedy)."""
    given, other = ("sum", "mean") if summed else ("mean", "sum")
    cause = (
        f"The halves' losses do add up to the whole's as reduction={other!r} adds them: the loss is a {other}, "
        f"not the {given} that reduction={given!r} says; pass reduction={other!r}. Otherwise, it"
        if other_reduction
        else "It"
    )
    error = CoupledRows(
        f"{name}: the loss of {units[0]} {units[1]} together is {whole:.6g}, but its two halves' losses "
        f"{'added' if summed else 'weighted by what each averages over'} give {parts_sum:.6g} (a relative "
        f"difference of {difference:.2g}): the loss is not what its parts add up to, so training it in "
        f"micro-batches would train something else. {cause} relates rows to each other (in-batch negatives, a "
        "contrastive or listwise loss, a batch statistic, a sort over the batch), or it averages over something "
        "weight= does not count. Say how the rows belong together with groups= ('pairs' for DPO's chosen and "
        "rejected rows, a function giving each row's group, 'batch' to never split a batch), give weight= what "
        "the loss averages over, or, if the difference is acceptable (a per-micro-batch auxiliary loss), pass "
        "groups='rows'. Checked before anything of a split batch trained; a refused loss is refused at every call"
    )
    error.other_reduction = other_reduction  # type: ignore[attr-defined]  # a setting to fix, not rows to cache
    return error
