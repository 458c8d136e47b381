"""The options of an accumulation (model, reduction, weight, scaler), checked once where they enter: the
decorator, the plain call and the Trainer alike."""

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch

__all__ = [
    "AccumulationOptions",
    "NothingCounted",
    "REDUCTIONS",
    "check_model",
    "check_reduction",
    "check_scaler",
    "check_weight",
    "nothing_counted",
]

REDUCTIONS = ("mean", "sum")


def check_model(model: Any, name: str) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{name} must be the torch.nn.Module whose gradients are accumulated, got {model!r}")
    return model


def check_reduction(reduction: Any, name: str) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name} must be 'mean' or 'sum' (how the loss function reduces a batch), got {reduction!r}")
    return str(reduction)


def check_scaler(scaler: Any, name: str) -> Any:
    if scaler is not None and not callable(getattr(scaler, "scale", None)):
        raise TypeError(f"{name} must be a torch.amp.GradScaler (or None), got {scaler!r}")
    return scaler


def check_weight(weight: Any, name: str, reduction: str) -> Optional[Callable[..., Any]]:
    """`weight=`: None, or a function called like the loss function that returns how many items that
    micro-batch's mean loss averages over."""
    if weight is None:
        return None
    if not callable(weight):
        raise TypeError(
            f"{name} must be a function called with a micro-batch's arguments (like the loss function) that "
            f"returns how many items its loss averages over, e.g. label tokens; got {weight!r}"
        )
    if reduction != "mean":
        raise ValueError(
            f"{name} weights mean losses; with reduction={reduction!r} the micro-losses are added as they are, "
            "so leave it out"
        )
    checked: Callable[..., Any] = weight
    return checked


class NothingCounted(ValueError):
    """A logical batch whose `weight=` counts 0 items: its mean loss averages over nothing (in one full-batch pass
    it is NaN), so there is no gradient to weight. Raised before any forward pass on one process; with several, on
    every rank before the gradients' all-reduce when no rank counted anything. A framework whose step may skip such
    a batch (Lightning's `None`) catches it and runs the batch as the plain loop would."""


def nothing_counted(weight: Optional[Callable[..., Any]], rows: Optional[int] = None, ranks: int = 1) -> NothingCounted:
    """The error for a logical batch of `rows` rows (on each of `ranks` ranks) in which `weight` counted nothing."""
    name = "weight" if weight is None else f"weight ({getattr(weight, '__qualname__', repr(weight))})"
    where = "the logical batch" if rows is None else f"the logical batch of {rows} rows"
    if ranks > 1:
        where += f" on every one of the {ranks} ranks"
    return NothingCounted(
        f"{name} counted 0 items in {where}: its mean loss averages over nothing (in one full-batch pass it is "
        "NaN), so there is no gradient to weight. If the loss does average over something, weight must count it; "
        "a batch with nothing to learn from (every label padding) must be left out of the data"
    )


@dataclass(frozen=True)
class AccumulationOptions:
    """What an accumulation needs besides the loss function and the batch, checked."""

    model: torch.nn.Module
    reduction: str = "mean"
    weight: Optional[Callable[..., Any]] = None
    scaler: Any = None

    def as_kwargs(self) -> Dict[str, Any]:
        """The options as `toma.accumulate`'s keywords."""
        return dict(model=self.model, reduction=self.reduction, weight=self.weight, scaler=self.scaler)

    @classmethod
    def checked(
        cls, model: Any, reduction: Any = "mean", weight: Any = None, scaler: Any = None, prefix: str = ""
    ) -> "AccumulationOptions":
        """The options, each checked with an error naming the argument (`prefix` + its name)."""
        checked_model = check_model(model, "model")
        reduction = check_reduction(reduction, f"{prefix}reduction")
        checked_weight = check_weight(weight, f"{prefix}weight", reduction)
        return cls(checked_model, reduction, checked_weight, check_scaler(scaler, f"{prefix}scaler"))
