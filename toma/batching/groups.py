"""Rows that belong together: a logical batch whose micro-batches hold whole groups of rows.

Some losses relate rows to each other. DPO's batch (and a reward model's) holds the chosen rows first and the
rejected rows second, and the loss pairs them by halving it; a listwise or grouped loss needs a whole group. Cut
by rows, such a batch trains something else without a word. `groups=` says how rows belong together:

- `"rows"`: each row on its own, declared so (nothing is checked);
- `"pairs"`: row i with row i + n/2, the chosen-then-rejected layout. Tensors (and per-row lists) of n/2 rows hold
  one value per pair (DPO's reference log-probabilities, a reward margin) and go with their pair;
- `"batch"`: every row with every other (in-batch negatives): the batch is never split;
- a function called like the loss function that returns each row's group (a tensor or list of n ids; rows with
  the same id belong together).

A micro-batch holds whole groups, and its rows keep the order they have in the batch: a micro-batch of pairs is
its chosen rows then their rejected rows, so halving it pairs them as halving the batch does. Its arguments are
gathered rows (copies), except when it holds the whole batch: then they are the call's own.
"""

from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch

from toma.batching.nested import returned_per_row
from toma.batching.splitting import (
    ArgumentBatch,
    MicroBatch,
    is_row_sequence_candidate,
    rebuild_mapping,
    rebuild_sequence,
    whole,
)

__all__ = [
    "Groups",
    "GROUPINGS",
    "check_groups",
    "GroupedBatch",
    "grouped_batch",
    "group_label",
    "rows_belong_together",
]

Groups = Union[str, Callable[..., Any]]
GROUPINGS = ("rows", "pairs", "batch")


def check_groups(groups: Any, name: str) -> Optional[Groups]:
    """`groups=`: None, "rows", "pairs", "batch", or a function of the call's arguments giving each row's group."""
    if groups is None or callable(groups) or groups in GROUPINGS:
        return groups  # type: ignore[no-any-return]
    raise ValueError(
        f"{name} must be 'rows' (each row on its own), 'pairs' (row i with row i + n/2, as DPO's chosen and "
        "rejected rows), 'batch' (the batch is never split), or a function of the call's arguments returning each "
        f"row's group; got {groups!r}"
    )


def rows_belong_together(groups: Optional[Groups]) -> bool:
    """Whether `groups` ties rows to each other (anything but None or "rows"): then they are never cut apart."""
    return groups is not None and groups != "rows"


def group_label(groups: Optional[Groups]) -> str:
    """What a message calls a grouping."""
    if groups is None or isinstance(groups, str):
        return repr(groups)
    return getattr(groups, "__qualname__", repr(groups))


class _Found:
    """The batch's tensors and per-row lists, with the row count each has."""

    def __init__(self) -> None:
        self.tensors: List[Tuple[str, torch.Tensor]] = []
        self.sequences: List[Tuple[str, Any]] = []

    def walk(self, obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.dim() > 0:
                self.tensors.append((path, obj))
        elif isinstance(obj, whole):
            return
        elif isinstance(obj, (list, tuple)):
            if is_row_sequence_candidate(obj):
                if obj:
                    self.sequences.append((path, obj))
                return
            for index, item in enumerate(obj):
                self.walk(item, f"{path}[{index}]")
        elif isinstance(obj, Mapping):
            for key, value in obj.items():
                self.walk(value, f"{path}[{key!r}]")


def _group_units(ids: Any, rows: int, name: str) -> List[List[int]]:
    """Rows by group id: each group's rows in batch order, groups in the order of their first row."""
    values = returned_per_row(ids, f"groups ({name})", "a group id")
    if len(values) != rows:
        raise ValueError(f"groups ({name}) must return one group id for each of the {rows} rows, got {len(values)}")
    units: Dict[Any, List[int]] = {}
    for row, value in enumerate(values):
        try:
            units.setdefault(value, []).append(row)
        except TypeError:
            raise TypeError(
                f"groups ({name}) must return hashable group ids (numbers, strings), got {value!r}"
            ) from None
    return list(units.values())


class GroupedBatch:
    """A call's arguments as a logical batch of `rows` rows in `units` (each a list of rows, in batch order); a
    micro-batch is units `[start, stop)`. `per_unit`: with pairs, tensors of `len(units)` rows hold one value per
    unit. `trimmed`: ids of the tensors narrowed to a micro-batch's width (token packing)."""

    __slots__ = ("args", "kwargs", "name", "rows", "units", "tensors", "per_unit", "trimmed", "_before", "_numbers")

    def __init__(
        self,
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
        units: List[List[int]],
        rows: int,
        tensors: List[Tuple[str, torch.Tensor]],
        per_unit: bool = False,
        name: str = "args",
    ) -> None:
        self.args, self.kwargs, self.units, self.rows, self.tensors = args, kwargs, units, rows, tensors
        self.per_unit, self.name = per_unit, name
        self.trimmed: Set[int] = set()
        self._numbers: Optional[List[int]] = None  # each unit's number in the batch, once reordered
        self._before = [0]  # rows before each unit
        for unit in units:
            self._before.append(self._before[-1] + len(unit))

    @property
    def size(self) -> int:
        """Its rows (what a share by rows is a share of; micro-batches are cut into `units`)."""
        return self.rows

    unit_name = "groups"  # what its units are called in messages

    @property
    def unit_count(self) -> int:
        """What micro-batches are cut into: its groups."""
        return len(self.units)

    @property
    def largest(self) -> int:
        """The rows of its largest piece: all of them."""
        return self.rows

    @property
    def pieces(self) -> List["GroupedBatch"]:
        return [self]

    def rows_between(self, start: int, stop: int) -> int:
        """The rows of units `[start, stop)`."""
        return self._before[stop] - self._before[start]

    def reordered(self, order: Sequence[int]) -> "GroupedBatch":
        """The same batch with its units in `order` (for packing by length; no data is copied). Per-unit values
        follow their units."""
        numbers = list(range(len(self.units))) if self._numbers is None else self._numbers
        reordered = GroupedBatch(
            self.args, self.kwargs, [self.units[i] for i in order], self.rows, self.tensors, self.per_unit, self.name
        )
        reordered._numbers = [numbers[i] for i in order]
        reordered.trimmed = self.trimmed
        return reordered

    def micro_batches(self, size: int) -> List[MicroBatch]:
        """Consecutive units of at most `size` rows together (a unit larger than that, alone)."""
        found: List[MicroBatch] = []
        start = 0
        while start < len(self.units):
            stop = start + 1
            while stop < len(self.units) and self._before[stop + 1] - self._before[start] <= size:
                stop += 1
            found.append((self, start, stop))  # type: ignore[arg-type]
            start = stop
        return found

    def row_indices(self, start: int, stop: int) -> List[int]:
        """The rows of units `[start, stop)`, in batch order."""
        return sorted(row for unit in self.units[start:stop] for row in unit)

    def arguments(
        self, start: int, stop: int, rows: Optional[List[torch.Tensor]] = None, width: Optional[int] = None
    ) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """The arguments for units `[start, stop)`: their rows gathered in batch order (the call's own arguments
        when that is every row); tensors in `trimmed` narrowed to `width` positions."""
        if start == 0 and stop >= len(self.units) and (width is None or not self.trimmed):
            if rows is not None:
                rows.extend(tensor for _, tensor in self.tensors)
            return self.args, self.kwargs
        picked = self.row_indices(start, stop)
        units = self._unit_indices(start, stop)
        cut = _Cut(self.rows, len(self.units) if self.per_unit else None, picked, units, self.trimmed, width, rows)
        args = tuple(cut(arg) for arg in self.args)
        kwargs = {key: cut(value) for key, value in self.kwargs.items()}
        return args, kwargs

    def _unit_indices(self, start: int, stop: int) -> List[int]:
        """The batch's numbers of units `[start, stop)`, in batch order (for per-unit values)."""
        if self._numbers is None:
            return list(range(start, stop))
        return sorted(self._numbers[start:stop])

    def placed(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "GroupedBatch":
        """Itself: `toma.whole` values are few here, and they move with each micro-batch."""
        return self

    def describe(self, limit: int = 4) -> str:
        shown = ", ".join(f"{path} {tuple(tensor.shape)}" for path, tensor in self.tensors[:limit])
        return shown + (", ..." if len(self.tensors) > limit else "")


class _Cut:
    """Gathers a micro-batch's rows out of one argument: tensors and per-row lists of `rows` rows by row, those of
    `units` rows (pairs) by unit; everything else as it is."""

    def __init__(
        self,
        rows: int,
        units: Optional[int],
        picked: List[int],
        unit_picked: List[int],
        trimmed: Set[int],
        width: Optional[int],
        collected: Optional[List[torch.Tensor]],
    ) -> None:
        self.rows, self.units, self.picked, self.unit_picked = rows, units, picked, unit_picked
        self.trimmed, self.width, self.collected = trimmed, width, collected
        self._index: Dict[Tuple[torch.device, bool], torch.Tensor] = {}

    def _positions(self, device: torch.device, by_unit: bool) -> torch.Tensor:
        key = (device, by_unit)
        if key not in self._index:
            self._index[key] = torch.tensor(
                self.unit_picked if by_unit else self.picked, dtype=torch.long, device=device
            )
        return self._index[key]

    def __call__(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.dim() == 0:
                return obj
            by_unit = obj.shape[0] != self.rows
            cut = obj.index_select(0, self._positions(obj.device, by_unit))
            if self.width is not None and id(obj) in self.trimmed and self.width < cut.shape[1]:
                cut = cut[:, : self.width]
            if self.collected is not None:
                self.collected.append(cut)
            return cut
        if isinstance(obj, whole):
            return obj.value
        if isinstance(obj, (list, tuple)):
            if is_row_sequence_candidate(obj):
                if len(obj) == self.rows:
                    picked = [obj[i] for i in self.picked]
                elif self.units is not None and len(obj) == self.units:
                    picked = [obj[i] for i in self.unit_picked]
                else:  # not the rows' own: per-row lists may sit inside (a tuple of ids and texts)
                    return rebuild_sequence(
                        obj, [self(item) if isinstance(item, (list, tuple)) else item for item in obj]
                    )
                return picked if isinstance(obj, list) else tuple(picked)
            return rebuild_sequence(obj, [self(item) for item in obj])
        if isinstance(obj, Mapping):
            return rebuild_mapping(obj, {key: self(value) for key, value in obj.items()})
        return obj


def grouped_batch(
    args: Tuple[Any, ...], kwargs: Dict[str, Any], groups: Optional[Groups], name: str = "args"
) -> Union[ArgumentBatch, GroupedBatch]:
    """The logical batch of a call's arguments under `groups` (see the module's docstring): an `ArgumentBatch` for
    rows on their own, else a `GroupedBatch`."""
    if not rows_belong_together(groups):
        return ArgumentBatch(args, kwargs, name)
    if groups != "pairs":
        batch = ArgumentBatch(args, kwargs, name)  # every tensor has the batch's rows
        rows = int(batch.size)
        if groups == "batch":
            units = [list(range(rows))]
        else:
            assert callable(groups)
            units = _group_units(groups(*args, **kwargs), rows, getattr(groups, "__qualname__", repr(groups)))
        return GroupedBatch(args, kwargs, units, rows, batch.tensors, False, name)
    found = _Found()
    for index, arg in enumerate(args):
        found.walk(arg, f"{name}[{index}]")
    for key, value in kwargs.items():
        found.walk(value, f"kwargs[{key!r}]")
    if not found.tensors:
        raise ValueError("groups='pairs': no tensor argument with a batch dimension to split")
    rows = max(tensor.shape[0] for _, tensor in found.tensors)
    if rows % 2:
        raise ValueError(
            f"groups='pairs' pairs row i with row i + n/2, so the batch needs an even number of rows; "
            f"{found.tensors[0][0]} has {rows}"
        )
    half = rows // 2
    wrong = [(path, t.shape[0]) for path, t in found.tensors if t.shape[0] not in (rows, half)]
    if wrong:
        shown = ", ".join(f"{path} has {count}" for path, count in wrong)
        raise ValueError(
            f"groups='pairs': every tensor holds one row per row ({rows}) or one per pair ({half}), but {shown}; "
            "wrap arguments that are not part of the batch in toma.whole(...)"
        )
    units = [[i, i + half] for i in range(half)]
    per_unit = any(t.shape[0] == half for _, t in found.tensors) or any(
        _holds_length(s, half) for _, s in found.sequences
    )
    return GroupedBatch(args, kwargs, units, rows, found.tensors, per_unit and half != rows, name)


def _holds_length(sequence: Any, length: int) -> bool:
    """Whether `sequence`, or a list or tuple inside it (not inside one of `length` items), has `length` items:
    lists of other lengths go to every micro-batch whole, as a shape or a tag does."""
    if len(sequence) == length:
        return True
    return any(isinstance(item, (list, tuple)) and item and _holds_length(item, length) for item in sequence)
