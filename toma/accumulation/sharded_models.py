"""Which models FSDP2 (`fully_shard`) sharded, and their root, told without importing FSDP2: `import toma` stays
light, and `toma.accumulation.fsdp2` (FSDP2's private parts) loads only for a model that needs it."""

import sys
from typing import List, Optional, Tuple

import torch

__all__ = ["is_fsdp2", "fsdp2_root"]


def is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether `model` is an FSDP2 unit (`fully_shard`). FSDP2 is not imported for the question: a model can only
    be one once something imported it."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def fsdp2_root(module: torch.nn.Module, where: str) -> Optional[torch.nn.Module]:
    """The FSDP2 root of `module` for an accumulation: `module` itself, or its one outermost `fully_shard`
    submodule, which must hold every parameter that trains; None when nothing in it is sharded. `where` names
    the caller in the errors."""
    if is_fsdp2(module):
        return module
    roots: List[Tuple[str, torch.nn.Module]] = []
    for name, sub in module.named_modules():
        if is_fsdp2(sub) and not any(name.startswith(f"{outer}.") for outer, _ in roots):
            roots.append((name, sub))
    if not roots:
        return None
    if len(roots) > 1:
        names = ", ".join(name for name, _ in roots)
        raise ValueError(
            f"{where}: the model has several FSDP2 roots ({names}); call fully_shard on the module that holds "
            "them all too, as FSDP2 expects of a model it trains"
        )
    name, root = roots[0]
    inside = {id(p) for p in root.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise ValueError(
            f"{where}: parameters that train lie outside the FSDP2 root {name!r} ({', '.join(outside[:3])}"
            f"{', ...' if len(outside) > 3 else ''}), where no rank's gradients would reach the others'; put them "
            "in a fully_shard module"
        )
    return root
