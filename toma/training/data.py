"""The data as the Trainer reads it: a batch as the arguments of its loss, how many batches and rows an epoch
holds, and evaluation in chunks that fit (a range step)."""

import math
from typing import Any, Optional

import torch

from toma.batching.batches import Pieces, group_cut_widths, rows, whole_batch_count
from toma.batching.groups import Groups, rows_belong_together
from toma.batching.logical import LogicalBatch, logical_batch_of
from toma.batching.splitting import ArgumentPieces
from toma.core.steps import RangeStep


def call_arguments(batch: Any, forward: bool) -> tuple:
    """The arguments the micro-batch loss takes for one data batch: the batch itself with `forward=`, else the
    `(inputs, targets)` pair it must be."""
    if forward:
        return (batch,)
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(
            "train_data must yield (inputs, targets) batches for loss_fn(model(inputs), targets); "
            f"got {type(batch).__name__}. For batches of another shape pass forward=batch -> loss"
        )
    return tuple(batch)


def logical_batch(batch: Any, forward: bool, lengths: Any = None, groups: Optional[Groups] = None) -> LogicalBatch:
    """One logical batch of the loss's arguments (in pieces where the loader batches could not be joined), by
    `lengths=` (packed sequences) and `groups=`."""
    if isinstance(batch, Pieces):
        return ArgumentPieces(
            [logical_batch_of(call_arguments(piece, forward), {}, lengths, groups) for piece in batch]
        )
    return logical_batch_of(call_arguments(batch, forward), {}, lengths, groups)


def known_length(data: Any) -> Optional[int]:
    try:
        return len(data)
    except TypeError:  # a DataLoader over an IterableDataset without __len__
        return None


def rows_per_epoch(data: Any) -> Optional[int]:
    """The rows one pass over `data` yields, where that is known without loading it: a DataLoader's sampler
    (so a subset sampler counts only its rows), or a list of batches."""
    if isinstance(data, (list, tuple)):
        try:
            return sum(rows(batch) for batch in data)
        except (TypeError, ValueError):
            return None
    batch_size = getattr(data, "batch_size", None)
    dataset = getattr(data, "dataset", None)
    if isinstance(dataset, torch.utils.data.IterableDataset):  # its own length, if it has one, is the rows
        count = known_length(dataset)
        if count is None or not isinstance(batch_size, int) or getattr(data, "num_workers", 0) > 0:
            return None  # with workers each replica yields the dataset: rows unknown to us
        return count - count % batch_size if getattr(data, "drop_last", False) else count
    batch_sampler = getattr(data, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None)
    if batch_size is None or sampler is None or getattr(batch_sampler, "batch_size", None) != batch_size:
        return None  # a custom batch sampler, or no automatic batching: rows unknown
    count = known_length(sampler)
    if count is None:
        return None
    if getattr(batch_sampler, "drop_last", False):
        count -= count % batch_size
    return count


def steps_per_epoch(data: Any, batch_size: int, groups: Optional[Groups]) -> Optional[int]:
    """The logical batches one pass over `data` makes (`toma.batching.batches.logical_batches`), where its rows are
    known without loading it."""
    count = rows_per_epoch(data)
    if count is None:
        return None
    if groups is None or not rows_belong_together(groups):
        return math.ceil(count / batch_size)
    if isinstance(data, (list, tuple)):
        widths = [rows(batch) for batch in data]
    else:
        loaded: int = data.batch_size  # known wherever the rows are
        full, rest = divmod(count, loaded)
        widths = [loaded] * full + ([rest] if rest else [])
    return whole_batch_count((part for n in widths for part in group_cut_widths(n, batch_size, groups)), batch_size)


# The evaluation cache's starting size: every batch whole (chunks are capped at its rows) until one runs
# out of memory; not the first batch's rows, which a short first batch would turn into a limit for all.
WHOLE_BATCHES = 2**30


class EvaluationChunks(RangeStep):
    """The rows of one evaluation batch, in chunks that fit; named for what the user knows in log lines."""

    size_name = "evaluation chunk size"
    __slots__ = ()
