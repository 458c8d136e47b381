"""Rows by their length: a logical batch sorted longest first and packed into micro-batches whose padded area
(rows x the micro-batch's longest row) stays within a token budget, each trimmed to its own longest row. A
micro-batch is split before it is full only where the padding the split saves is worth more than one more
micro-batch costs (`toma.batching.micro_batch_cost`: measured on the device, in padded positions).

A row's length comes from `lengths=`: the name of a 0/1 mask among the call's arguments (a keyword argument, or
a key of a dict argument, as a tokenizer's `attention_mask`), or a function of the call's arguments returning
each row's length. The tensors as wide as the rows (for a mask, its width; for a function, at least the longest
row) are trimmed only when every one of them is padded like the rows: past each row's length it holds one and
the same pad value (one pad vector for wider tensors). So a `(rows, 16)` feature matrix whose width merely equals
the mask's is never trimmed: its values there differ, and then nothing is (an INFO line names it), since trimming
the others alone would misalign them. Right padding trims the tail. Left-padded rows are sorted but not trimmed, and an INFO line says why once: dropping
leading padding moves the positions, and even with `position_ids` given, a causal LM's loss counts the first
real token as predicted from the padding before it, whose output depends on how much padding there is.
"""

import logging
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch

from toma.batching.groups import GroupedBatch
from toma.batching.micro_batch_cost import MicroBatchCost
from toma.batching.nested import returned_per_row
from toma.batching.packed import PackedBatch, PackedTokens
from toma.batching.splitting import ArgumentBatch

__all__ = [
    "Lengths",
    "check_lengths",
    "TokenBatch",
    "TokenPiece",
    "TokenMicroBatch",
    "row_lengths",
    "token_batches",
    "restore_order",
]

log = logging.getLogger("toma")

Lengths = Union[str, Callable[..., Any]]
TokenMicroBatch = Tuple[Any, int, int, Optional[int]]
"""Units `[start, stop)` of a sorted piece (its `batch`), trimmed to `width` positions (None: not trimmed)."""

_said: Set[str] = set()  # the INFO lines said once per process


def check_lengths(lengths: Any, name: str) -> Optional[Lengths]:
    """`lengths=`: None, the name of a 0/1 mask among the call's arguments, or a function of them."""
    if lengths is None or callable(lengths) or (isinstance(lengths, str) and lengths):
        return lengths  # type: ignore[no-any-return]
    raise TypeError(
        f"{name} must be the name of a 0/1 mask among the call's arguments (such as 'attention_mask'), or a "
        f"function called with the call's arguments that returns each row's length; got {lengths!r}"
    )


class _Layout(NamedTuple):
    lengths: List[int]  # each row's extent, in the call's order
    width: Optional[int]  # the mask's width (None: from a function)
    trims: bool  # right padding: trailing positions can go


def _find_mask(name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> torch.Tensor:
    """The mask named `name` among the keyword arguments, or in a dict argument."""
    holders: List[Mapping] = [kwargs, *(arg for arg in args if isinstance(arg, Mapping))]
    for holder in holders:
        mask = holder.get(name)
        if isinstance(mask, torch.Tensor):
            if mask.dim() != 2:
                raise ValueError(f"lengths={name!r}: the mask must be (rows, width), got shape {tuple(mask.shape)}")
            return mask
    raise ValueError(
        f"lengths={name!r}: no tensor {name!r} among the call's keyword arguments or in a dict argument; name the "
        "0/1 mask the batch carries, or pass a function that returns each row's length"
    )


def _say_once(text: str) -> None:
    if text not in _said:
        _said.add(text)
        log.info(text)


def _mask_layout(name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> _Layout:
    mask = _find_mask(name, args, kwargs).detach().to("cpu")
    present = mask != 0
    if mask.dtype != torch.bool and not bool((present == (mask == 1)).all()):
        found = sorted({int(v) if float(v).is_integer() else float(v) for v in mask.unique()[:6].tolist()})
        raise ValueError(
            f"lengths={name!r} must name a 0/1 mask (1: a real token, 0: padding), but {name!r} holds other values "
            f"({', '.join(map(str, found))}, ...): token ids or labels are not a mask; name the attention mask"
        )
    width = present.shape[1]
    positions = torch.arange(width)
    end = torch.where(present, positions, -1).max(1).values + 1  # one past the last real position
    begin = torch.where(present, positions, width).min(1).values  # the first real position
    used = present.any(1)
    if not bool((used & (begin > 0)).any()):
        return _Layout(end.tolist(), width, True)
    _say_once(
        f"toma: the rows of {name!r} do not all begin at position 0 (left padding): they are sorted by length but "
        "not trimmed, since dropping leading padding moves the positions, and a causal LM's loss counts the first "
        "real token as predicted from the padding before it"
    )
    return _Layout(present.sum(1).tolist(), width, False)


def row_lengths(lengths: Lengths, args: Tuple[Any, ...], kwargs: Dict[str, Any], rows: int) -> _Layout:
    """Each row's length (and how its padding lies) for a call's arguments."""
    if isinstance(lengths, str):
        layout = _mask_layout(lengths, args, kwargs)
    else:
        found = lengths(*args, **kwargs)
        name = getattr(lengths, "__qualname__", repr(lengths))
        values = returned_per_row(found, f"lengths ({name})", "a length")
        if len(values) != rows or any(not float(v) >= 0 or int(v) != v for v in values):
            raise ValueError(f"lengths ({name}) must return a whole length of at least 0 for each of the {rows} rows")
        layout = _Layout([int(v) for v in values], None, True)
    if len(layout.lengths) != rows:
        raise ValueError(f"lengths: the mask has {len(layout.lengths)} rows, the logical batch {rows}")
    return layout


def _padded_alike(tensor: torch.Tensor, lengths: torch.Tensor) -> bool:
    """Whether every position past each row's length holds one and the same value (or vector)."""
    positions = torch.arange(tensor.shape[1], device=tensor.device)
    values = tensor.detach()[positions >= lengths.to(tensor.device)[:, None]]
    return values.shape[0] == 0 or bool((values == values[:1]).all())


def _trimmable(batch: Union[ArgumentBatch, GroupedBatch], layout: _Layout, sorted_lengths: List[int]) -> Set[int]:
    """The ids of the sorted batch's tensors as wide as its rows, when every one of them is padded like the rows;
    none when one is not (trimming some and not others would misalign a micro-batch's tensors)."""
    if not layout.trims or not sorted_lengths:
        return set()
    longest, lengths = max(sorted_lengths), torch.tensor(sorted_lengths)
    trimmed: Set[int] = set()
    for path, tensor in batch.tensors:
        if (
            tensor.dim() < 2
            or tensor.shape[1] < longest
            or (layout.width is not None and tensor.shape[1] != layout.width)
        ):
            continue
        if tensor.is_sparse or tensor.requires_grad or not _padded_alike(tensor, lengths):
            _say_once(
                f"toma: {path} is as wide as the rows but not padded like them (past each row's length it does not "
                "hold one pad value): the rows are sorted by length, nothing is trimmed. Pass a tensor that is not "
                "per position in toma.whole(...), or pad it"
            )
            return set()
        trimmed.add(id(tensor))
    return trimmed


class TokenBatch:
    """A piece of a logical batch with its units (rows, or a `GroupedBatch`'s groups) sorted longest first
    (`batch`: for rows a sorted copy, for groups the same rows in sorted groups) and its padded tensors marked for
    trimming; `widths` are the sorted units' lengths as a micro-batch's width counts them (a group's: its longest
    row's), `rows` the rows of each sorted unit."""

    __slots__ = ("batch", "source", "widths", "order", "width", "cost", "rows", "_widths", "_before")

    def __init__(
        self, piece: Union[ArgumentBatch, GroupedBatch], lengths: Lengths, cost: Optional[MicroBatchCost] = None
    ) -> None:
        self.cost = MicroBatchCost() if cost is None else cost
        self.source = piece  # as the call gave it: a micro-batch of all of it is the call's own arguments
        rows = piece.rows if isinstance(piece, GroupedBatch) else piece.size
        layout = row_lengths(lengths, piece.args, piece.kwargs, rows)
        if isinstance(piece, GroupedBatch):
            unit_lengths = [max(layout.lengths[row] for row in unit) for unit in piece.units]
            self.order: List[int] = sorted(range(len(unit_lengths)), key=lambda unit: -unit_lengths[unit])
            sorted_lengths = [unit_lengths[unit] for unit in self.order]
            self.rows = [len(piece.units[unit]) for unit in self.order]
            trimmed = _trimmable(piece, layout, layout.lengths)
            self.batch: Union[ArgumentBatch, GroupedBatch] = piece.reordered(self.order)
        else:
            self.order = sorted(range(rows), key=lambda row: -layout.lengths[row])
            sorted_lengths = [layout.lengths[row] for row in self.order]
            self.rows = [1] * rows
            self.batch = piece.take(self.order)
            trimmed = _trimmable(self.batch, layout, sorted_lengths)
        self.batch.trimmed = trimmed
        # the rows' padded width: what a trimmed output is padded back to
        self.width = layout.width if layout.width is not None else max([1, *sorted_lengths])
        if trimmed:
            self.widths = [max(1, length) for length in sorted_lengths]
        else:  # nothing narrows: every micro-batch is as wide as the batch
            full = layout.width if layout.width is not None else max(1, max(sorted_lengths))
            self.widths = [full] * len(sorted_lengths)
        self._widths = torch.tensor(self.widths, dtype=torch.long)
        self._before = torch.tensor([0, *self.rows], dtype=torch.long).cumsum(0)  # rows before each sorted unit

    @property
    def area(self) -> int:
        """The padded area of all its rows in one micro-batch."""
        return int(self._before[-1]) * self.widths[0]

    @property
    def longest(self) -> int:
        """The longest row's length (as a micro-batch's width counts it)."""
        return self.widths[0]

    def area_between(self, start: int, stop: int) -> int:
        """The padded area of sorted units `[start, stop)` in one micro-batch."""
        return int(self._before[stop] - self._before[start]) * self.widths[start]

    def stop(self, start: int, budget: int) -> int:
        """Where a micro-batch from sorted unit `start` ends: as many units as `budget` allows, unless splitting
        it saves more padding than one more micro-batch costs (then at the split that saves the most, and so on
        within the part before it). Units `j..end` padded to the longest row `L` instead of their own micro-batch's
        `widths[j]` waste `(L - widths[j]) x (their rows)` positions. While the cost is being measured,
        micro-batches from odd units get a quarter of the budget (the line needs areas that differ)."""
        widths, before = self.widths, self._before
        if self.cost.timing and start % 2:  # areas that differ, for the cost's line: a quarter budget
            budget = max(1, budget // 4)
        fits = int(before[start]) + max(1, budget // widths[start])  # the rows before the end, at most
        end = max(start + 1, int(torch.searchsorted(before, fits, right=True)) - 1)
        end = min(end, len(widths))
        if end <= start + 1 or widths[end - 1] == widths[start]:
            return end
        overhead = self.cost.overhead(budget)
        while end > start + 1:
            after = before[end] - before[start + 1 : end]  # the rows from each unit to the end
            saved = (widths[start] - self._widths[start + 1 : end]) * after
            best = int(saved.argmax())
            if int(saved[best]) <= overhead:
                break
            end = start + 1 + best
        return end

    def micro_batches(self, budget: int) -> List[TokenMicroBatch]:
        """Micro-batches of consecutive sorted units, each within `budget` (a unit larger than it, alone). One that
        holds every unit is the piece as the call gave it, unsorted and untrimmed: what a plain call computes."""
        found: List[TokenMicroBatch] = []
        start, units = 0, len(self.widths)
        while start < units:
            stop = self.stop(start, budget)
            found.append((self.batch, start, stop, self.widths[start]))
            start = stop
        if len(found) == 1:
            return [(self.source, 0, self.source.unit_count, None)]
        return found


TokenPiece = Union[TokenBatch, PackedTokens]
"""A piece of a logical batch by tokens: `batch` (what gives a micro-batch's arguments), `area`, `longest`,
`cost`, `area_between(start, stop)` and `micro_batches(budget)`."""


def token_batches(
    pieces: Sequence[Union[ArgumentBatch, GroupedBatch, PackedBatch]], lengths: Lengths, cost: MicroBatchCost
) -> List[TokenPiece]:
    """Each piece of a logical batch sorted and marked, or, padding-free, cut between its sequences (a micro-batch
    never spans two pieces)."""
    return [
        PackedTokens(piece) if isinstance(piece, PackedBatch) else TokenBatch(piece, lengths, cost) for piece in pieces
    ]


def restore_order(order: Sequence[int]) -> List[int]:
    """The inverse of `order`: where each of the call's rows went."""
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return inverse
