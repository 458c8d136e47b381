"""A call's arguments as a logical batch, cut into micro-batches along the batch dimension (dim 0).

Every tensor with at least one dimension is part of the batch, also inside tuples, lists and dicts, and
all of them must agree on its size. A list or tuple of plain values (strings, ids, lists of tokens, 0-dim
tensors) whose length is that size holds one item per row (the rows' texts, as a DataLoader collates them)
and is split with them, also inside other lists, tuples and dicts. Everything else (numbers, strings,
other lists, modules, 0-dim tensors, and values wrapped in `whole`, such as a shape `(224, 224)` that
happens to have as many items as the batch has rows) goes to every micro-batch as it is. Micro-batches
are views: no copies.

The words, here and elsewhere in toma: a *logical batch* (`ArgumentBatch`) is cut into *micro-batches*
(`MicroBatch`: rows `[start, stop)`), each run on its own. A logical batch may also be made of *pieces* that
cannot be joined (loader batches padded to different widths, `toma.batching.batches.Pieces`):
`ArgumentPieces` cuts its micro-batches within each piece, never across two.
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from toma.batching.argument_scan import ArgumentScan
from toma.batching.nested import (
    is_row_sequence_candidate,
    leaves,
    map_tensors,
    place_whole,
    rebuild_mapping,
    rebuild_sequence,
    whole,
)

__all__ = [
    "whole",
    "ArgumentBatch",
    "ArgumentPieces",
    "MicroBatch",
    "map_tensors",
    "leaves",
    "is_row_sequence_candidate",
    "rebuild_mapping",
    "rebuild_sequence",
]


class ArgumentBatch:
    """A call's `(args, kwargs)` as a logical batch of `size` rows, cut into micro-batches `[start, stop)`."""

    __slots__ = (
        "args",
        "kwargs",
        "size",
        "tensors",
        "name",
        "_arg_slots",
        "_kwarg_slots",
        "_plain",
        "_changing",
        "_per_row",
        "trimmed",
    )

    def __init__(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], name: str = "args") -> None:
        scan = ArgumentScan()
        arg_hits = [scan.walk(arg, f"{name}[{i}]", []) for i, arg in enumerate(args)]
        kwarg_hits = {key: scan.walk(value, f"kwargs[{key!r}]", []) for key, value in kwargs.items()}
        size = scan.batch_size()
        per_row = scan.per_row(size)  # ids of the sequences that hold one item per row
        changing = scan.changing
        self.args, self.kwargs, self.size, self.tensors, self.name = args, kwargs, size, scan.tensors, name
        self._changing, self._per_row = changing, per_row
        # Which top-level arguments change per micro-batch, and whether each is a plain tensor (a fast slice).
        self._arg_slots = [
            (i, isinstance(arg, torch.Tensor)) for i, arg in enumerate(args) if arg_hits[i] or id(arg) in changing
        ]
        self._kwarg_slots = [
            (key, isinstance(value, torch.Tensor))
            for key, value in kwargs.items()
            if kwarg_hits[key] or id(value) in changing
        ]
        self._plain = all(is_tensor for _, is_tensor in self._arg_slots + self._kwarg_slots)
        # ids of the tensors padded at the end of dim 1, trimmed to a micro-batch's width (`toma.batching.tokens`)
        self.trimmed: Set[int] = set()

    @property
    def largest(self) -> int:
        """The rows of its largest piece: all of them (it is its only piece)."""
        return int(self.size)

    @property
    def pieces(self) -> List["ArgumentBatch"]:
        """Its pieces: itself alone (as `ArgumentPieces.pieces` lists several)."""
        return [self]

    def _trim(self, tensor: torch.Tensor, cut: torch.Tensor, width: Optional[int]) -> torch.Tensor:
        """`cut` (rows of `tensor`) narrowed to `width` positions along dim 1 when `tensor` is padded there."""
        if width is None or id(tensor) not in self.trimmed or width >= cut.shape[1]:
            return cut
        return cut[:, :width]

    def _cut(
        self, obj: Any, start: int, stop: int, rows: Optional[List[torch.Tensor]], width: Optional[int] = None
    ) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.dim() == 0:
                return obj
            cut = self._trim(obj, obj[start:stop], width)
            if rows is not None:
                rows.append(cut)
            return cut
        if isinstance(obj, whole):
            return obj.value
        if id(obj) not in self._changing:
            return obj
        if id(obj) in self._per_row:
            return obj[start:stop]
        if isinstance(obj, (tuple, list)):
            return rebuild_sequence(obj, [self._cut(item, start, stop, rows, width) for item in obj])
        return rebuild_mapping(obj, {key: self._cut(value, start, stop, rows, width) for key, value in obj.items()})

    def _take(self, obj: Any, order: List[int], index: Dict[torch.device, torch.Tensor]) -> Any:
        """`obj` with its rows in `order` (tensors gathered, per-row sequences reordered); the rest as it is."""
        if isinstance(obj, torch.Tensor):
            if obj.dim() == 0:
                return obj
            device = obj.device
            if device not in index:
                index[device] = torch.tensor(order, dtype=torch.long, device=device)
            return obj.index_select(0, index[device])
        if isinstance(obj, whole) or id(obj) not in self._changing:
            return obj
        if id(obj) in self._per_row:
            return type(obj)(obj[i] for i in order) if isinstance(obj, tuple) else [obj[i] for i in order]
        if isinstance(obj, (tuple, list)):
            return rebuild_sequence(obj, [self._take(item, order, index) for item in obj])
        return rebuild_mapping(obj, {key: self._take(value, order, index) for key, value in obj.items()})

    def take(self, order: Sequence[int]) -> "ArgumentBatch":
        """The same arguments with the rows in `order` (a permutation of the rows): a new batch of copies."""
        rows = list(order)
        index: Dict[torch.device, torch.Tensor] = {}
        args = tuple(self._take(arg, rows, index) for arg in self.args)
        kwargs = {key: self._take(value, rows, index) for key, value in self.kwargs.items()}
        return ArgumentBatch(args, kwargs, self.name)

    def _fill(
        self,
        container: Any,
        slots: List[Tuple[Any, bool]],
        start: int,
        stop: int,
        full: bool,
        rows: Optional[List[torch.Tensor]],
        width: Optional[int] = None,
    ) -> Any:
        """Replace `container[slot]` by its micro-batch for each slot (a plain tensor needs no slicing when full)."""
        for slot, is_tensor in slots:
            if not is_tensor:
                container[slot] = self._cut(container[slot], start, stop, rows, width)
                continue
            if not full:
                container[slot] = container[slot][start:stop]
            if width is not None:
                container[slot] = self._trim(self._source(slot), container[slot], width)
            if rows is not None:
                rows.append(container[slot])
        return container

    def _source(self, slot: Any) -> Any:
        """The call's own argument in `slot` (an index into args, or a keyword)."""
        return self.args[slot] if isinstance(slot, int) else self.kwargs[slot]

    def arguments(
        self, start: int, stop: int, rows: Optional[List[torch.Tensor]] = None, width: Optional[int] = None
    ) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """The arguments for rows `[start, stop)`; the call's own arguments when that is all of them. `rows`,
        when given, receives the micro-batch's split tensors (its per-row data, as opposed to what every
        micro-batch shares), for a caller that moves them apart. `width`: the tensors in `trimmed` are narrowed
        to that many positions along dim 1 (a micro-batch of rows no longer than it)."""
        args, kwargs = self.args, self.kwargs
        full = start == 0 and stop >= self.size
        if full and self._plain and (width is None or not self.trimmed):
            if rows is not None:
                rows.extend(tensor for _, tensor in self.tensors)
            return args, kwargs
        if self._arg_slots:
            args = tuple(self._fill(list(args), self._arg_slots, start, stop, full, rows, width))
        if self._kwarg_slots:
            kwargs = self._fill(dict(kwargs), self._kwarg_slots, start, stop, full, rows, width)
        return args, kwargs

    def placed(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "ArgumentBatch":
        """This batch with every tensor inside a `whole` replaced by `move(tensor)`, so that a caller moving
        micro-batches to a device moves what they all share once; itself when nothing changes."""
        args = tuple(place_whole(arg, move, False) for arg in self.args)
        kwargs = {key: place_whole(value, move, False) for key, value in self.kwargs.items()}
        if all(new is old for new, old in zip(args, self.args)) and all(
            kwargs[key] is value for key, value in self.kwargs.items()
        ):
            return self
        placed = ArgumentBatch(args, kwargs, self.name)
        placed.trimmed = self.trimmed  # the split tensors are the same: only `whole` values moved
        return placed

    unit_name = "rows"  # what its units are called in messages

    @property
    def unit_count(self) -> int:
        """What micro-batches are cut into: its rows."""
        return int(self.size)

    def rows_between(self, start: int, stop: int) -> int:
        """The rows of micro-batch `[start, stop)` (its units are rows)."""
        return stop - start

    def micro_batches(self, size: int) -> List["MicroBatch"]:
        """The micro-batches `(self, start, stop)` of at most `size` rows that cover the batch. No row is left alone
        where two micro-batches can share it (a one-row micro-batch is what BatchNorm cannot train on): a remainder
        of one row and the micro-batch before it split their `size + 1` rows evenly."""
        starts = list(range(0, self.size, size))
        if size > 2 and len(starts) > 1 and self.size - starts[-1] == 1:
            starts[-1] -= size // 2
        stops = starts[1:] + [self.size]
        return [(self, start, stop) for start, stop in zip(starts, stops)]

    def describe(self, limit: int = 4) -> str:
        """The split tensors, as `args[0] (64, 6), args[1] (64,)`, for messages."""
        shown = ", ".join(f"{path} {tuple(tensor.shape)}" for path, tensor in self.tensors[:limit])
        return shown + (", ..." if len(self.tensors) > limit else "")


MicroBatch = Tuple[Any, int, int]
"""One micro-batch: units `[start, stop)` of a piece of the logical batch (an `ArgumentBatch`'s rows, a
`toma.batching.groups.GroupedBatch`'s groups, a `toma.batching.packed.PackedBatch`'s sequences)."""


class ArgumentPieces:
    """A logical batch in pieces, an `ArgumentBatch` each (loader batches of different shapes): micro-batches
    are cut within each piece and never span two, so no piece needs padding to another's shape."""

    __slots__ = ("pieces", "size", "largest")

    def __init__(self, pieces: Sequence[Any]) -> None:
        """`pieces`: `ArgumentBatch`es, or the other kinds of logical batch (`toma.batching.logical.Piece`)."""
        if not pieces:
            raise ValueError("a logical batch needs at least one piece")
        self.pieces = list(pieces)
        self.size = sum(piece.size for piece in self.pieces)
        self.largest = max(piece.size for piece in self.pieces)

    def micro_batches(self, size: int) -> List[MicroBatch]:
        """The micro-batches of at most `size` rows that cover every piece, piece by piece."""
        return [micro for piece in self.pieces for micro in piece.micro_batches(size)]

    def describe(self, limit: int = 4) -> str:
        return self.pieces[0].describe(limit)
