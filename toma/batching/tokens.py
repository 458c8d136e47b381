"""Rows by their length: a logical batch sorted longest first and packed into micro-batches whose padded area
(rows x the micro-batch's longest row) stays within a token budget, each trimmed to its own longest row.

A row's length comes from `lengths=`: the name of a 0/1 mask among the call's arguments (a keyword argument, or
a key of a dict argument, as a tokenizer's `attention_mask`), or a function of the call's arguments returning
each row's length. A tensor is trimmed only when it is padded like the rows: for a mask, its dim 1 is the mask's
width, and for a function, at least the longest row; and in every row, the positions past the row's length
(before it, with left padding) hold one and the same pad value (one pad vector for wider tensors). So a
`(rows, 16)` feature matrix whose width merely equals the mask's is left whole: its values there differ. Right
padding trims the tail. Left padding trims the head only where positions cannot move (`position_ids` given
beside the mask); otherwise the rows are only reordered, and an INFO line says so once.
"""

import logging
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch

from toma.batching.splitting import ArgumentBatch

__all__ = ["Lengths", "check_lengths", "TokenBatch", "TokenMicroBatch", "row_lengths", "token_batches", "restore_order"]

log = logging.getLogger("toma")

Lengths = Union[str, Callable[..., Any]]
TokenMicroBatch = Tuple[ArgumentBatch, int, int, int]
"""Rows `[start, stop)` of a sorted piece, trimmed to `width` positions."""

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
    head: Optional[bool]  # padding leads (left padding); None: not trimmed


def _find_mask(name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[torch.Tensor, Mapping]:
    """The mask named `name` and the mapping it was found in (the keyword arguments, or a dict argument)."""
    holders: List[Mapping] = [kwargs, *(arg for arg in args if isinstance(arg, Mapping))]
    for holder in holders:
        mask = holder.get(name)
        if isinstance(mask, torch.Tensor):
            if mask.dim() != 2:
                raise ValueError(f"lengths={name!r}: the mask must be (rows, width), got shape {tuple(mask.shape)}")
            return mask, holder
    raise ValueError(
        f"lengths={name!r}: no tensor {name!r} among the call's keyword arguments or in a dict argument; name the "
        "0/1 mask the batch carries, or pass a function that returns each row's length"
    )


def _say_once(text: str) -> None:
    if text not in _said:
        _said.add(text)
        log.info(text)


def _mask_layout(name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> _Layout:
    mask, holder = _find_mask(name, args, kwargs)
    present = mask.detach().to("cpu") != 0
    width = present.shape[1]
    positions = torch.arange(width)
    end = torch.where(present, positions, -1).max(1).values + 1  # one past the last real position
    begin = torch.where(present, positions, width).min(1).values  # the first real position
    used = present.any(1)
    right, left = bool((used & (end < width)).any()), bool((used & (begin > 0)).any())
    if left and not right:
        lengths = (width - begin).masked_fill(~used, 0).tolist()
        if "position_ids" in holder:
            return _Layout(lengths, width, True)
        _say_once(
            f"toma: the rows are left-padded ({name!r}) and no position_ids are given: rows are sorted by length "
            "but not trimmed, since dropping leading padding would move every position"
        )
        return _Layout(lengths, width, None)
    if left and right:
        _say_once(f"toma: the rows are padded on both sides ({name!r}): sorted by length but not trimmed")
        return _Layout(present.sum(1).tolist(), width, None)
    return _Layout(end.tolist(), width, False)


def row_lengths(lengths: Lengths, args: Tuple[Any, ...], kwargs: Dict[str, Any], rows: int) -> _Layout:
    """Each row's length (and how its padding lies) for a call's arguments."""
    if isinstance(lengths, str):
        layout = _mask_layout(lengths, args, kwargs)
    else:
        found = lengths(*args, **kwargs)
        values = found.detach().to("cpu").reshape(-1).tolist() if isinstance(found, torch.Tensor) else list(found)
        name = getattr(lengths, "__qualname__", repr(lengths))
        if len(values) != rows or any(not float(v) >= 0 or int(v) != v for v in values):
            raise ValueError(f"lengths ({name}) must return a whole length of at least 0 for each of the {rows} rows")
        layout = _Layout([int(v) for v in values], None, False)
    if len(layout.lengths) != rows:
        raise ValueError(f"lengths: the mask has {len(layout.lengths)} rows, the logical batch {rows}")
    return layout


def _padded_alike(tensor: torch.Tensor, lengths: torch.Tensor, head: bool) -> bool:
    """Whether every position past each row's length (before it, with `head`) holds one and the same value."""
    width = tensor.shape[1]
    positions = torch.arange(width, device=tensor.device)
    limits = lengths.to(tensor.device)
    padding = positions >= limits[:, None] if not head else positions < (width - limits)[:, None]
    values = tensor.detach()[padding]
    return values.shape[0] == 0 or bool((values == values[:1]).all())


def _trimmable(batch: ArgumentBatch, layout: _Layout, sorted_lengths: List[int]) -> Dict[int, bool]:
    """The ids of the sorted batch's tensors that are padded like its rows, each with whether padding leads."""
    if layout.head is None or not sorted_lengths:
        return {}
    longest, lengths = max(sorted_lengths), torch.tensor(sorted_lengths)
    trimmed: Dict[int, bool] = {}
    for _, tensor in batch.tensors:
        if tensor.dim() < 2 or tensor.is_sparse or tensor.requires_grad:
            continue
        if (tensor.shape[1] != layout.width) if layout.width is not None else (tensor.shape[1] < longest):
            continue
        if _padded_alike(tensor, lengths, layout.head):
            trimmed[id(tensor)] = layout.head
    return trimmed


class TokenBatch:
    """A piece of a logical batch with its rows sorted longest first (`batch`, a copy) and its padded tensors
    marked for trimming; `widths` are the sorted rows' lengths as a micro-batch's width counts them."""

    __slots__ = ("batch", "widths", "order")

    def __init__(self, piece: ArgumentBatch, lengths: Lengths) -> None:
        layout = row_lengths(lengths, piece.args, piece.kwargs, piece.size)
        self.order: List[int] = sorted(range(piece.size), key=lambda row: -layout.lengths[row])
        sorted_lengths = [layout.lengths[row] for row in self.order]
        self.batch = piece.take(self.order)
        self.batch.trimmed = _trimmable(self.batch, layout, sorted_lengths)
        if self.batch.trimmed:
            self.widths = [max(1, length) for length in sorted_lengths]
        else:  # nothing narrows: every micro-batch is as wide as the batch
            full = layout.width if layout.width is not None else max(1, max(sorted_lengths))
            self.widths = [full] * piece.size

    @property
    def cost(self) -> int:
        """The padded area of all its rows in one micro-batch."""
        return len(self.widths) * self.widths[0]

    def micro_batches(self, budget: int) -> List[TokenMicroBatch]:
        """Micro-batches of consecutive sorted rows, each within `budget` (a row longer than it, alone)."""
        found: List[TokenMicroBatch] = []
        start, rows = 0, len(self.widths)
        while start < rows:
            width = self.widths[start]
            stop = min(rows, start + max(1, budget // width))
            found.append((self.batch, start, stop, width))
            start = stop
        return found


def token_batches(pieces: Sequence[ArgumentBatch], lengths: Lengths) -> List[TokenBatch]:
    """Each piece of a logical batch sorted and marked (a micro-batch never spans two pieces)."""
    return [TokenBatch(piece, lengths) for piece in pieces]


def restore_order(order: Sequence[int]) -> List[int]:
    """The inverse of `order`: where each of the call's rows went."""
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return inverse
