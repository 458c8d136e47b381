"""The memory levers of one accumulation call (`toma.levers`): where even one unit (a row, a group, a packed
sequence) runs out of memory, the next lever that applies to the model is turned on and the attempt redone at the
same size; every lever turned on is turned off again when the call ends, so the model is as the user gave it."""

import logging
from typing import List, Optional, Sequence, Tuple

import torch
from torch.nn import DataParallel
from torch.nn.parallel import DistributedDataParallel

from toma.levers.checkpointing import ActivationCheckpointing
from toma.levers.lever import LeverDoesNotApply, MemoryLever, Removal
from toma.levers.offload import ActivationOffload

__all__ = ["LeversInUse", "LEVERS"]

log = logging.getLogger("toma")

LEVERS: Tuple[MemoryLever, ...] = (ActivationCheckpointing(), ActivationOffload())  # in order of their cost


_WRAPPERS = (DistributedDataParallel, DataParallel)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP's (or DataParallel's) wrapper: a Hugging Face model's own switch is on it."""
    while isinstance(model, _WRAPPERS):
        model = model.module
    return model


class LeversInUse:
    """The levers a call turned on (`names`), with what turns each off."""

    __slots__ = ("model", "enabled", "names", "remembered", "_removals")

    def __init__(self, model: torch.nn.Module, enabled: bool) -> None:
        self.model, self.enabled = _unwrapped(model), enabled
        self.names: List[str] = []
        self._removals: List[Removal] = []
        self.remembered: Tuple[str, ...] = ()  # what the cache entry asked for at the start (`turn_on`)

    def has_next(self) -> bool:
        """Whether a lever not on yet applies to the model (ranks ask before they agree to retry lighter)."""
        return self.enabled and any(lever.name not in self.names and lever.applies_to(self.model) for lever in LEVERS)

    def next(self) -> str:
        """Turn on the cheapest lever not on yet that applies to the model; its name, or "" where none is left."""
        if not self.enabled:
            return ""
        for lever in LEVERS:
            if lever.name not in self.names and lever.applies_to(self.model):
                self._removals.append(lever.apply(self.model))
                self.names.append(lever.name)
                log.info("toma: one unit did not fit; %s turned on (%s)", lever.name, lever.cost)
                return lever.name
        return ""

    def turn_on(self, names: Sequence[str]) -> None:
        """The levers an earlier call of this function needed, on from the start."""
        self.remembered = tuple(names)
        if not self.enabled:
            return
        for lever in LEVERS:
            if lever.name in names and lever.name not in self.names:
                try:  # `apply` asks `applies_to` itself: one walk over the model, not two
                    removal = lever.apply(self.model)
                except LeverDoesNotApply:
                    continue
                self._removals.append(removal)
                self.names.append(lever.name)

    @property
    def in_effect(self) -> Tuple[str, ...]:
        """The levers on; with levers turned off for this call, the ones remembered (nothing learned changes them)."""
        return tuple(self.names) if self.enabled else self.remembered

    def turn_off(self) -> None:
        """Every lever this call turned on, off again (the last first); one that fails to come off does not keep the
        others on: its error is raised once all were tried."""
        failure: Optional[BaseException] = None
        while self._removals:
            try:
                self._removals.pop()()
            except Exception as error:
                failure = failure or error
        if failure is not None:
            raise failure
