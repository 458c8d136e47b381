"""What an accumulation tells the user: a loss that is not a scalar, a split that may have cut a tensor that
is not part of the batch, BatchNorm layers that see micro-batches instead of the logical batch."""

import logging
import re
import weakref
from typing import Any, Callable

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from toma.batching.splitting import ArgumentBatch
from toma.core.oom import add_note

__all__ = ["loss_error", "hint_whole", "warn_once_about_batchnorm"]

log = logging.getLogger("toma")


def loss_error(func: Callable[..., Any], loss: Any) -> TypeError:
    """The error for a function that returned `loss` where a micro-batch's loss, a scalar tensor, belongs."""
    what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)
    name = getattr(func, "__qualname__", repr(func))
    return TypeError(f"{name} must return the micro-batch's loss as a scalar tensor, got {what}")


def hint_whole(error: BaseException, piece: ArgumentBatch, rows: int) -> None:
    """An error that names the micro-batch's row count while the batch was split may come from a tensor
    that is not part of the batch but happened to have as many rows: say what was split."""
    if re.search(rf"(?<![\d.]){rows}(?![\d.])", str(error)) is None:
        return
    note = (
        f"toma: the logical batch of {piece.size} rows was split into micro-batches of {rows} along dim 0 of "
        f"every tensor with {piece.size} rows: {piece.describe()}. A tensor that is not part of the batch "
        "(class weights, say) goes to every micro-batch whole when wrapped in toma.whole(...)"
    )
    add_note(error, note)


_checked_for_batchnorm: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def warn_once_about_batchnorm(model: torch.nn.Module) -> None:
    """Warn, once per model, that BatchNorm layers in training mode see micro-batches' statistics."""
    if model in _checked_for_batchnorm:
        return
    _checked_for_batchnorm.add(model)
    names = [name for name, m in model.named_modules() if isinstance(m, _BatchNorm) and m.training]
    if names:
        log.warning(
            "%s has BatchNorm layers (%s) in training mode: with the logical batch split into "
            "micro-batches their statistics are those of each micro-batch, not of the full batch",
            type(model).__name__,
            ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""),
        )
