"""What a Trainer's `loss_fn` averages over, read from the criterion itself, so that micro-batches are weighted by
what the loss is normalised by: `nn.CrossEntropyLoss` and `nn.NLLLoss` divide their mean by the targets they do not
ignore, each counted by its class weight; every other loss, and a criterion given as a plain function, by rows
(unless `weight=` says otherwise)."""

import dataclasses
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.nn.modules.loss import _Loss

from toma.accumulation.options import AccumulationOptions

__all__ = ["check_criterion", "criterion_weight", "for_criterion", "metric_weight", "TargetCount"]


# A criterion's own reduction, as the Trainer's `reduction=` calls it: KLDivLoss's "batchmean" is a mean over rows.
_AS_REDUCTION = {"mean": "mean", "sum": "sum", "batchmean": "mean"}


def check_criterion(loss_fn: Any, reduction: str) -> None:
    """A PyTorch criterion's own reduction must be the Trainer's: micro-batches of a sum weighted as a mean's (or
    the other way round) would give neither the sum's gradients nor the mean's."""
    own = getattr(loss_fn, "reduction", None) if isinstance(loss_fn, _Loss) else None
    if own is None or _AS_REDUCTION.get(own) == reduction:
        return
    if own not in _AS_REDUCTION:
        raise TypeError(
            f"loss_fn(model(inputs), targets) must return a scalar tensor (the batch's loss), but loss_fn "
            f"({type(loss_fn).__name__}) has reduction={own!r}"
        )
    raise ValueError(
        f"reduction={reduction!r}, but loss_fn ({type(loss_fn).__name__}) reduces by {own!r}: pass "
        f"reduction={_AS_REDUCTION[own]!r} to the Trainer, so that its micro-batches add up to the batch's loss"
    )


class TargetCount:
    """`weight=` for a class-index criterion: the targets it does not ignore, each counted by its class weight,
    the count its mean divides by (`by_class=False`: each counted once, what a metric such as accuracy averages
    over). Probabilities as targets are averaged over rows."""

    def __init__(self, criterion: Union[nn.CrossEntropyLoss, nn.NLLLoss], by_class: bool = True) -> None:
        self.criterion, self.by_class = criterion, by_class

    def __call__(self, inputs: Any, targets: Any) -> Any:
        if not isinstance(targets, torch.Tensor) or targets.is_floating_point():
            return len(targets)
        class_weight = self.criterion.weight if self.by_class else None
        if isinstance(class_weight, torch.Tensor):  # counted on its device: all micro-batches' counts in one sync
            targets = targets.to(class_weight.device)
        kept: torch.Tensor = targets != self.criterion.ignore_index
        if not isinstance(class_weight, torch.Tensor):
            return kept.sum()
        return class_weight[targets.masked_fill(~kept, 0)].mul(kept).sum()

    def __repr__(self) -> str:
        counted = "counts" if self.by_class else "does not ignore"
        return f"the targets {type(self.criterion).__name__} {counted}"


def criterion_weight(loss_fn: Any, reduction: str) -> Optional[Callable[..., Any]]:
    """The count `loss_fn`'s mean divides by, as a `weight=` function; None: rows."""
    if reduction == "mean" and isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return TargetCount(loss_fn)
    return None


def metric_weight(loss_fn: Any, weight: Optional[Callable[..., Any]]) -> Optional[Callable[..., Any]]:
    """What `evaluate`'s metrics are averaged over: `weight=`'s count, else the targets a class-index criterion
    does not ignore, each once (not by its class weight: accuracy counts every target alike); None: rows."""
    if weight is not None:
        return weight
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return TargetCount(loss_fn, by_class=False)
    return None


def for_criterion(options: AccumulationOptions, loss_fn: Any, weight_given: bool) -> AccumulationOptions:
    """A Trainer's options for `loss_fn(model(inputs), targets)`: the criterion's reduction checked; one of torch's
    criteria (`nn.CrossEntropyLoss`, `nn.MSELoss`, ...) gives each row its own loss (nothing to check before a
    split), any other function is checked like any loss (one that couples rows trains by gradient caching); without
    `weight=`, weighted by what its mean divides by."""
    check_criterion(loss_fn, options.reduction)
    if isinstance(loss_fn, _Loss):
        options = dataclasses.replace(options, check_split=False)
    if not weight_given:  # what the criterion's mean divides by (its targets), not rows
        options = dataclasses.replace(options, weight=criterion_weight(loss_fn, options.reduction))
    return options
