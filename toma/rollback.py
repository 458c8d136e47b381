"""Undoing what a failed attempt did besides gradients, so that its retry starts from the same state.

- `BufferStash`: the buffers of modules in training mode (BatchNorm's running mean and variance and
  `num_batches_tracked`), which every forward pass updates: a retry must not count the failed forward
  passes again.
- `RandomState`: the random number generators (CPU and the accelerator devices in use), so that a retried
  attempt draws the same dropout masks as one that fit at the final size from the same seed
  (`torch.utils.checkpoint` keeps RNG state across recomputation the same way).
"""

from typing import Iterable, List, Optional, Set, Tuple

import torch

__all__ = ["BufferStash", "RandomState"]


class BufferStash:
    """The buffers of `model`'s modules that are in training mode, saved once per call (one fused copy per
    device and dtype into tensors kept between calls) and put back after a failed attempt."""

    __slots__ = ("slots", "saved")

    def __init__(self, model: torch.nn.Module) -> None:
        # (module, name, the tensor) for every buffer a forward pass may update in place
        self.slots: List[Tuple[torch.nn.Module, str, torch.Tensor]] = [
            (module, name, buffer)
            for module in model.modules()
            if module.training
            for name, buffer in module._buffers.items()
            if buffer is not None
        ]
        self.saved: Optional[List[torch.Tensor]] = None

    def save(self) -> None:
        if not self.slots:
            return
        with torch.no_grad():
            self.saved = [buffer.detach().clone() for _, _, buffer in self.slots]

    def restore(self) -> None:
        """Every buffer back to its saved value, in the same tensor object (also where the attempt assigned
        a new tensor to the module's attribute)."""
        if self.saved is None:
            return
        with torch.no_grad():
            for (module, name, buffer), value in zip(self.slots, self.saved, strict=True):
                buffer.copy_(value)
                if module._buffers.get(name) is not buffer:
                    module._buffers[name] = buffer


def _accelerator_in_use() -> bool:
    if torch.cuda.is_initialized():
        return True
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available() and xpu.is_initialized())


def _accelerator_devices(tensors: Iterable[torch.Tensor]) -> List[torch.device]:
    if not _accelerator_in_use():  # a CPU-only process: nothing to look at
        return []
    devices: Set[torch.device] = {tensor.device for tensor in tensors}
    return sorted((device for device in devices if device.type not in ("cpu", "meta")), key=str)


class RandomState:
    """The CPU generator and those of the accelerator devices that `tensors` live on, captured at once."""

    __slots__ = ("cpu", "devices")

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self.cpu = torch.get_rng_state()
        self.devices: List[Tuple[torch.device, torch.Tensor]] = []
        for device in _accelerator_devices(tensors):
            backend = getattr(torch, device.type, None)
            get_state = getattr(backend, "get_rng_state", None)
            if get_state is not None:
                self.devices.append((device, get_state(device)))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in self.devices:
            getattr(torch, device.type).set_rng_state(state, device)
