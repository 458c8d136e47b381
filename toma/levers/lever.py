"""The interface of a memory lever: whether it can apply to a model, applying it (which returns how to remove
it), and what it costs, in words for the docs and log lines."""

from abc import ABC, abstractmethod
from typing import Callable

import torch

__all__ = ["MemoryLever", "Removal", "LeverDoesNotApply"]

Removal = Callable[[], None]  # puts the model back as it was before the lever applied


class LeverDoesNotApply(ValueError):
    """`apply` on a model the lever does not apply to (nothing to apply it to, or on already)."""


class MemoryLever(ABC):
    """A way to run a micro-batch in less memory at a price in time, applied to a model and removed again."""

    name: str = ""
    cost: str = ""  # what it costs, in words

    @abstractmethod
    def applies_to(self, model: torch.nn.Module) -> bool:
        """Whether applying it to `model` changes anything (False where it is on already: the user's own)."""

    @abstractmethod
    def apply(self, model: torch.nn.Module) -> Removal:
        """Turn it on for `model`; returns what turns it off again."""
