"""Undoing what a failed attempt did besides gradients, so that its retry starts from the same state.

- `BufferStash`: the persistent buffers of modules in training mode (BatchNorm's running mean and variance
  and `num_batches_tracked`), which every forward pass updates: a retry must not count the failed forward
  passes again.
- `RandomState`: the random number generators (CPU and the accelerator devices in use), so that a retried
  attempt draws the same dropout masks as one that fit at the final size from the same seed
  (`torch.utils.checkpoint` keeps RNG state across recomputation the same way).
- `PendingState` / `PendingStash`: what a module keeps between its forward pass and an optimizer step other
  than gradients (the rows `HostedEmbedding` queued for its `step()`): a failed attempt's share is dropped.
"""

from typing import Any, Dict, Iterable, List, Optional, Protocol, Set, Tuple, runtime_checkable

import torch

from toma.memory.backends import DeviceBackend, accelerators_in_use, backend_for

__all__ = ["BufferStash", "RandomState", "PendingState", "PendingStash"]


@runtime_checkable
class PendingState(Protocol):
    """A module that keeps work for a later step besides `.grad` (a queue of looked-up rows, say). Any module
    of an accumulated model that implements these two methods is rolled back with the gradients."""

    def pending_mark(self) -> Any:
        """A mark of what is pending now (cheap: taken before every attempt)."""
        ...

    def pending_rewind(self, mark: Any) -> None:
        """Forget what was added since `mark`, as if the failed attempt had never run."""
        ...


_keeps_pending: Dict[type, bool] = {}  # per module class: a protocol check costs ~20 us, a dict look-up 50 ns


def _is_pending_state(module: torch.nn.Module) -> bool:
    kind = type(module)
    known = _keeps_pending.get(kind)
    if known is None:
        known = _keeps_pending[kind] = isinstance(module, PendingState)
    return known


class PendingStash:
    """The `PendingState` modules of `model`: marked before an attempt, rewound after it failed."""

    __slots__ = ("modules", "marks")

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules: List[PendingState] = [m for m in model.modules() if _is_pending_state(m)]  # type: ignore[misc]
        self.marks: List[Any] = []

    def save(self) -> None:
        self.marks = [module.pending_mark() for module in self.modules]

    def restore(self) -> None:
        for module, mark in zip(self.modules, self.marks, strict=True):
            module.pending_rewind(mark)


class BufferStash:
    """The persistent buffers of `model`'s modules in training mode (the state a forward pass updates:
    BatchNorm's statistics, an EMA, spectral norm's vectors), copied once per call and put back after a
    failed attempt. Non-persistent buffers are caches a module rebuilds (rotary tables, causal masks): they
    are neither copied nor touched, and neither is a buffer the attempt replaced by one of another shape."""

    __slots__ = ("slots", "saved")

    def __init__(self, model: torch.nn.Module) -> None:
        # (module, name, the tensor) for every buffer a forward pass may update
        self.slots: List[Tuple[torch.nn.Module, str, torch.Tensor]] = [
            (module, name, buffer)
            for module in model.modules()
            if module.training
            for name, buffer in module._buffers.items()
            if buffer is not None and name not in module._non_persistent_buffers_set
        ]
        self.saved: Optional[List[torch.Tensor]] = None

    def names(self) -> List[str]:
        return [name for _, name, _ in self.slots]

    def save(self) -> None:
        if not self.slots:
            self.saved = []
            return
        with torch.no_grad():
            self.saved = [buffer.detach().clone() for _, _, buffer in self.slots]

    def save_once(self) -> None:
        """Save unless saved already: an attempt whose save ran out of memory leaves it to the next one."""
        if self.saved is None:
            self.save()

    def restore(self) -> None:
        """Every saved buffer back to its value, in the same tensor object (also where the attempt assigned
        a new tensor of the same shape to the module's attribute)."""
        if self.saved is None:
            return
        with torch.no_grad():
            for (module, name, buffer), value in zip(self.slots, self.saved, strict=True):
                current = module._buffers.get(name)
                if current is not buffer and (current is None or current.shape != buffer.shape):
                    continue  # rebuilt or removed by the module: not a value to roll back
                buffer.copy_(value)
                module._buffers[name] = buffer


def _accelerator_devices(tensors: Iterable[torch.Tensor]) -> List[torch.device]:
    if not accelerators_in_use():  # a CPU-only process: nothing to look at
        return []
    devices: Set[torch.device] = {tensor.device for tensor in tensors}
    return sorted((device for device in devices if device.type not in ("cpu", "meta")), key=str)


class RandomState:
    """The CPU generator and those of the accelerator devices that `tensors` live on, captured at once."""

    __slots__ = ("cpu", "devices")

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self.cpu = torch.get_rng_state()
        self.devices: List[Tuple[DeviceBackend, torch.device, torch.Tensor]] = []
        for device in _accelerator_devices(tensors):
            backend = backend_for(device)
            state = backend.rng_state(device)
            if state is not None:
                self.devices.append((backend, device, state))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for backend, device, state in self.devices:
            backend.set_rng_state(state, device)
