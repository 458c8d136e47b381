"""Detecting an accumulated function that steps the optimizer or changes gradients behind toma's back.

Calling `optimizer.step()`, `optimizer.zero_grad()` or `clip_grad_norm_` inside the function that computes
a micro-batch's loss silently breaks gradient accumulation (each micro-batch steps, or wipes the others'
gradients). Three cheap signals show it without flagging modules that legitimately write in place
(`Embedding(max_norm=...)` renormalises its weight in every forward pass; reentrant checkpointing adds to
a gradient several times per backward pass):
- an optimizer step on a watched parameter, seen by a global step pre-hook (it raises before the step);
- a gradient replaced, removed (`zero_grad()` sets them to None) or changed in place while the function
  ran, that is between two of toma's backward passes (the function computes a loss; toma runs backward).
"""

import functools
import operator
import threading
from types import TracebackType
from typing import Any, List, Optional, Sequence, Type

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["AccumulationMisuse", "MisuseWatch"]

_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")
_SOMETHING = functools.partial(operator.is_not, None)

_ZEROING = (
    "calling optimizer.zero_grad() (or clipping or otherwise changing gradients) inside it drops the other "
    "micro-batches' gradients. Call optimizer.zero_grad() before the accumulated call and clip after it"
)


class AccumulationMisuse(RuntimeError):
    """The accumulated function stepped or changed gradients itself; the message says what to move out."""


def _names(params: Sequence[torch.Tensor], model: torch.nn.Module) -> List[str]:
    by_id = {id(p): name for name, p in model.named_parameters()}
    return [by_id.get(id(p), f"parameter {i}") for i, p in enumerate(params)]


class MisuseWatch:
    """Watches one attempt, entered around its micro-batches: `loss_done()` after the function returned a
    micro-batch's loss, `backward_done()` after toma's backward pass of it. `check_grads` is off where
    someone else (DDP's reducer, which may swap gradients for views of its buckets) writes into them."""

    __slots__ = ("params", "model", "check_grads", "grads", "tracked", "versions", "handle", "thread")

    def __init__(self, params: Sequence[torch.Tensor], model: torch.nn.Module, check_grads: bool) -> None:
        self.params, self.model, self.check_grads = params, model, check_grads
        self.grads: List[Optional[torch.Tensor]] = []  # after the latest backward pass
        self.tracked: List[torch.Tensor] = []  # those of them that exist, and their versions
        self.versions: List[int] = []
        self.handle: Any = None
        self.thread = 0

    def __enter__(self) -> "MisuseWatch":
        self.grads, self.tracked, self.versions = [], [], []
        self.thread = threading.get_ident()
        self.handle = register_optimizer_step_pre_hook(self._before_step)
        return self

    def __exit__(
        self, kind: Optional[Type[BaseException]], error: Optional[BaseException], trace: Optional[TracebackType]
    ) -> None:
        self.handle.remove()
        # A failed attempt's gradients must not outlive it: the engine frees memory before the retry.
        self.grads, self.tracked, self.versions = [], [], []

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != self.thread:
            return  # another thread's training
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        names = [name for p, name in zip(self.params, _names(self.params, self.model)) if id(p) in stepped]
        if names:
            raise AccumulationMisuse(
                f"toma: optimizer.step() was called inside the accumulated function (it updates "
                f"{', '.join(names[:3])}): it would step once per micro-batch. Call optimizer.step() after the "
                "accumulated call returns"
            )

    def backward_done(self) -> None:
        """Remember the gradients after toma's backward pass, and their versions."""
        if self.check_grads:
            self.grads = grads = list(map(_GRAD, self.params))
            try:  # every parameter has a gradient: the usual case after a backward pass
                self.versions = list(map(_VERSION, grads))
                self.tracked = grads  # type: ignore[assignment]
            except AttributeError:  # some have none (None has no version)
                self.tracked = tracked = list(filter(_SOMETHING, grads))
                self.versions = list(map(_VERSION, tracked))

    def loss_done(self) -> None:
        """Raise AccumulationMisuse if the function, since the previous backward pass, replaced, removed or
        changed a gradient in place."""
        grads = self.grads
        if not grads:
            return  # before the attempt's first backward pass nothing of it can be lost
        if any(map(operator.is_not, map(_GRAD, self.params), grads)):
            self._raise(next(i for i, p in enumerate(self.params) if p.grad is not grads[i]), "replaced or removed")
        if list(map(_VERSION, self.tracked)) != self.versions:
            changed = next(g for g, v in zip(self.tracked, self.versions) if g._version != v)
            self._raise(next(i for i, g in enumerate(grads) if g is changed), "changed")

    def _raise(self, index: int, what: str) -> None:
        name = _names(self.params, self.model)[index]
        raise AccumulationMisuse(
            f"toma: the gradient of {name} was {what} while the accumulated function ran: {_ZEROING}"
        )
