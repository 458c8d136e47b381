"""Activation offload as a memory lever: the model's forward pass runs under saved-tensor hooks that do what
`torch.autograd.graph.save_on_cpu(pin_memory=True)` does, so every tensor autograd saves for the backward pass waits
in pinned host memory instead of on the GPU and is copied back when the backward pass needs it (the parameters
stay where they are). Only on CUDA: offloading CPU tensors to the CPU saves nothing. It composes with activation
checkpointing: the blocks' inputs, all that checkpointing saves, go to the host."""

import functools
import itertools
from typing import Any, Callable, Optional, Sequence, Set, Tuple

import torch

from toma.levers.lever import LeverDoesNotApply, MemoryLever, Removal

__all__ = ["ActivationOffload"]

_OFFLOADED = "_toma_offloaded"  # marks a model's forward that this lever set (holds the instance's own, or None)


def _offloaded(forward: Callable[..., Any], model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`forward` with what it saves for the backward pass in pinned host memory where gradients are taken; as it
    is elsewhere. Packing happens as the forward pass saves, and each saved tensor keeps its own unpack hook, so the
    context need only cover the forward pass."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    with _to_host(model):
        return forward(*args, **kwargs)


def _to_host(model: torch.nn.Module) -> torch.autograd.graph.saved_tensors_hooks:
    """`torch.autograd.graph.save_on_cpu(pin_memory=True)`, less one waste: a saved tensor that shares a parameter's
    storage (a weight, or a view of it, saved by a matmul) stays where it is, as a reference: it is on the GPU for
    the whole step anyway, and a copy of it per micro-batch would cost host memory and transfers for nothing."""
    held = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    pinnable = torch.cuda.is_available()

    def pack(tensor: torch.Tensor) -> Tuple[Optional[torch.device], torch.Tensor]:
        if type(tensor) is not torch.Tensor or tensor.is_sparse or tensor.untyped_storage().data_ptr() in held:
            return None, tensor
        packed = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pinnable)
        packed.copy_(tensor, non_blocking=pinnable)
        return tensor.device, packed

    def unpack(packed: Tuple[Optional[torch.device], torch.Tensor]) -> torch.Tensor:
        device, tensor = packed
        return tensor if device is None else tensor.to(device, non_blocking=pinnable)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _device_types(model: torch.nn.Module) -> Set[str]:
    """The device types of the model's parameters and buffers (a model may keep some on the host, such as a
    `toma.HostedEmbedding`'s table, and compute on the GPU)."""
    return {tensor.device.type for tensor in itertools.chain(model.parameters(), model.buffers())}


class ActivationOffload(MemoryLever):
    """Keeps the tensors saved for the backward pass in pinned host memory while the forward pass runs on."""

    name = "activation offload"
    cost = (
        "a copy of every saved activation to pinned host memory and back in the backward pass (cheap beside the "
        "compute on long sequences, large on short ones)"
    )
    devices: Tuple[str, ...] = ("cuda",)  # the device types it applies on (tests add "cpu" to check exactness)

    def __init__(self, devices: Optional[Sequence[str]] = None) -> None:
        if devices is not None:
            self.devices = tuple(devices)

    def applies_to(self, model: torch.nn.Module) -> bool:
        on = _device_types(model).intersection(self.devices)
        pinnable = torch.cuda.is_available() or "cuda" not in on  # host copies of CUDA tensors are page-locked
        # parameters of a tensor subclass (FSDP2's and tensor parallelism's DTensors) hold no storage of their own to
        # keep in place, and their saved activations are not plain tensors to copy: not offloaded
        plain = all(type(parameter.data) is torch.Tensor for parameter in model.parameters())
        return bool(on) and pinnable and plain and _OFFLOADED not in vars(model)

    def apply(self, model: torch.nn.Module) -> Removal:
        if not self.applies_to(model):
            raise LeverDoesNotApply(
                f"{self.name} does not apply to {type(model).__name__} (not on {self.devices}, or on)"
            )
        own = vars(model).get("forward")  # an instance's own forward, put back on removal
        forward = own if own is not None else type(model).forward.__get__(model)
        model.forward = functools.partial(_offloaded, forward, model)
        vars(model)[_OFFLOADED] = own
        return functools.partial(_remove, model)


def _remove(model: torch.nn.Module) -> None:
    own = vars(model).pop(_OFFLOADED, None)
    if own is None:
        vars(model).pop("forward", None)
    else:
        model.forward = own
