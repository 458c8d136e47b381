"""The gradient collectives of an accumulation over DDP ranks: the averaged all-reduce DDP would make (in buckets,
after the ranks agreed that every one finished its micro-batches) and DDP's buffer broadcast."""

from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

__all__ = ["all_reduce_gradients", "broadcast_buffers"]


def all_reduce_gradients(
    params: List[torch.Tensor], group: Any = None, bucket_bytes: int = 25 * 2**20, scale: float = 1.0
) -> None:
    """Average the gradients of `params` over the ranks, as DistributedDataParallel does: gradients are
    flattened into buckets of about `bucket_bytes` per device and dtype, all buckets are all-reduced at
    once (asynchronously), then divided by the world size. A parameter without a gradient counts as zeros
    (and gets them), so that every rank reduces the same tensors. `scale` multiplies this rank's gradients
    before the reduction (its share in a weighted mean)."""
    world_size = dist.get_world_size(group)
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            raise NotImplementedError("toma: sparse gradients are not supported with several ranks")
        grads.append(p.grad)
    buckets: Dict[Tuple[torch.device, torch.dtype], List[List[torch.Tensor]]] = {}
    filled: Dict[Tuple[torch.device, torch.dtype], int] = {}  # bytes in each key's last bucket
    for grad in grads:
        key = (grad.device, grad.dtype)
        groups = buckets.setdefault(key, [[]])
        if groups[-1] and filled[key] + grad.nbytes > bucket_bytes:
            groups.append([])
            filled[key] = 0
        groups[-1].append(grad)
        filled[key] = filled.get(key, 0) + grad.nbytes
    pending = []
    for groups in buckets.values():
        for bucket in groups:
            flat = torch.cat([g.reshape(-1) for g in bucket]) if len(bucket) > 1 else bucket[0].reshape(-1)
            if scale != 1.0:
                flat.mul_(scale)
            pending.append((bucket, flat, dist.all_reduce(flat, group=group, async_op=True)))
    for bucket, flat, work in pending:
        work.wait()
        flat.div_(world_size)
        if len(bucket) == 1 and flat.data_ptr() == bucket[0].data_ptr():
            continue  # reduced in place
        offset = 0
        for grad in bucket:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def broadcast_buffers(model: Any) -> None:
    """Rank 0's module buffers (BatchNorm statistics) to every rank of a DistributedDataParallel `model`,
    the broadcast DDP itself makes before a synchronised forward pass (its own method: ignored buffers,
    join and buffer hooks as DDP handles them)."""
    ignored = getattr(model, "parameters_to_ignore", ())
    if any(name not in ignored for name, _ in model.module.named_buffers()):  # DDP asserts there is one
        model._sync_buffers()
