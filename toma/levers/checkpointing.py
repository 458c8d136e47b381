"""Activation checkpointing as a memory lever: a Hugging Face model's own switch, else the blocks of the model's
largest `nn.ModuleList`/`nn.Sequential` of same-type modules run under `torch.utils.checkpoint` (non-reentrant,
random state preserved, so dropout draws as it would). A model whose checkpointing the user turned on is left
alone, and never turned off."""

import functools
from typing import Any, Callable, List, Optional

import torch
from torch.utils.checkpoint import checkpoint

from toma.levers.lever import MemoryLever, Removal

__all__ = ["ActivationCheckpointing", "repeated_blocks"]

_CHECKPOINTED = "_toma_checkpointed"  # marks a block's forward that this lever set


def repeated_blocks(model: torch.nn.Module) -> Optional[List[torch.nn.Module]]:
    """The blocks of `model`'s largest `ModuleList`/`Sequential` whose two or more children share one type."""
    best: Optional[List[torch.nn.Module]] = None
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            children = list(module.children())
            if len(children) >= 2 and len({type(child) for child in children}) == 1:
                if best is None or len(children) > len(best):
                    best = children
    return best


def _is_hugging_face(model: torch.nn.Module) -> bool:
    return callable(getattr(model, "gradient_checkpointing_enable", None)) and bool(
        getattr(model, "supports_gradient_checkpointing", False)
    )


def _switch(model: torch.nn.Module) -> str:
    """The name a Hugging Face release gives its switch: `activation_checkpointing` (5.x), else the older one."""
    return "activation_checkpointing" if hasattr(model, "activation_checkpointing_enable") else "gradient_checkpointing"


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`forward` under checkpointing where gradients are taken; as it is elsewhere (no_grad, evaluation)."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


class ActivationCheckpointing(MemoryLever):
    """Saves only each block's input in the forward pass and recomputes the block in the backward pass."""

    name = "activation checkpointing"
    cost = "one more forward pass of the checkpointed blocks in the backward pass (about 20-30% more time a step)"

    def applies_to(self, model: torch.nn.Module) -> bool:
        if _is_hugging_face(model):
            return not getattr(model, f"is_{_switch(model)}", False)
        blocks = repeated_blocks(model)
        return blocks is not None and not any(_CHECKPOINTED in vars(block) for block in blocks)

    def apply(self, model: torch.nn.Module) -> Removal:
        if not self.applies_to(model):
            raise ValueError(f"{self.name} does not apply to {type(model).__name__} (no repeated blocks, or on)")
        if _is_hugging_face(model):
            switch = _switch(model)
            getattr(model, f"{switch}_enable")(**{f"{switch}_kwargs": {"use_reentrant": False}})
            removal: Removal = getattr(model, f"{switch}_disable")
            return removal
        blocks = repeated_blocks(model)
        assert blocks is not None
        for block in blocks:
            own = vars(block).get("forward")  # an instance's own forward, put back on removal
            block.forward = functools.partial(
                _checkpointed, own if own is not None else type(block).forward.__get__(block)
            )
            vars(block)[_CHECKPOINTED] = own
        return functools.partial(_remove, blocks)


def _remove(blocks: List[torch.nn.Module]) -> None:
    for block in blocks:
        own = vars(block).pop(_CHECKPOINTED, None)
        if own is None:
            vars(block).pop("forward", None)
        else:
            block.forward = own
