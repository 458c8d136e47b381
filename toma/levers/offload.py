"""Activation offload as a memory lever (CUDA): the tensors autograd saves for the backward pass are copied to
pinned host memory as the forward pass saves them and back as the backward pass needs them
(`torch.autograd.graph.save_on_cpu`). With checkpointing on too, what is saved outside the checkpointed blocks goes
to the host. On the CPU it would save nothing, so it applies only to a model on an accelerator."""

import functools
from typing import Any, Callable, Optional, Tuple

import torch
from torch.autograd.graph import save_on_cpu

from toma.levers.lever import MemoryLever, Removal

__all__ = ["ActivationOffload"]

_OFFLOADED = "_toma_offloaded"  # marks a model's forward that this lever set


def _offloaded(forward: Callable[..., Any], device_type: str, *args: Any, **kwargs: Any) -> Any:
    """`forward` with what it saves for the backward pass in pinned host memory, where gradients are taken."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    with save_on_cpu(pin_memory=device_type != "cpu", device_type=device_type):
        return forward(*args, **kwargs)


def _device_type(model: torch.nn.Module) -> str:
    """The device type the model computes on (its first parameter's or buffer's; "cpu" without either)."""
    first: Optional[torch.Tensor] = next(model.parameters(), None)
    if first is None:
        first = next(model.buffers(), None)
    return "cpu" if first is None else first.device.type


class ActivationOffload(MemoryLever):
    """Keeps the saved activations in host memory between the forward and the backward pass."""

    name = "activation offload"
    cost = (
        "a copy of every saved activation to pinned host memory and back (PCIe time: hidden behind compute on long "
        "sequences, large on short ones)"
    )

    def __init__(self, devices: Tuple[str, ...] = ("cuda",)) -> None:
        self.devices = devices  # the device types it applies on (tests name "cpu" to check its exactness there)

    def applies_to(self, model: torch.nn.Module) -> bool:
        return _OFFLOADED not in vars(model) and _device_type(model) in self.devices

    def apply(self, model: torch.nn.Module) -> Removal:
        if not self.applies_to(model):
            raise ValueError(f"{self.name} does not apply to {type(model).__name__} (not on {self.devices}, or on)")
        own = vars(model).get("forward")  # an instance's own forward, put back on removal
        forward = own if own is not None else type(model).forward.__get__(model)
        model.forward = functools.partial(_offloaded, forward, _device_type(model))
        vars(model)[_OFFLOADED] = own
        return functools.partial(_remove, model)


def _remove(model: torch.nn.Module) -> None:
    own = vars(model).pop(_OFFLOADED, None)
    if own is None:
        vars(model).pop("forward", None)
    else:
        model.forward = own
