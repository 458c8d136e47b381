"""Undoing what a failed attempt did, so that its retry starts from the same state: `Rollback`, the interface,
and the rollbacks besides gradients (those are `toma.accumulation.gradients.GradientStash`).

- `BufferStash`: the persistent buffers of the model's modules (BatchNorm's running mean and variance and
  `num_batches_tracked`), which every forward pass in training mode updates: a retry must not count the failed forward
  passes again.
- `RandomRollback` (over `RandomState`): the random number generators (CPU and the accelerator devices in use),
  so that a retried attempt draws the same dropout masks as one that fit at the final size from the same seed
  (`torch.utils.checkpoint` keeps RNG state across recomputation the same way).
- `PendingState` / `PendingStash`: what a module keeps between its forward pass and an optimizer step other
  than gradients (the rows `HostedEmbedding` queued for its `step()`): a failed attempt's share is dropped.
"""

from abc import ABC, abstractmethod
from typing import Any, Dict, Iterable, List, Optional, Protocol, Sequence, Set, Tuple, runtime_checkable

import torch

from toma.memory.backends import DeviceBackend, accelerators_in_use, backend_for

__all__ = [
    "Rollback",
    "Rollbacks",
    "BufferStash",
    "RandomState",
    "RandomRollback",
    "PendingState",
    "PendingStash",
    "is_pending_state",
]


class Rollback(ABC):
    """State an attempt changes that a failed attempt must leave as it found it.

    The accumulation step calls, for every attempt at the logical batch: `begin()` before it runs (an
    exception there is an attempt that failed before it changed anything), then exactly one of `undo()`, after
    it raised (any exception, KeyboardInterrupt included), or `keep()`, after it finished. A retry calls
    `begin()` again on the same object: what is saved once per call (buffers, random state) is saved by the
    first `begin()` and put back by `undo()` or the retry's `begin()`.
    """

    __slots__ = ()

    @abstractmethod
    def begin(self) -> None:
        """Before an attempt: save (or, on a retry, restore) what it may change."""

    @abstractmethod
    def undo(self) -> None:
        """After an attempt that raised: put back what it changed."""

    def keep(self) -> None:
        """After an attempt that finished: keep what it did (most rollbacks have nothing to do)."""


class Rollbacks(Rollback):
    """Several rollbacks as one: begun in order, undone in reverse; one whose `begin()` raised undoes those
    begun before it."""

    __slots__ = ("parts",)

    def __init__(self, parts: Sequence[Rollback]) -> None:
        self.parts = tuple(parts)

    def begin(self) -> None:
        for index, part in enumerate(self.parts):
            try:
                part.begin()
            except BaseException:
                for begun in reversed(self.parts[:index]):
                    begun.undo()
                raise

    def undo(self) -> None:
        for part in reversed(self.parts):
            part.undo()

    def keep(self) -> None:
        for part in self.parts:
            part.keep()


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


def is_pending_state(module: torch.nn.Module) -> bool:
    """Whether `module` implements `PendingState` (remembered per class)."""
    kind = type(module)
    known = _keeps_pending.get(kind)
    if known is None:
        known = _keeps_pending[kind] = isinstance(module, PendingState)
    return known


class PendingStash(Rollback):
    """The `PendingState` modules of `model` (or the `modules` given): marked before every attempt, rewound
    after one that failed."""

    __slots__ = ("modules", "marks")

    def __init__(self, model: Optional[torch.nn.Module] = None, modules: Sequence[PendingState] = ()) -> None:
        found: List[Any] = [m for m in model.modules() if is_pending_state(m)] if model is not None else []
        self.modules: List[PendingState] = found + list(modules)
        self.marks: List[Any] = []

    def save(self) -> None:
        self.marks = [module.pending_mark() for module in self.modules]

    def restore(self) -> None:
        for module, mark in zip(self.modules, self.marks, strict=True):
            module.pending_rewind(mark)

    begin, undo = save, restore


# (module, name, the tensor) for a buffer a forward pass may update
BufferSlot = Tuple[torch.nn.Module, str, torch.Tensor]


def buffer_slots(module: torch.nn.Module) -> List[BufferSlot]:
    """The persistent buffers of `module` itself (not its children), whatever its mode now: the function may
    call `model.train()` (after an evaluation left the model in eval mode) before its forward pass. None of a
    `PendingState` module: what its forward pass changes is its pending state (a `HostedEmbedding`'s table,
    a buffer of millions of rows, changes only in its own step)."""
    if not module._buffers or is_pending_state(module):
        return []
    skipped = module._non_persistent_buffers_set
    return [(module, name, b) for name, b in module._buffers.items() if b is not None and name not in skipped]


class BufferStash(Rollback):
    """The persistent buffers of `model`'s modules, in whatever mode (the state a forward pass updates:
    BatchNorm's statistics, an EMA, spectral norm's vectors), copied once per call and put back after a
    failed attempt. Non-persistent buffers are caches a module rebuilds (rotary tables, causal masks): they
    are neither copied nor touched, and neither is a buffer the attempt replaced by one of another shape."""

    __slots__ = ("slots", "saved")

    def __init__(self, model: Optional[torch.nn.Module] = None, slots: Sequence[BufferSlot] = ()) -> None:
        found = [slot for module in model.modules() for slot in buffer_slots(module)] if model is not None else []
        self.slots: List[BufferSlot] = found + list(slots)
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

    begin, undo = save_once, restore


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


class RandomRollback(Rollback):
    """The random state at a call's first attempt, put back at the start of every retry (so a failed attempt
    that is not retried leaves the generators as it left them, as a plain call would)."""

    __slots__ = ("tensors", "state")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = tensors  # where the work runs: the devices whose generators count
        self.state: Optional[RandomState] = None

    def begin(self) -> None:
        if self.state is None:
            self.state = RandomState(self.tensors)
        else:  # a retry: the same random numbers as the failed attempt drew
            self.state.restore()

    def undo(self) -> None:
        pass
