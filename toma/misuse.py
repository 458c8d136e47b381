"""Detecting an accumulated function that changes parameters or gradients behind toma's back.

Calling `optimizer.step()`, `optimizer.zero_grad()` or `clip_grad_norm_` inside the function that computes
a micro-batch's loss silently breaks gradient accumulation (each micro-batch steps, or wipes the others'
gradients). Autograd's version counters show it at the cost of reading an int per parameter: a parameter
changed in place, or a gradient replaced, removed or changed in place more often than backward passes add
to it.
"""

from typing import List, Optional, Sequence

import torch

__all__ = ["AccumulationMisuse", "MisuseWatch"]


class AccumulationMisuse(RuntimeError):
    """The accumulated function changed parameters or gradients itself; the message says what to move out."""


def _names(params: Sequence[torch.Tensor], model: torch.nn.Module) -> List[str]:
    by_id = {id(p): name for name, p in model.named_parameters()}
    return [by_id.get(id(p), f"parameter {i}") for i, p in enumerate(params)]


class MisuseWatch:
    """Watches one attempt: `start()` before the first micro-batch, `first_done()` after its backward pass,
    `check(micro_batches)` after the last one. `check_grads` is off where someone else (DDP's reducer, which
    may swap gradients for views of its buckets) legitimately writes into the gradients."""

    __slots__ = ("params", "model", "check_grads", "param_versions", "grads", "grad_versions")

    def __init__(self, params: Sequence[torch.Tensor], model: torch.nn.Module, check_grads: bool) -> None:
        self.params, self.model, self.check_grads = params, model, check_grads
        self.param_versions: List[int] = []
        self.grads: List[Optional[torch.Tensor]] = []
        self.grad_versions: List[int] = []

    def start(self) -> None:
        self.param_versions = [p._version for p in self.params]
        self.grads = []

    def first_done(self) -> None:
        if not self.check_grads:
            return
        self.grads = [p.grad for p in self.params]
        self.grad_versions = [-1 if g is None else g._version for g in self.grads]

    def check(self, later_micro_batches: int) -> None:
        """Raise AccumulationMisuse if the attempt changed a parameter, or a gradient other than by the
        `later_micro_batches` backward passes after the first."""
        changed = [i for i, p in enumerate(self.params) if p._version != self.param_versions[i]]
        if changed:
            names = ", ".join(_names(self.params, self.model)[i] for i in changed[:3])
            raise AccumulationMisuse(
                f"toma: parameters changed while the accumulated function ran ({names}): calling "
                "optimizer.step() (or changing weights in place) inside it steps once per micro-batch. Call "
                "optimizer.step() after the accumulated call returns"
            )
        if not self.grads:
            return
        for i, (p, before) in enumerate(zip(self.params, self.grads, strict=True)):
            if before is None:
                continue
            grad = p.grad
            replaced = grad is not before
            rewritten = (
                not replaced
                and grad is not None
                and grad._version - self.grad_versions[i] > later_micro_batches
            )
            if replaced or rewritten:
                name = _names(self.params, self.model)[i]
                raise AccumulationMisuse(
                    f"toma: the gradient of {name} was {'replaced or removed' if replaced else 'changed'} while "
                    "the accumulated function ran: calling optimizer.zero_grad() (or clipping or otherwise "
                    "changing gradients) inside it drops the other micro-batches' gradients. Call "
                    "optimizer.zero_grad() before the accumulated call and clip after it"
                )
