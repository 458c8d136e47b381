"""Batches as data: counting their rows, cutting and joining them, and moving them to a device.

A batch is a tensor or a tuple, list or dict of them (nested), with the rows along dim 0. A list or tuple of
plain values (strings, ids, 0-dim tensors) whose length is the row count holds one item per row, and is cut
and joined with the rows; anything else in a batch (a number, a tag, a 0-dim tensor) travels along
unchanged, and must be the same in batches that are joined.
"""

from collections.abc import Mapping
from typing import Any, Iterable, Iterator, List, Optional, Tuple

import torch

from toma.batching.groups import Groups, group_label, grouped_batch, rows_belong_together
from toma.batching.packed import PACKED_KEYS, PackedBatch, is_packed
from toma.batching.splitting import ArgumentBatch, is_row_sequence_candidate, map_tensors

__all__ = [
    "rows",
    "take",
    "concatenate",
    "to_device",
    "logical_batches",
    "whole_batches",
    "group_cut_widths",
    "whole_batch_count",
    "Pieces",
]


class Pieces(list[Any]):
    """A logical batch in pieces: batches that cannot be joined (tensors of different widths, as dynamic
    padding makes them). Each piece is trained as it is, micro-batches never spanning two
    (`toma.batching.splitting.ArgumentPieces` is the same logical batch as a function's arguments)."""


def _packed(batch: Any) -> Optional[PackedBatch]:
    """A padding-free batch (`toma.batching.packed`) as its packed sequences; None for any other batch."""
    if not is_packed(batch):
        return None
    key = next(key for key in PACKED_KEYS if isinstance(batch.get(key), torch.Tensor))
    return PackedBatch((batch,), {}, key)


def rows(batch: Any) -> int:
    """The number of rows in `batch` (a padding-free batch's: its packed sequences; ValueError if its tensors
    disagree or it has none)."""
    if isinstance(batch, Pieces):
        return sum(rows(piece) for piece in batch)
    packed = _packed(batch)
    if packed is not None:
        return packed.size
    return ArgumentBatch((batch,), {}).size


def take(batch: Any, start: int, stop: int) -> Any:
    """Rows `[start, stop)` of `batch`, as views (lists of one item per row are sliced; a padding-free batch's
    packed sequences, as a padding-free batch of their own)."""
    packed = _packed(batch)
    if packed is not None:
        if packed.rows != 1:
            raise ValueError(
                f"cannot cut a padding-free batch of {packed.rows} packed rows into logical batches; give the loader "
                "the logical batch size, or pack each batch into one row"
            )
        (part,), _ = packed.arguments(start, stop)
        return part
    (part,), _ = ArgumentBatch((batch,), {}).arguments(start, stop)
    return part


def _join(parts: List[Any], counts: List[int], path: str) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return torch.cat(parts)
    if is_row_sequence_candidate(first) and all(
        is_row_sequence_candidate(part) and len(part) == n for part, n in zip(parts, counts, strict=True)
    ):
        joined = [item for part in parts for item in part]
        return joined if isinstance(first, list) else tuple(joined)
    if isinstance(first, (tuple, list)) and not _plain_values(first):
        if any(type(part) is not type(first) or len(part) != len(first) for part in parts):
            raise _cannot_join(path, parts)
        joined = [_join([part[i] for part in parts], counts, f"{path}[{i}]") for i in range(len(first))]
        if isinstance(first, list):
            return joined
        return type(first)(*joined) if hasattr(first, "_fields") else tuple(joined)
    if isinstance(first, Mapping):
        if any(not isinstance(part, Mapping) or part.keys() != first.keys() for part in parts):
            raise _cannot_join(path, parts)
        return {key: _join([part[key] for part in parts], counts, f"{path}[{key!r}]") for key in first}
    if all(_same(part, first) for part in parts[1:]):
        return first  # the same tag in every batch
    raise _cannot_join(path, parts)


def _plain_values(sequence: Any) -> bool:
    """A list or tuple of plain values that holds no sequence to look into (for per-row lists)."""
    return is_row_sequence_candidate(sequence) and not all(isinstance(item, (list, tuple)) for item in sequence)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):  # 0-dim: a value, compared as one
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _cannot_join(path: str, parts: List[Any]) -> ValueError:
    kinds = ", ".join(sorted({type(part).__name__ for part in parts}))
    return ValueError(
        f"cannot join batches into a logical batch: batch{path} ({kinds}) is neither a tensor nor a list or tuple "
        "with one item per row, and it differs between the batches. Make it a tensor or such a list, or give "
        "the loader the logical batch size"
    )


def _check_cuttable(batch: Any, count: int, path: str) -> None:
    """Refuse to cut a batch holding a list of plain values that is not one item per row: cut, it would go
    whole to both parts and pair its items with the wrong rows."""
    if is_row_sequence_candidate(batch):
        if not batch or len(batch) == count:
            return
        if not _plain_values(batch):  # per-row lists inside, perhaps
            for i, item in enumerate(batch):
                _check_cuttable(item, count, f"{path}[{i}]")
        else:
            raise ValueError(
                f"cannot cut a batch into logical batches: batch{path} is a {type(batch).__name__} of {len(batch)} "
                f"items for {count} rows, so it cannot be split with the rows. Make it a tensor or a list with one "
                "item per row, or give the loader the logical batch size"
            )
    elif isinstance(batch, (tuple, list)):
        for i, item in enumerate(batch):
            _check_cuttable(item, count, f"{path}[{i}]")
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            _check_cuttable(value, count, f"{path}[{key!r}]")


def concatenate(parts: List[Any]) -> Any:
    """The batches in `parts` joined along dim 0: tensors concatenated, lists of one item per row joined,
    anything else kept when every batch has the same value (ValueError otherwise)."""
    return _join(parts, [rows(part) for part in parts], "")


def to_device(batch: Any, device: Any, non_blocking: bool = False) -> Any:
    """`batch` with every tensor on `device` (tensors already there are not copied)."""
    return map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=non_blocking))


def _layout(batch: Any) -> Any:
    """What must match for two batches to be concatenated: the structure, and every tensor's trailing shape,
    dtype and device."""
    if isinstance(batch, torch.Tensor):
        return ("tensor", tuple(batch.shape[1:]), batch.dtype, batch.device, batch.dim() == 0)
    if isinstance(batch, (tuple, list)) and not is_row_sequence_candidate(batch):
        return (type(batch), tuple(_layout(item) for item in batch))
    if isinstance(batch, Mapping):
        return (type(batch), tuple((key, _layout(value)) for key, value in batch.items()))
    return "value"


def _logical(taken: List[Tuple[Any, int]]) -> Any:
    """One logical batch from consecutive loader batches (or cuts of them): runs that can be joined are
    joined, and where shapes differ the runs are kept apart, as `Pieces`."""
    runs: List[List[Any]] = []
    layout: Optional[Any] = None
    for loaded, _ in taken:
        current = _layout(loaded)
        if runs and current == layout and not is_packed(loaded):  # packed rows are never stacked: pieces
            runs[-1].append(loaded)
        else:
            runs.append([loaded])
            layout = current
    joined = [concatenate(run) if len(run) > 1 else run[0] for run in runs]
    return joined[0] if len(joined) == 1 else Pieces(joined)


def logical_batches(data: Iterable[Any], batch_size: int, groups: Optional[Groups] = None) -> Iterator[Any]:
    """Re-cut the batches of `data` into batches of `batch_size` rows (the last one may be smaller).

    Batches that already have `batch_size` rows pass through untouched; smaller ones (a DataLoader with a
    small `batch_size` for cheap loading) are joined, larger ones cut. Batches whose tensors differ in shape
    beyond dim 0 are not joined: their logical batch is `Pieces` of them. `groups`: how the rows of a batch
    belong together (`groups=`); other than None or "rows", batches are neither cut nor joined row by row
    (`whole_batches`).
    """
    if rows_belong_together(groups):
        yield from whole_batches(data, batch_size, groups)  # type: ignore[arg-type]
        return
    pending: List[Tuple[Any, int]] = []
    pending_rows = 0
    for batch in data:
        n = rows(batch)
        if not pending and n == batch_size:
            yield batch
            continue
        pending.append((batch, n))
        pending_rows += n
        while pending_rows >= batch_size:
            wanted, taken = batch_size, []
            while wanted:
                loaded, count = pending.pop(0)
                if count <= wanted:
                    taken.append((loaded, count))
                    wanted -= count
                else:  # cut: the rest stays for the next logical batch
                    _check_cuttable(loaded, count, "")
                    taken.append((take(loaded, 0, wanted), wanted))
                    pending.insert(0, (take(loaded, wanted, count), count - wanted))
                    wanted = 0
            pending_rows -= batch_size
            yield _logical(taken)
    if pending:
        yield _logical(pending)


def whole_batches(data: Iterable[Any], batch_size: int, groups: Groups) -> Iterator[Any]:
    """Logical batches of whole loader batches, as many as `batch_size` rows hold (at least one): rows that belong
    together (DPO's chosen rows then their rejected rows, in-batch negatives) are laid out within each loader batch,
    so joined row by row they would pair rows of different batches. Several are `Pieces`, never stacked. A batch of
    more than `batch_size` rows is cut by pairs under "pairs" (each part chosen rows then their rejected rows), and
    refused under any other grouping (whose groups a cut could split)."""
    parts = ((batch, rows(batch)) for loaded in data for batch in _group_cuts(loaded, batch_size, groups))
    for run in _runs(parts, batch_size):
        yield run[0] if len(run) == 1 else Pieces(run)


def _runs(parts: Iterable[Tuple[Any, int]], batch_size: int) -> Iterator[List[Any]]:
    """Consecutive `(part, rows)` in runs of at most `batch_size` rows (a larger part alone), as many as fit."""
    run: List[Any] = []
    run_rows = 0
    for part, n in parts:
        if run and run_rows + n > batch_size:
            yield run
            run, run_rows = [], 0
        run.append(part)
        run_rows += n
        if run_rows == batch_size:
            yield run
            run, run_rows = [], 0
    if run:
        yield run


def _group_cuts(batch: Any, batch_size: int, groups: Groups) -> List[Any]:
    """`batch` in parts of at most `batch_size` rows that keep its groups whole: itself where it has no more rows;
    parts of whole pairs under "pairs"; a ValueError otherwise."""
    n = rows(batch)
    if n <= batch_size:
        return [batch]
    pairs = batch_size // 2
    if groups != "pairs" or pairs == 0 or is_packed(batch):
        raise ValueError(
            f"a batch of train_data has {n} rows, more than batch_size={batch_size}, and groups={group_label(groups)} "
            "says its rows belong together, so it is not cut: give the loader batches of at most batch_size rows, or "
            "a batch_size of at least the loader's"
        )
    grouped = grouped_batch((batch,), {}, "pairs")
    units = grouped.unit_count
    return [grouped.arguments(start, min(start + pairs, units))[0][0] for start in range(0, units, pairs)]


def group_cut_widths(width: int, batch_size: int, groups: Groups) -> List[int]:
    """The rows of the parts `whole_batches` cuts a loader batch of `width` rows into (as `_group_cuts`)."""
    if width <= batch_size or groups != "pairs" or batch_size < 2:
        return [width]
    part = batch_size // 2 * 2
    return [part] * (width // part) + ([width % part] if width % part else [])


def whole_batch_count(widths: Iterable[int], batch_size: int) -> int:
    """How many logical batches `whole_batches` makes of (already cut) loader batches of `widths` rows."""
    return sum(1 for _ in _runs(((None, n) for n in widths), batch_size))
