"""A Trainer's arguments, checked where they enter (early, clear errors naming the argument), and the device it
trains on."""

__all__ = ["check_eval_data", "check_functions", "check_run", "place"]

from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from toma.training.data import known_length
from toma.training.progress import VERBOSITY


def check_functions(
    optimizer: torch.optim.Optimizer,
    loss_fn: Optional[Callable[..., torch.Tensor]],
    forward: Optional[Callable[[Any], Any]],
    targets: Optional[Callable[[Any], Any]],
) -> None:
    """Early, clear errors for a Trainer's optimizer and functions, each naming its argument."""
    if not (callable(getattr(optimizer, "step", None)) and callable(getattr(optimizer, "zero_grad", None))):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
    if forward is None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a criterion called as loss_fn(model(inputs), targets), got {loss_fn!r}")
    if forward is not None and not callable(forward):
        raise TypeError(f"forward must be a function batch -> loss, got {forward!r}")
    if targets is not None and not callable(targets):
        raise TypeError(f"targets must be a function batch -> the batch's targets (for metrics), got {targets!r}")


def check_run(verbose: int, callbacks: Iterable[object], train_data: Iterable[Any]) -> None:
    """Early, clear errors for what a Trainer's run shows and calls, and for training data known to be empty."""
    if not isinstance(verbose, int) or verbose not in VERBOSITY:  # 1.0 and "1" are not verbosities
        raise ValueError(f"verbose must be 0 (silent), 1 (a line per epoch) or 2 (a progress bar), got {verbose!r}")
    if not isinstance(callbacks, Iterable) or isinstance(callbacks, (str, bytes)) or _has_hooks(callbacks):
        raise TypeError(f"callbacks must be a list of toma.Callback objects, got {callbacks!r}")
    for callback in callbacks:
        if isinstance(callback, type):
            raise TypeError(f"callbacks must hold Callback objects, not classes: got {callback!r}; pass an instance")
        if not _has_hooks(callback):
            raise TypeError(f"callbacks must have on_step_end or on_epoch_end, got {callback!r}")
    if known_length(train_data) == 0:
        raise ValueError("train_data is empty: there is nothing to train on")


def _has_hooks(callback: object) -> bool:
    return any(callable(getattr(callback, hook, None)) for hook in ("on_step_end", "on_epoch_end"))


def check_eval_data(eval_data: Any, epochs: int) -> None:
    """`fit(eval_data=)`, checked before the first epoch trains: an iterable, not known to be empty, and not an
    iterator read only once when each of several epochs evaluates on it."""
    if eval_data is None:
        return
    if not isinstance(eval_data, Iterable):
        raise TypeError(
            f"eval_data must be an iterable of batches (a DataLoader, a list), got {type(eval_data).__name__}"
        )
    if known_length(eval_data) == 0:
        raise ValueError("eval_data is empty: there is nothing to evaluate")
    if epochs > 1 and isinstance(eval_data, Iterator):
        raise TypeError(
            "eval_data is an iterator that can be read only once, and each of the epochs evaluates on it; pass a "
            "DataLoader, a list, or another iterable that starts over"
        )


def place(model: torch.nn.Module, device: Any) -> torch.device:
    """The device a Trainer trains on: `device`, with the model moved there, or else where the model already is."""
    if device is not None:
        placed = torch.device(device)
        model.to(placed)
        return placed
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")
