"""Which gradient sync a model calls for (`toma.accumulation.sync`, `toma.accumulation.fsdp2_syncs`)."""

import torch
from torch.nn.parallel import DistributedDataParallel

from toma.accumulation.sharded_models import is_fsdp2
from toma.accumulation.sync import AgreeingDDP, DDPNoSync, GradientSync, LocalSync
from toma.core.agreement import is_distributed

__all__ = ["sync_for"]

_LOCAL = LocalSync()


def sync_for(model: torch.nn.Module, gradient_sync: str = "auto") -> GradientSync:
    """The strategy `model` calls for: DDP's on a DistributedDataParallel (agreeing when several ranks run),
    FSDP2's on a module `fully_shard` made (`gradient_sync`: the units unsharded with the gradients reduced once
    per logical batch or after every micro-batch, the parameters sharded, or "auto"), else the local one."""
    if is_fsdp2(model):  # a model sharded in part only is refused where it enters (`check_model`)
        from toma.accumulation.fsdp2_syncs import fsdp2_sync  # FSDP2 loads with the first model that needs it

        return fsdp2_sync(model, gradient_sync)
    if not isinstance(model, DistributedDataParallel):
        return _LOCAL
    return AgreeingDDP(model) if is_distributed(model.process_group) else DDPNoSync(model)
