"""The options of an accumulation, checked once where the user's arguments enter and passed unchanged after:
`AccumulationSettings`, what a user chooses (every entry builds it with the same checks: the decorator, the plain
call, the Trainer, `TomaTrainer`'s `toma_*` keywords, `MicroBatching`), and `AccumulationOptions`, those settings
with the model and what a framework adds per batch (a backward, a rollback, a name)."""

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Union

import torch

from toma.accumulation.plan import NothingCounted, nothing_counted
from toma.accumulation.rollback import Rollback
from toma.accumulation.sharded_models import is_fsdp2
from toma.accumulation.sync import GRADIENT_SYNCS, GradientSync
from toma.batching.groups import Groups, check_groups
from toma.batching.logical import check_packing
from toma.batching.tokens import Lengths, check_lengths
from toma.core.arguments import check_size

__all__ = [
    "AccumulationSettings",
    "AccumulationOptions",
    "SettingAttribute",
    "NothingCounted",
    "REDUCTIONS",
    "check_flag",
    "check_gradient_sync",
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
    if not is_fsdp2(model) and any(is_fsdp2(module) for module in model.modules()):
        raise ValueError(
            f"{name}: parts of this model are FSDP2 units (fully_shard) but not the model itself; call fully_shard "
            "on the root module too (as FSDP2 expects) and pass that"
        )
    return model


def check_gradient_sync(gradient_sync: Any, name: str, model: Optional[torch.nn.Module] = None) -> str:
    """`gradient_sync=`: when an FSDP2 model's gradients are reduce-scattered (see `toma.accumulation.sync`);
    `model`: the model it is for, where known."""
    if gradient_sync not in GRADIENT_SYNCS:
        raise ValueError(
            f"{name} must be one of 'auto', 'logical_batch', 'micro_batch', 'sharded' ('logical_batch': the FSDP2 "
            "units unsharded for the logical batch, its gradients reduced once; 'micro_batch': reduce-scattered after "
            "every micro-batch; 'sharded': the parameters left sharded, FSDP2's own schedule, each collective agreed "
            f"on; 'auto': each in turn where memory runs short), got {gradient_sync!r}"
        )
    if gradient_sync in ("micro_batch", "sharded") and model is not None and not is_fsdp2(model):
        raise ValueError(
            f"{name}={gradient_sync!r} is for an FSDP2 model's gradients; this model is not an FSDP2 module "
            "(fully_shard): leave it out"
        )
    return str(gradient_sync)


def check_flag(value: Any, name: str) -> bool:
    """An option that is True or False (not a truthy stand-in)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


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


@dataclass(frozen=True, kw_only=True)
class AccumulationSettings:
    """What a user chooses for an accumulation, before a model is known: `reduction`, `weight`, `scaler`, `lengths`
    (and `initial_tokens`), `gradient_sync`, `groups`, `split_for_padding`, as `toma.accumulate` documents them.
    Built by `checked` where the user's arguments enter; `for_model` makes the options of a run from it."""

    reduction: str = "mean"
    weight: Optional[Callable[..., Any]] = None
    scaler: Any = None
    lengths: Optional[Lengths] = None
    initial_tokens: Optional[int] = None
    gradient_sync: str = "auto"
    groups: Optional[Groups] = None
    split_for_padding: bool = True
    levers: bool = True

    @classmethod
    def checked(
        cls,
        *,
        prefix: str = "",
        reduction: Any = "mean",
        weight: Any = None,
        scaler: Any = None,
        lengths: Any = None,
        initial_tokens: Any = None,
        gradient_sync: Any = "auto",
        groups: Any = None,
        split_for_padding: Any = True,
        levers: Any = True,
    ) -> "AccumulationSettings":
        """The settings, each checked with an error naming the argument as the user wrote it (`prefix` + its name:
        `toma_` for `explicit.accumulate` and `TomaTrainer`)."""
        checked_reduction = check_reduction(reduction, f"{prefix}reduction")
        checked_lengths = check_lengths(lengths, f"{prefix}lengths")
        tokens = None
        if initial_tokens is not None:
            tokens = check_size(initial_tokens, f"{prefix}initial_tokens")
            if checked_lengths is None:
                raise ValueError(f"{prefix}initial_tokens is a token budget: it needs {prefix}lengths= as well")
        checked_groups = check_groups(groups, f"{prefix}groups")
        check_packing(checked_lengths, checked_groups, prefix)
        return cls(
            reduction=checked_reduction,
            weight=check_weight(weight, f"{prefix}weight", checked_reduction),
            scaler=check_scaler(scaler, f"{prefix}scaler"),
            lengths=checked_lengths,
            initial_tokens=tokens,
            gradient_sync=check_gradient_sync(gradient_sync, f"{prefix}gradient_sync"),
            groups=checked_groups,
            split_for_padding=check_flag(split_for_padding, f"{prefix}split_for_padding"),
            levers=check_flag(levers, f"{prefix}levers"),
        )

    def for_model(self, model: torch.nn.Module, **framework: Any) -> "AccumulationOptions":
        """The options of runs on `model` (a user's, checked by `AccumulationOptions.checked`; or a framework's own
        wrapper); `framework`: `AccumulationOptions`' fields a framework sets (`backward`, `name`, `rollback`, ...)
        or changes per batch."""
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return AccumulationOptions(model=model, **{"check_split": self.groups is None, **fields, **framework})


class SettingAttribute:
    """An integration's attribute for one field of its `AccumulationSettings` (held in `holder`): reads it, and on
    assignment checks the value as the constructor does (named `prefix` + field) and replaces the settings."""

    def __init__(self, holder: str, field: str, prefix: str = "") -> None:
        self.holder, self.field, self.prefix = holder, field, prefix

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        return self if instance is None else getattr(getattr(instance, self.holder), self.field)

    def __set__(self, instance: Any, value: Any) -> None:
        settings = getattr(instance, self.holder)
        fields = {field.name: getattr(settings, field.name) for field in dataclasses.fields(settings)}
        fields[self.field] = value
        setattr(instance, self.holder, AccumulationSettings.checked(prefix=self.prefix, **fields))


@dataclass(frozen=True, kw_only=True)
class AccumulationOptions:
    """What an accumulation needs besides the loss function and the batch: a user's `AccumulationSettings` for a
    model (`AccumulationSettings.for_model`, or `checked` in one go); a change per step is a `dataclasses.replace`.
    For frameworks (`toma.integrations`): `backward(loss)` replaces `loss.backward()` (an accelerator's backward,
    which scales for mixed precision); `name`, what log lines call the function.
    `lengths` (each row's length: a mask's name or a function) makes the size a token budget
    (`toma.batching.tokens`; a padding-free batch's `position_ids`, `cu_seq_lens_*` or `seq_idx`: cut between its
    packed sequences, `toma.batching.packed`), starting at `initial_tokens` where given. `gradient_sync`: when an
    FSDP2 model's gradients are reduce-scattered ("auto", "logical_batch", "micro_batch": `toma.accumulation.sync`),
    or, from a framework, the `GradientSync` itself (how the gradients meet other ranks').
    `groups`: how rows belong together (`toma.batching.groups`; None: each on its own, checked once,
    `toma.accumulation.coupling`); `check_split`: before the first split of a batch, its loss is checked to be
    what its parts add up to (on unless `groups=` says how the rows belong together). `rollback`: a framework's own
    state that the loss function changes per call (a trainer's counters and metric lists), put back with a failed
    attempt. `split_for_padding`: with `lengths=`, a micro-batch that fits may be split where the padding saved is
    worth more than one more micro-batch costs (measured); False keeps it whole (a batch that fits runs whole)."""

    model: torch.nn.Module
    reduction: str = "mean"
    weight: Optional[Callable[..., Any]] = None
    scaler: Any = None
    backward: Optional[Callable[[torch.Tensor], Any]] = None
    name: Optional[str] = None
    lengths: Optional[Lengths] = None
    initial_tokens: Optional[int] = None
    gradient_sync: Union[str, GradientSync] = "auto"
    groups: Optional[Groups] = None
    check_split: bool = True
    rollback: Optional[Rollback] = None
    split_for_padding: bool = True
    levers: bool = True

    def as_kwargs(self) -> Dict[str, Any]:
        """The options as `toma.accumulate`'s keywords."""
        kwargs = dict(model=self.model, reduction=self.reduction, weight=self.weight, scaler=self.scaler)
        if self.lengths is not None:
            kwargs.update(lengths=self.lengths, initial_tokens=self.initial_tokens)
        if isinstance(self.gradient_sync, str) and self.gradient_sync != "auto":
            kwargs.update(gradient_sync=self.gradient_sync)
        if self.groups is not None:
            kwargs.update(groups=self.groups)
        if not self.split_for_padding:
            kwargs.update(split_for_padding=False)
        if not self.levers:
            kwargs.update(levers=False)
        return kwargs

    @classmethod
    def checked(cls, model: Any, *, prefix: str = "", **settings: Any) -> "AccumulationOptions":
        """The options of a user's call on `model`: `settings` as `AccumulationSettings.checked` takes them."""
        checked_model = check_model(model, "model")
        checked = AccumulationSettings.checked(prefix=prefix, **settings)
        check_gradient_sync(checked.gradient_sync, f"{prefix}gradient_sync", checked_model)
        return checked.for_model(checked_model)
