"""Keeping the gradients a call started with apart from the ones an attempt adds, so a failed attempt
(an out-of-memory error half-way through a backward pass) can be dropped exactly.

Moving the existing `.grad` tensors aside costs no copy: the attempt accumulates into fresh gradients,
and only when it succeeds are they added to the ones set aside (in place, so each parameter keeps the
very tensor object it had). When every gradient starts as None, as after `optimizer.zero_grad()`,
there is nothing to set aside and nothing to add.
"""

from typing import List, Optional, Sequence

import torch

__all__ = ["GradientStash"]


class GradientStash:
    """`with GradientStash(params):` runs an attempt whose gradients count only if it finishes.

    On an exception (any, KeyboardInterrupt included) every parameter's `.grad` is exactly what it was
    on entry: None stays None, an existing tensor is the same object with the same values.
    """

    __slots__ = ("params", "saved")

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = params
        self.saved: Optional[List[Optional[torch.Tensor]]] = None

    def __enter__(self) -> "GradientStash":
        saved = [p.grad for p in self.params]
        if any(grad is not None for grad in saved):
            self.saved = saved
            for p in self.params:
                p.grad = None
        else:
            self.saved = None
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        saved = self.saved
        self.saved = None
        if exc_type is not None:
            for p, grad in zip(self.params, saved or [None] * len(self.params), strict=True):
                p.grad = grad
            return
        if saved is None:
            return
        for p, old in zip(self.params, saved, strict=True):
            if old is None:
                continue
            new = p.grad
            if new is not None:
                old.add_(new)
            p.grad = old
