"""How an accumulation syncs gradients across ranks: alone (LocalSync), through DDP with `no_sync` on all but the
last micro-batch (DDPNoSync), through the ranks' agreement and one all-reduce at the end (AgreeingDDP), or through
the agreement alone when a framework reduces the gradients after the logical batch (AgreeingOnly); and the device
a model computes on."""

import contextlib
from typing import Any, ContextManager, Iterable, List, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from toma.accumulation.options import nothing_counted
from toma.core.agreement import Agreement, all_reduce_gradients, broadcast_buffers, is_distributed

__all__ = ["LocalSync", "DDPNoSync", "AgreeingDDP", "AgreeingOnly", "model_device", "sync_for"]


class LocalSync:
    """A module on one process: micro-batches need no synchronisation context."""

    _nothing = contextlib.nullcontext()
    copy_grads = False  # the gradients set aside are nobody else's to write
    agreement = None

    def micro_batch(self, last: bool) -> ContextManager[Any]:
        return self._nothing

    def abort(self) -> None:
        pass


class DDPNoSync:
    """DistributedDataParallel: all micro-batches but the last under `no_sync()`, so the gradients are
    all-reduced once per logical batch, overlapping the last micro-batch's backward pass."""

    agreement = None  # one rank: DDP's reduction in the last backward pass cannot be left unmatched

    def __init__(self, model: DistributedDataParallel) -> None:
        self.model = model
        # With gradient_as_bucket_view the reducer writes the reduced gradients into the memory the old
        # `.grad` tensors view, so the gradients a call starts with must be kept as copies.
        self.copy_grads = bool(getattr(model, "gradient_as_bucket_view", False))

    def micro_batch(self, last: bool) -> ContextManager[Any]:
        return contextlib.nullcontext() if last else self.model.no_sync()

    def abort(self) -> None:
        # A backward pass that failed after DDP's hooks fired leaves its reducer expecting the rest of the
        # reduction; without a reset the retry's forward fails with "Expected to have finished reduction".
        reducer = getattr(self.model, "reducer", None)
        if reducer is not None and hasattr(reducer, "_reset_state"):
            reducer._reset_state()


class AgreeingDDP:
    """DistributedDataParallel over several ranks: no collective inside the region that may be retried.

    Every micro-batch runs under `no_sync()`; after the logical batch the ranks agree (one small all-reduce)
    whether any ran out of memory, and only if none did are the gradients all-reduced, once, in buckets
    (`toma.core.agreement.all_reduce_gradients`). Letting DDP reduce during the last backward pass would overlap
    communication with it, but a rank that runs out of memory there leaves the others' all-reduces unmatched:
    the hang this design exists to prevent. The lost overlap is the price (see the benchmark).
    """

    copy_grads = False  # DDP's reducer never runs, so nothing writes into the gradients set aside

    def __init__(self, model: DistributedDataParallel) -> None:
        self.model = model
        self.agreement = Agreement(model.process_group, _ddp_device(model))
        # Set on construction (and by a synchronised forward pass outside toma), it makes the next forward
        # pass broadcast buffers; `synchronise` does that outside the retried region instead.
        model.require_forward_param_sync = False

    def micro_batch(self, last: bool) -> ContextManager[Any]:
        return self.model.no_sync()

    def synchronise(self, params: List[torch.Tensor], weight: Optional[float] = None) -> None:
        """Average this call's gradients over the ranks; with `weight` (the items this rank's mean loss
        averaged over, from weight=) weigh each rank by its items, so the result is the mean over all of
        them rather than a mean of the ranks' means."""
        scale = 1.0
        if weight is not None:
            total = self.agreement.sum(weight)
            if total == 0:  # every rank's: the same error on every rank, before the gradients' all-reduce
                raise nothing_counted(None, ranks=self.agreement.world_size)
            scale = weight * self.agreement.world_size / total
        all_reduce_gradients(params, self.model.process_group, scale=scale)
        if getattr(self.model, "broadcast_buffers", False):
            # DDP would broadcast rank 0's buffers (BatchNorm statistics) in the next forward pass, a
            # collective inside the region that may be retried: a rank that skips its forward passes would
            # leave the others waiting. Broadcast them here, after the agreement, and keep DDP's off.
            broadcast_buffers(self.model)

    def abort(self) -> None:
        pass


class AgreeingOnly:
    """Ranks whose gradients a framework reduces after the logical batch, outside the region toma may retry
    (Lightning's DDP, in the backward pass it runs on the logical batch's loss): every attempt is agreed on, as
    under AgreeingDDP, so the ranks start each logical batch at the same size and stop together, and nothing is
    reduced here."""

    copy_grads = False

    def __init__(self, agreement: Agreement) -> None:
        self.agreement = agreement

    def micro_batch(self, last: bool) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def synchronise(self, params: List[torch.Tensor], weight: Optional[float] = None) -> None:
        pass

    def abort(self) -> None:
        pass


def model_device(params: Iterable[torch.Tensor]) -> Optional[torch.device]:
    """Where a model computes: its first parameter's device, or a later one's on an accelerator when the
    first is on the CPU (None: no parameters)."""
    first = None
    for p in params:
        if p.device.type != "cpu":
            return p.device
        first = first or p.device
    return first


def _ddp_device(model: DistributedDataParallel) -> Optional[torch.device]:
    """DDP's device: its `device_ids[0]`, else its module's parameters' (the rank's GPU under NCCL)."""
    if model.device_ids:
        return torch.device(model.device_type, model.device_ids[0])
    return model_device(model.module.parameters())


def sync_for(model: torch.nn.Module) -> Any:
    if not isinstance(model, DistributedDataParallel):
        return LocalSync()
    return AgreeingDDP(model) if is_distributed(model.process_group) else DDPNoSync(model)
