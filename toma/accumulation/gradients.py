"""Keeping the gradients a call started with apart from the ones an attempt adds, so a failed attempt
(an out-of-memory error half-way through a backward pass) can be dropped exactly.

Moving the existing `.grad` tensors aside costs no copy: the attempt accumulates into fresh gradients,
and only when it succeeds are they added to the ones set aside (in place, so each parameter keeps the
very tensor object it had). When every gradient starts as None, as after `optimizer.zero_grad()`,
there is nothing to set aside and nothing to add.

Gradients whose memory someone else writes while they are set aside (DistributedDataParallel with
`gradient_as_bucket_view=True` copies the reduced gradients into the very memory the old `.grad` views)
need their values copied instead: `GradientStash(params, copy=True)`.
"""

import functools
import operator
from typing import List, Optional, Sequence

import torch

from toma.accumulation.rollback import Rollback

__all__ = ["GradientStash"]

_GRAD = operator.attrgetter("grad")
_SOMETHING = functools.partial(operator.is_not, None)


class GradientStash(Rollback):
    """`with GradientStash(params):` runs an attempt whose gradients count only if it finishes.

    On an exception (any, KeyboardInterrupt included) every parameter's `.grad` is exactly what it was
    on entry: None stays None, an existing tensor is the same object with the same values. As a `Rollback`:
    `begin()` sets the gradients aside, `undo()` drops the attempt's, `keep()` adds them to those set aside.
    """

    __slots__ = ("params", "copy", "saved", "values")

    def __init__(self, params: Sequence[torch.Tensor], copy: bool = False) -> None:
        self.params, self.copy = params, copy
        self.saved: Optional[List[Optional[torch.Tensor]]] = None
        self.values: Optional[List[Optional[torch.Tensor]]] = None

    def __enter__(self) -> "GradientStash":
        self.begin()
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        if exc_type is None:
            self.keep()
        else:
            self.undo()

    def begin(self) -> None:
        saved = list(map(_GRAD, self.params))
        if any(map(_SOMETHING, saved)):
            self.saved = saved
            if self.copy:
                self.values = [None if grad is None else grad.detach().clone() for grad in saved]
            for p in self.params:
                p.grad = None
        else:
            self.saved = None

    def undo(self) -> None:
        self._end(failed=True)

    def keep(self) -> None:
        self._end(failed=False)

    def _end(self, failed: bool) -> None:
        saved, values = self.saved, self.values
        self.saved = self.values = None
        if saved is None:
            if failed:
                for p in self.params:
                    p.grad = None
            return
        for i, (p, old) in enumerate(zip(self.params, saved, strict=True)):
            new = None if failed else p.grad
            if old is None:
                p.grad = new
            elif values is None:  # set aside untouched: add the attempt's gradient to it
                if new is not None:
                    old.add_(new)
                p.grad = old
            elif new is None:  # old's memory may have been written meanwhile: put its values back
                p.grad = old.copy_(values[i])  # type: ignore[arg-type]
            else:
                p.grad = new.add_(values[i])  # type: ignore[arg-type]
