"""Batches as data: counting their rows, cutting and joining them, and moving them to a device.

A batch is a tensor or a tuple, list or dict of them (nested), with the rows along dim 0; anything
else in it (strings, numbers) travels along unchanged.
"""

from collections.abc import Mapping
from typing import Any, Iterable, Iterator, List

import torch

from toma.splitting import BatchSplit, map_tensors

__all__ = ["rows", "take", "concatenate", "to_device", "logical_batches"]


def rows(batch: Any) -> int:
    """The number of rows in `batch` (ValueError if its tensors disagree or it has none)."""
    return BatchSplit((batch,), {}).size


def take(batch: Any, start: int, stop: int) -> Any:
    """Rows `[start, stop)` of `batch`, as views."""
    (part,), _ = BatchSplit((batch,), {}).micro_batch(start, stop)
    return part


def concatenate(parts: List[Any]) -> Any:
    """The batches in `parts` joined along dim 0 (the first one's values for anything not a tensor)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.dim() > 0 else first
    if isinstance(first, tuple):
        joined = [concatenate([part[i] for part in parts]) for i in range(len(first))]
        return type(first)(*joined) if hasattr(first, "_fields") else tuple(joined)
    if isinstance(first, list):
        return [concatenate([part[i] for part in parts]) for i in range(len(first))]
    if isinstance(first, Mapping):
        return {key: concatenate([part[key] for part in parts]) for key in first}
    return first


def to_device(batch: Any, device: Any, non_blocking: bool = False) -> Any:
    """`batch` with every tensor on `device` (tensors already there are not copied)."""
    return map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=non_blocking))


def logical_batches(data: Iterable[Any], batch_size: int) -> Iterator[Any]:
    """Re-cut the batches of `data` into batches of `batch_size` rows (the last one may be smaller).

    Batches that already have `batch_size` rows pass through untouched; smaller ones (a DataLoader with a
    small `batch_size` for cheap loading) are joined, larger ones cut.
    """
    pending: List[Any] = []
    pending_rows = 0
    for batch in data:
        n = rows(batch)
        if not pending and n == batch_size:
            yield batch
            continue
        pending.append(batch)
        pending_rows += n
        while pending_rows >= batch_size:
            joined = concatenate(pending) if len(pending) > 1 else pending[0]
            yield take(joined, 0, batch_size)
            pending_rows -= batch_size
            pending = [take(joined, batch_size, batch_size + pending_rows)] if pending_rows else []
    if pending:
        yield concatenate(pending) if len(pending) > 1 else pending[0]
