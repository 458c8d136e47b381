"""The micro-batches of one call moved to the model's CUDA device ahead of use, where the logical batch lives on the
host (`toma.batching.transfer.MicroBatchTransfers`): each one's copy started while the one before computes."""

from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from toma.batching import transfer
from toma.batching.logical import LogicalBatch
from toma.batching.transfer import MicroBatchTransfers, shared_transfers

__all__ = ["pipeline_for", "prefetched"]

Arguments = Tuple[Tuple[Any, ...], Dict[str, Any]]  # a micro-batch's positional and keyword arguments


def pipeline_for(params: List[torch.Tensor], batch: LogicalBatch) -> Optional[MicroBatchTransfers]:
    """The moves of this call's micro-batches to the model's CUDA device when the logical batch lives on the
    host: each micro-batch's split tensors move while the previous one computes, `toma.whole` values once per
    call. None when there is nothing to move (a CPU model, a batch already on the device)."""
    devices = dict.fromkeys(p.device for p in params)  # each device once, in the parameters' order
    device = next((d for d in devices if transfer.uses_cuda(d)), None)
    if device is None:
        return None
    if not any(t.device.type == "cpu" for piece in batch.pieces for _, t in piece.tensors):
        return None
    return MicroBatchTransfers(shared_transfers(device))


def prefetched(
    moving: MicroBatchTransfers, micro_batches: List[Tuple[Any, int, int, Optional[int]]]
) -> Iterator[Arguments]:
    """Each micro-batch's arguments on the device, the next one's copy started before this one computes."""
    if not micro_batches:
        return
    ahead = moving.prefetch(*micro_batches[0])
    for following in micro_batches[1:]:
        arguments = ahead.take()
        ahead = moving.prefetch(*following)
        yield arguments
    yield ahead.take()
