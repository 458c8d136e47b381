"""Activation checkpointing as a memory lever: a Hugging Face model's own switch (the model's, or else that of the
outermost Hugging Face model inside it: a LightningModule's, a wrapper's), else the blocks of the model's largest
`nn.ModuleList`/`nn.Sequential` of same-type modules run under `torch.utils.checkpoint` (non-reentrant, random
state preserved, so dropout draws as it would). A model whose checkpointing the user turned on is left alone, and
never turned off. `checkpoint_with` gives a Hugging Face model's switch the keywords a trainer's arguments name."""

import functools
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch
from torch.utils.checkpoint import checkpoint

from toma.levers.lever import LeverDoesNotApply, MemoryLever, Removal

__all__ = ["ActivationCheckpointing", "checkpoint_with", "hugging_face_model", "repeated_blocks"]

_CHECKPOINTED = "_toma_checkpointed"  # marks a block's forward that this lever set
# per Hugging Face model: the keywords its switch is thrown with (`checkpoint_with`)
_SWITCH_KWARGS: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[str, Any]]" = weakref.WeakKeyDictionary()
# per model given to `checkpoint_with`: what was said for it last (None: the default)
_GIVEN: "weakref.WeakKeyDictionary[torch.nn.Module, Optional[Dict[str, Any]]]" = weakref.WeakKeyDictionary()


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


def hugging_face_model(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """`model` where it is a Hugging Face model with a checkpointing switch, else the outermost one inside it (a
    LightningModule's, an accelerate or `torch.compile` wrapper's); None where there is none."""
    return next((module for module in model.modules() if _is_hugging_face(module)), None)


def checkpoint_with(model: torch.nn.Module, kwargs: Optional[Mapping[str, Any]]) -> None:
    """How the lever throws the switch of `model`'s Hugging Face model (`hugging_face_model`): with `kwargs` as a
    Trainer's `activation_checkpointing_kwargs` name them (`every_n_layers`, `offload`; the rest reach
    `torch.utils.checkpoint`, `use_reentrant=False` unless they say otherwise); None: the default."""
    if not kwargs and not _SWITCH_KWARGS:
        return  # nothing to say, nothing said before: no walk over the modules
    given = dict(kwargs) if kwargs else None
    if model in _GIVEN and _GIVEN[model] == given:
        return  # said for this model already (a trainer says it every step): no walk either
    _GIVEN[model] = given
    hugging_face = hugging_face_model(model)
    if hugging_face is not None and kwargs:
        _SWITCH_KWARGS[hugging_face] = dict(kwargs)
    elif hugging_face is not None:
        _SWITCH_KWARGS.pop(hugging_face, None)


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
        hugging_face = hugging_face_model(model)
        if hugging_face is not None:
            return not getattr(hugging_face, f"is_{_switch(hugging_face)}", False)
        blocks = repeated_blocks(model)
        return blocks is not None and not any(_CHECKPOINTED in vars(block) for block in blocks)

    def apply(self, model: torch.nn.Module) -> Removal:
        if not self.applies_to(model):
            raise LeverDoesNotApply(f"{self.name} does not apply to {type(model).__name__} (no repeated blocks, or on)")
        hugging_face = hugging_face_model(model)
        if hugging_face is not None:
            return _switch_on(hugging_face)
        blocks = repeated_blocks(model)
        assert blocks is not None
        for block in blocks:
            own = vars(block).get("forward")  # an instance's own forward, put back on removal
            block.forward = functools.partial(
                _checkpointed, own if own is not None else type(block).forward.__get__(block)
            )
            vars(block)[_CHECKPOINTED] = own
        return functools.partial(_remove, blocks)


def _switch_on(model: torch.nn.Module) -> Removal:
    """A Hugging Face model's own switch, thrown with `checkpoint_with`'s keywords; what turns it off again (with
    the input embeddings' hooks that turning it on added, the user's own left as they were)."""
    switch, given = _switch(model), dict(_SWITCH_KWARGS.get(model, {}))
    extra = {name: given.pop(name) for name in ("every_n_layers", "offload") if name in given}
    before = {name: vars(model)[name] for name in _HOOK_ATTRIBUTES if name in vars(model)}
    users = list(before.get("_require_grads_hooks") or [])
    getattr(model, f"{switch}_enable")(**{f"{switch}_kwargs": {"use_reentrant": False, **given}}, **extra)
    added = [hook for hook in getattr(model, "_require_grads_hooks", None) or [] if hook not in users]
    return functools.partial(_switch_off, model, switch, added, before)


_HOOK_ATTRIBUTES = ("_require_grads_hooks", "_require_grads_hook")  # where Hugging Face keeps the embeddings' hooks


def _switch_off(model: torch.nn.Module, switch: str, added: List[Any], before: Dict[str, Any]) -> None:
    """The switch off, the hooks turning it on added removed, and the user's own hooks as they were."""
    getattr(model, f"{switch}_disable")()
    for hook in added:
        hook.remove()
    for name in _HOOK_ATTRIBUTES:
        if name in before:
            setattr(model, name, before[name])
        elif name in vars(model):
            delattr(model, name)


def _remove(blocks: List[torch.nn.Module]) -> None:
    for block in blocks:
        own = vars(block).pop(_CHECKPOINTED, None)
        if own is None:
            vars(block).pop("forward", None)
        else:
            block.forward = own
