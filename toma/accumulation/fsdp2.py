"""FSDP2 (`torch.distributed.fsdp.fully_shard`) as an accumulation needs it: every unit held unsharded for one
attempt at a logical batch, so that its micro-batches run no collective at all (a rank that runs out of memory
cannot leave another waiting in an all-gather or a reduce-scatter), and the gradients reduced once after the
ranks agreed that every one of them finished, each rank keeping its shard.

FSDP2 has no public way to reduce gradients it accumulated unsharded, nor to clear the state a forward or a
backward pass that raised half-way leaves behind (a unit's training state, the root's queued final callback).
Those private parts are used here and nowhere else, checked when a model is first seen: a torch release that
moved them gets an error naming this module and the releases it was written against, not a hang."""

from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from toma.core.agreement import all_reduce_gradients

__all__ = ["is_fsdp2", "Fsdp2Changed", "ShardedUnits"]

WRITTEN_FOR = "torch 2.11 and 2.13"


class Fsdp2Changed(RuntimeError):
    """This torch's FSDP2 lacks a private part toma relies on."""


def is_fsdp2(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def _changed(what: str) -> Fsdp2Changed:
    return Fsdp2Changed(
        f"toma.accumulate with FSDP2: this torch ({torch.__version__}) has no {what}, which toma's FSDP2 support "
        f"(toma/accumulation/fsdp2.py) was written against ({WRITTEN_FOR}); accumulate without toma, or use a "
        "torch release it supports"
    )


def _groups(unit: FSDPModule) -> List[Any]:
    """A unit's parameter groups (one, or several in later releases)."""
    state = unit._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return [group for group in state._fsdp_param_groups if group is not None]
    if hasattr(state, "_fsdp_param_group"):
        return [] if state._fsdp_param_group is None else [state._fsdp_param_group]
    raise _changed("FSDPState._fsdp_param_groups")


class ShardedUnits:
    """The FSDP2 units of a root module: held unsharded without gradient sync for an attempt (`hold`), their
    unsharded gradients averaged over the shard group and split into each rank's shard (`reduce`), and put back
    as they were (`release`; `reset` after an attempt that raised)."""

    __slots__ = ("units", "params", "groups", "process_group", "_settings")

    def __init__(self, root: torch.nn.Module) -> None:
        self.units: List[FSDPModule] = [m for m in root.modules() if isinstance(m, FSDPModule)]
        self.groups = [group for unit in self.units for group in _groups(unit)]
        self.params = [param for group in self.groups for param in group.fsdp_params]
        for param in self.params:
            for name in ("unsharded_param", "to_sharded_dtensor"):
                if not hasattr(type(param), name):
                    raise _changed(f"FSDPParam.{name}")
            for name in ("sharded_param", "mesh_info"):
                if not hasattr(param, name):
                    raise _changed(f"FSDPParam.{name}")
        if not self.params:
            raise ValueError("toma.accumulate: the FSDP2 model has no sharded parameters")
        for param in self.params:
            if param.mesh_info.mesh.ndim != 1 or not hasattr(param.mesh_info, "shard_process_group"):
                raise NotImplementedError(
                    "toma.accumulate supports FSDP2 on a 1-D device mesh (fully sharded); HSDP and replication are "
                    "not supported yet"
                )
        groups = {tuple(dist.get_process_group_ranks(p.mesh_info.shard_process_group)) for p in self.params}
        if len(groups) > 1:
            raise NotImplementedError("toma.accumulate: FSDP2 units sharded over different ranks are not supported")
        self.process_group = self.params[0].mesh_info.shard_process_group
        self._settings: Optional[List[Tuple[Any, Any, Any]]] = None

    def hold(self) -> None:
        """Before an attempt: no reduce-scatter and no resharding in its passes, every unit unsharded (the
        all-gathers, here, before any micro-batch)."""
        if self._settings is None:
            self._settings = [(g.reduce_grads, g.reshard_after_backward, g.post_forward_mesh_info) for g in self.groups]
        for group in self.groups:
            group.reduce_grads, group.reshard_after_backward, group.post_forward_mesh_info = False, False, None
        for unit in self.units:
            unit.unshard()

    def reduce(self, scale: float) -> None:
        """After an attempt every rank finished: the unsharded gradients averaged over the ranks (this rank's
        multiplied by `scale` first), each rank's dim-0 shard its sharded parameter's gradient."""
        unsharded = [param.unsharded_param for param in self.params]
        all_reduce_gradients(unsharded, self.process_group, scale=scale)
        rank, world = dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        for param, full in zip(self.params, unsharded):
            assert full.grad is not None
            pieces = torch.chunk(full.grad, world, dim=0)
            local = pieces[rank] if rank < len(pieces) else full.grad[:0]
            param.sharded_param.grad = param.to_sharded_dtensor(local.contiguous())
        self.release()

    def release(self) -> None:
        """The units as they were before `hold`: unsharded gradients dropped, settings back, resharded."""
        for param in self.params:
            if hasattr(param, "_unsharded_param"):  # made by the first unshard
                param.unsharded_param.grad = None
        if self._settings is not None:
            for group, (reduce_grads, after_backward, post_forward) in zip(self.groups, self._settings):
                group.reduce_grads, group.reshard_after_backward = reduce_grads, after_backward
                group.post_forward_mesh_info = post_forward
            self._settings = None
        for unit in self.units:
            unit.reshard()

    def reset(self) -> None:
        """After an attempt that raised in a forward or backward pass: FSDP2's training state back to idle (as
        its final backward callback leaves it), then `release`."""
        for unit in self.units:
            state = unit._get_fsdp_state()
            context = state._state_ctx
            context.iter_forward_root = None
            context.post_backward_final_callback_queued = False
            state._training_state = type(state._training_state).IDLE
            if hasattr(state, "_modules_to_run_forward"):
                state._modules_to_run_forward.clear()
            for group in _groups(unit):
                group._training_state = type(group._training_state).IDLE
        self.release()
