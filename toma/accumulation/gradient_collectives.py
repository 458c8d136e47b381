"""The gradient collectives of an accumulation over DDP ranks: the averaged all-reduce DDP would make (in buckets,
after the ranks agreed that every one finished its micro-batches) and DDP's buffer broadcast."""

from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from toma.core.oom import collective
from toma.memory.reserve import room_for

__all__ = ["GradientBuckets", "all_reduce_gradients", "broadcast_buffers"]

GLOO_ALL_REDUCE_ROOM = 4 * 2**20


class GradientBuckets:
    """The gradients of `params` flattened into buckets of about `bucket_bytes` per device and dtype, as
    DistributedDataParallel buckets them, allocated when made: before the ranks agree that every one finished its
    micro-batches, so that a rank short of memory for them tells the others there instead of leaving them in the
    all-reduce (`all_reduce`, after the agreement, allocates nothing of its own; under an address-space limit, room
    for what gloo allocates inside an all-reduce of the largest bucket is checked here too). A parameter without a
    gradient counts as zeros (and gets them), so that every rank reduces the same tensors."""

    __slots__ = ("buckets",)

    def __init__(self, params: List[torch.Tensor], bucket_bytes: int = 25 * 2**20) -> None:
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if p.grad.is_sparse:
                raise NotImplementedError("toma: sparse gradients are not supported with several ranks")
            grads.append(p.grad)
        groups: Dict[Tuple[torch.device, torch.dtype], List[List[torch.Tensor]]] = {}
        filled: Dict[Tuple[torch.device, torch.dtype], int] = {}  # bytes in each key's last bucket
        for grad in grads:
            key = (grad.device, grad.dtype)
            keyed = groups.setdefault(key, [[]])
            if keyed[-1] and filled[key] + grad.nbytes > bucket_bytes:
                keyed.append([])
                filled[key] = 0
            keyed[-1].append(grad)
            filled[key] = filled.get(key, 0) + grad.nbytes
        self.buckets: List[Tuple[List[torch.Tensor], torch.Tensor]] = [
            (bucket, torch.cat([g.reshape(-1) for g in bucket]) if len(bucket) > 1 else bucket[0].reshape(-1))
            for keyed in groups.values()
            for bucket in keyed
        ]
        # gloo's all-reduce of a CPU tensor allocates inside, about 2 MiB whatever its size (seen for 8 and 32 MiB):
        # room for two at once, one per thread of gloo's
        if any(flat.device.type == "cpu" for _, flat in self.buckets):
            room_for(GLOO_ALL_REDUCE_ROOM, "gloo inside the gradients' all-reduce")

    def all_reduce(self, group: Any = None, scale: float = 1.0) -> None:
        """Average the gradients over the ranks: every bucket all-reduced at once (asynchronously), divided by the
        world size, copied back. `scale` multiplies this rank's gradients first (its share in a weighted mean)."""
        world_size = dist.get_world_size(group)
        pending = []
        with collective("gradients' all-reduce"):
            for bucket, flat in self.buckets:
                if scale != 1.0:
                    flat.mul_(scale)
                pending.append((bucket, flat, dist.all_reduce(flat, group=group, async_op=True)))
            for _, _, work in pending:
                work.wait()
        for bucket, flat, _ in pending:
            flat.div_(world_size)
            if len(bucket) == 1 and flat.data_ptr() == bucket[0].data_ptr():
                continue  # reduced in place
            offset = 0
            for grad in bucket:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()


def all_reduce_gradients(
    params: List[torch.Tensor], group: Any = None, bucket_bytes: int = 25 * 2**20, scale: float = 1.0
) -> None:
    """Average the gradients of `params` over the ranks, as DistributedDataParallel does (`GradientBuckets`, made
    and all-reduced at once)."""
    GradientBuckets(params, bucket_bytes).all_reduce(group, scale)


def broadcast_buffers(model: Any) -> None:
    """Rank 0's module buffers (BatchNorm statistics) to every rank of a DistributedDataParallel `model`,
    the broadcast DDP itself makes before a synchronised forward pass (its own method: ignored buffers,
    join and buffer hooks as DDP handles them)."""
    ignored = getattr(model, "parameters_to_ignore", ())
    if any(name not in ignored for name, _ in model.module.named_buffers()):  # DDP asserts there is one
        model._sync_buffers()
