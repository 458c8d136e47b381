"""A call back when a backward pass first gives a tensor a gradient, holding neither the tensor nor its owner.

`HostedEmbedding` queues a lookup for its step this way: a lookup no backward pass reaches (evaluation without
`torch.no_grad()`) is then freed with its output instead of being held until the next step.
"""

import weakref
from typing import Callable, List, TypeVar

import torch

__all__ = ["on_first_gradient"]

Owner = TypeVar("Owner")


def on_first_gradient(tensor: torch.Tensor, owner: Owner, action: Callable[[Owner, torch.Tensor], None]) -> None:
    """`action(owner, tensor)` once, when a backward pass first accumulates `tensor`'s gradient (a second
    backward through it adds to the same gradient: no second call); nothing once `owner` is gone."""
    held = weakref.ref(owner)
    called: List[bool] = []

    def reached(grown: torch.Tensor) -> None:
        alive = held()
        if alive is not None and not called:
            called.append(True)
            action(alive, grown)

    tensor.register_post_accumulate_grad_hook(reached)
