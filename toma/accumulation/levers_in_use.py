"""The memory levers of one accumulation call (`toma.levers`): where even one unit (a row, a group, a packed
sequence) runs out of memory, the next lever that applies to the model is turned on and the attempt redone at the
same size; every lever turned on is turned off again when the call ends, so the model is as the user gave it."""

import logging
from typing import List, Sequence, Tuple

import torch

from toma.levers.checkpointing import ActivationCheckpointing
from toma.levers.lever import MemoryLever, Removal
from toma.levers.offload import ActivationOffload

__all__ = ["LeversInUse", "LEVERS"]

log = logging.getLogger("toma")

LEVERS: Tuple[MemoryLever, ...] = (ActivationCheckpointing(), ActivationOffload())  # in order of their cost


class LeversInUse:
    """The levers a call turned on (`names`), with what turns each off."""

    __slots__ = ("model", "enabled", "names", "_removals")

    def __init__(self, model: torch.nn.Module, enabled: bool) -> None:
        self.model, self.enabled = model, enabled
        self.names: List[str] = []
        self._removals: List[Removal] = []

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
        for lever in LEVERS:
            if self.enabled and lever.name in names and lever.name not in self.names and lever.applies_to(self.model):
                self._removals.append(lever.apply(self.model))
                self.names.append(lever.name)

    def turn_off(self) -> None:
        """Every lever this call turned on, off again (the last first)."""
        while self._removals:
            self._removals.pop()()
