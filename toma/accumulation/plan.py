"""An attempt's micro-batch plan: which rows each micro-batch gets at a size, and what its loss is multiplied by.

With `reduction="mean"` each micro-loss is weighted by its share of what the logical batch's loss averages
over: rows (n_i / N), or with `weight=` the count that function gives (label tokens, say), so the gradients
are those of one full-batch pass also when micro-batches hold different shares. A micro-batch that counts
nothing has no share and does not run.
"""

from numbers import Real
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from toma.batching.logical import LogicalBatch
from toma.batching.splitting import MicroBatch
from toma.batching.tokens import TokenPiece

__all__ = ["MicroBatchPlan", "Weighting", "NothingCounted", "nothing_counted", "shares", "counts"]

Arguments = Tuple[Tuple[Any, ...], Dict[str, Any]]


class NothingCounted(ValueError):
    """A logical batch whose `weight=` counts 0 items: its mean loss averages over nothing (in one full-batch pass
    it is NaN), so there is no gradient to weight. Raised before any forward pass on one process; with several, on
    every rank before the gradients' all-reduce when no rank counted anything. A framework whose step may skip such
    a batch (Lightning's `None`) catches it and runs the batch as the plain loop would."""


def nothing_counted(weight: Optional[Callable[..., Any]], rows: Optional[int] = None, ranks: int = 1) -> NothingCounted:
    """The error for a logical batch of `rows` rows (on each of `ranks` ranks) in which `weight` counted nothing."""
    name = "weight" if weight is None else f"weight ({getattr(weight, '__qualname__', repr(weight))})"
    where = "the logical batch" if rows is None else f"the logical batch of {rows} rows"
    if ranks > 1:
        where += f" on every one of the {ranks} ranks"
    return NothingCounted(
        f"{name} counted 0 items in {where}: its mean loss averages over nothing (in one full-batch pass it is "
        "NaN), so there is no gradient to weight. If the loss does average over something, weight must count it; "
        "a batch with nothing to learn from (every label padding) must be left out of the data"
    )


def counts(values: List[Any], weight: Callable[..., Any]) -> List[float]:
    """The micro-batches' counts as floats, with one device synchronisation for tensors on one device."""
    name = getattr(weight, "__qualname__", repr(weight))
    for value in values:
        if isinstance(value, torch.Tensor) and value.numel() != 1 or not isinstance(value, (torch.Tensor, Real)):
            shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise TypeError(
                f"weight ({name}) must return one count per micro-batch, a number or a one-element tensor; got {shown}"
            )
    tensors = [value for value in values if isinstance(value, torch.Tensor)]
    floats: List[float]
    if len(tensors) == len(values) and len({t.device for t in tensors}) == 1:
        floats = torch.stack([t.detach().reshape(()).to(torch.float64) for t in tensors]).tolist()
    else:
        floats = [float(value) for value in values]
    for value in floats:
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"weight ({name}) must return a count of at least 0 for every micro-batch, got {value}")
    return floats


def shares(counts: Sequence[float], total: float) -> List[Optional[float]]:
    """Each count's share of `total`; None for a count of 0 (a micro-batch with nothing to average over)."""
    return [count / total if count > 0 else None for count in counts]


class Weighting(NamedTuple):
    """How micro-losses are weighted: `mean` (else summed as they are), `weight` (what a micro-batch's mean
    averages over; None: its rows), `total` (what the counts are shares of; None: their sum), `ranks` (other
    ranks count too: a batch of this rank that counts nothing is not an error here)."""

    mean: bool
    weight: Optional[Callable[..., Any]] = None
    total: Any = None
    ranks: bool = False

    def factors(
        self, micro_batches: Sequence[MicroBatch], arguments: List[Arguments], rows: int
    ) -> Tuple[List[Optional[float]], float]:
        """What each micro-loss is multiplied by (None: it has nothing to average over), and the logical batch's
        weight (its rows, or the counts' sum)."""
        if not self.mean:
            return [1.0] * len(micro_batches), float(rows)
        weight = self.weight
        if weight is None:
            return [piece.rows_between(start, stop) / rows for piece, start, stop in micro_batches], float(rows)
        values = [weight(*args, **kwargs) for args, kwargs in arguments]
        if self.total is None:
            found = counts(values, weight)
            total = sum(found)
            if total == 0 and not self.ranks:  # with ranks, the others' items count too (sync.py)
                raise nothing_counted(weight, rows)
        else:  # the counts and the total in one device synchronisation
            *found, total = counts(values + [self.total], weight)
            if total == 0 and any(found):
                raise ValueError(f"total is 0, but the micro-batches count {sum(found)} items")
        return shares(found, total), sum(found)


class MicroBatchPlan:
    """An attempt at `size`: its micro-batches `(piece, start, stop)` (units: rows, groups or packed sequences),
    their arguments, and `running`, the `(index, factor)` of each micro-batch that runs (in order; its loss is
    multiplied by `factor`); `weight` is what the logical batch's loss averages over. With `tokens` (the pieces
    sorted by length, or cut between packed sequences), `size` is a token budget, each micro-batch is trimmed to its
    `widths` entry (None: not trimmed) and `areas` holds its padded tokens."""

    __slots__ = ("micro_batches", "widths", "areas", "arguments", "running", "weight")

    def __init__(
        self, batch: LogicalBatch, size: int, weighting: Weighting, tokens: Optional[List[TokenPiece]] = None
    ) -> None:
        self.widths: Optional[List[Optional[int]]] = None
        self.areas: Optional[List[int]] = None
        if tokens is None:
            self.micro_batches: List[MicroBatch] = batch.micro_batches(size)
            self.arguments: List[Arguments] = [
                piece.arguments(start, stop) for piece, start, stop in self.micro_batches
            ]
        else:
            packed = [(part, micro) for part in tokens for micro in part.micro_batches(size)]
            self.micro_batches = [(piece, start, stop) for _, (piece, start, stop, _) in packed]
            self.widths = [width for _, (*_, width) in packed]
            self.areas = [part.area_between(start, stop) for part, (_, start, stop, _) in packed]
            self.arguments = [piece.arguments(start, stop, width=width) for _, (piece, start, stop, width) in packed]
        factors, self.weight = weighting.factors(self.micro_batches, self.arguments, batch.size)
        self.running: List[Tuple[int, float]] = [(i, f) for i, f in enumerate(factors) if f is not None]
