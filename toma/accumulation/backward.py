"""A micro-loss's backward pass as one function, chosen once per attempt: scaled by a GradScaler, run outside
autocast (PyTorch's advice: the forward's choice of dtypes already holds), through a framework's backward."""

import contextlib
from typing import Any, Callable, Optional, Tuple

import torch

__all__ = ["backward_pass", "enabled_autocast"]

Backward = Callable[[torch.Tensor], Any]

_AUTOCAST_DEVICE_TYPES = ("cuda", "cpu", "xpu", "mps", "hpu")


def enabled_autocast() -> Tuple[str, ...]:
    """The device types autocast is on for here, where the backward passes run."""
    if not torch._C._is_any_autocast_enabled():  # the usual case, in one call
        return ()
    return tuple(kind for kind in _AUTOCAST_DEVICE_TYPES if _autocast_enabled(kind))


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except (TypeError, RuntimeError):  # torch < 2.4 has no device argument; unknown device types
        return device_type == "cuda" and torch.is_autocast_enabled()


def _autocast_off(device_types: Tuple[str, ...]) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for kind in device_types:
        stack.enter_context(torch.autocast(kind, enabled=False))
    return stack


def backward_pass(backward: Optional[Backward], scaler: Any) -> Backward:
    """`backward(loss)` (None: `loss.backward()`) of the loss scaled by `scaler` (None: as it is), outside
    the autocast that is on now; the backward itself when there is nothing to add."""
    run: Backward = torch.Tensor.backward if backward is None else backward
    autocast = enabled_autocast()
    if scaler is None and not autocast:
        return run

    def scaled(loss: torch.Tensor) -> Any:
        if scaler is not None:
            loss = scaler.scale(loss)
        if not autocast:
            return run(loss)
        with _autocast_off(autocast):
            return run(loss)

    return scaled
