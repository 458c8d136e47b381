"""What a LightningModule logs during the micro-batches of one logical batch, logged once for the logical batch.

`self.log` (and `self.log_dict`, which calls it) is captured while the micro-batches run, then replayed through
Lightning's own `log` with each value combined over the micro-batches into the logical batch's. A value that is
the loss the step returns (the same tensor) is combined as the loss is: added up under `reduction="sum"`, each
micro-batch's weighted by its share of the rows (or of `weight=`'s count) under "mean". Any other value by its
`reduce_fx`: "mean" (the default) weighted by those shares too, "max", "min" and "sum" as they say. Nothing is
logged by a failed attempt (its entries are dropped with its gradients), and no `sync_dist` collective runs inside
the region toma may retry. Lightning checks every call when it is replayed: its own errors for a bad value or
option reach the training step as in a plain run.
"""

import inspect
import numbers
from typing import Any, Callable, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import torch

from toma.batching.batches import rows

__all__ = ["StepLogs"]

# LightningModule.log(name, value, prog_bar, logger, ...): the options after the value, in order
_SIGNATURE = inspect.signature(pl.LightningModule.log)
_OPTIONS: Tuple[str, ...] = tuple(_SIGNATURE.parameters)[3:]
_OPTION_NAMES = frozenset(_OPTIONS)

_REDUCTIONS: Dict[Any, str] = {
    "mean": "mean",
    "avg": "mean",
    torch.mean: "mean",
    "max": "max",
    torch.max: "max",
    max: "max",
    "min": "min",
    torch.min: "min",
    min: "min",
    "sum": "sum",
    torch.sum: "sum",
    sum: "sum",
}


class _Part:
    """The data of a micro-batch whose step logged something, and what its loss averages over (rows, or
    `weight=`'s count), counted once for all its values when a replay needs it."""

    __slots__ = ("data", "count")

    def __init__(self, data: Any) -> None:
        self.data, self.count = data, 0.0


class _Entry:
    """One `self.log` call of one micro-batch: its value and options (keyword arguments, as Lightning names them).
    `key`: the name and which call with that name it is in its micro-batch (0 for the first), so that a name
    logged twice in a step is replayed twice and Lightning sees what a plain run shows it. `source`: the value as
    logged, until the step returns; `is_loss`: whether it is the loss the step returned."""

    __slots__ = ("key", "value", "options", "part", "source", "is_loss")

    def __init__(self, key: Tuple[str, int], value: Any, options: Dict[str, Any], part: _Part, source: Any) -> None:
        self.key, self.value, self.options, self.part = key, value, options, part
        self.source, self.is_loss = source, False


def _options(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """`log`'s options as keywords; a call Lightning's `log` would refuse raises its TypeError here, as it would."""
    if not args and _OPTION_NAMES.issuperset(kwargs):
        return kwargs
    bound = _SIGNATURE.bind(None, "name", None, *args, **kwargs)
    return {key: value for key, value in bound.arguments.items() if key in _OPTION_NAMES}


def _reduction(reduce_fx: Any) -> Optional[str]:
    """The reduction Lightning accepts as "mean", "max", "min" or "sum"; None for any other (Lightning refuses it)."""
    if isinstance(reduce_fx, str):
        reduce_fx = reduce_fx.lower()
    try:
        return _REDUCTIONS.get(reduce_fx)
    except TypeError:  # not hashable
        return None


def _as_floats(values: List[Any]) -> List[float]:
    """Counts as floats, the tensors among them in one device synchronisation."""
    tensors = [value.detach().reshape(()).to(torch.float64) for value in values if isinstance(value, torch.Tensor)]
    converted = iter(torch.stack([t.to(tensors[0].device) for t in tensors]).tolist() if tensors else [])
    return [next(converted) if isinstance(value, torch.Tensor) else float(value) for value in values]


class StepLogs:
    """The `self.log` calls of the current logical batch's micro-batches (a `PendingState` through the module
    that trains them: `mark`/`rewind` drop a failed attempt's). `weight` and `reduction`: toma.accumulate's
    (`weight` None: rows)."""

    __slots__ = ("entries", "part", "first", "weight", "reduction", "calls")

    def __init__(self, weight: Optional[Callable[..., Any]], reduction: str = "mean") -> None:
        self.entries: List[_Entry] = []
        self.part = _Part(None)
        self.first = 0  # the current micro-batch's first entry
        self.weight, self.reduction = weight, reduction
        self.calls: Dict[str, int] = {}  # the current micro-batch's calls so far, per name

    def start(self, part: Any) -> None:
        """A micro-batch's step begins on `part`, its data: what it logs is its own."""
        self.part, self.first, self.calls = _Part(part), len(self.entries), {}

    def returned(self, loss: Any) -> None:
        """The micro-batch's step returned `loss` (None: no loss): which of its values are that loss."""
        for entry in self.entries[self.first :]:
            entry.is_loss = loss is not None and entry.source is loss
            entry.source = None

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """Stands in for the module's `self.log` while the micro-batches run."""
        options = _options(args, kwargs)
        source = value
        if isinstance(value, torch.Tensor) and not options.get("enable_graph", False):
            value = value.detach()  # as Lightning keeps it; the micro-batch's graph is not held to the replay
        calls = self.calls.get(name, 0)
        self.calls[name] = calls + 1
        self.entries.append(_Entry((name, calls), value, options, self.part, source))

    def mark(self) -> int:
        return len(self.entries)

    def rewind(self, mark: int) -> None:
        del self.entries[mark:]

    def clear(self) -> None:
        self.entries, self.part, self.first, self.calls = [], _Part(None), 0, {}

    def replay(self, module: "pl.LightningModule") -> None:
        """Log each name once through Lightning's `log` (as often as one micro-batch logged it), its value
        combined over the micro-batches."""
        entries = self.entries
        self.clear()
        by_key: Dict[Tuple[str, int], List[_Entry]] = {}
        for entry in entries:
            by_key.setdefault(entry.key, []).append(entry)
        counted = False
        for (name, _), logged in by_key.items():
            options = logged[-1].options
            value = logged[-1].value
            if len(logged) > 1:
                reduction = self._reduction(logged, options)
                if reduction == "mean" and not counted:
                    self._count(entries)
                    counted = True
                value = self._combine(logged, reduction)
                options = self._batch_size(logged, options)
            module.log(name, value, **options)

    def _reduction(self, logged: List[_Entry], options: Dict[str, Any]) -> Optional[str]:
        """The loss the step returned is combined as toma combines the loss (within a step Lightning reduces
        nothing: reduce_fx is for the epoch's steps); any other value by its reduce_fx."""
        if all(entry.is_loss for entry in logged):
            return self.reduction
        return _reduction(options.get("reduce_fx", "mean"))

    def _count(self, entries: List[_Entry]) -> None:
        """What each micro-batch's loss averages over, once per micro-batch, in one device synchronisation."""
        parts = list({id(entry.part): entry.part for entry in entries}.values())
        weight = self.weight
        values = [rows(part.data) if weight is None else weight(part.data) for part in parts]
        for part, count in zip(parts, _as_floats(values), strict=True):
            part.count = count

    def _combine(self, logged: List[_Entry], reduction: Optional[str]) -> Any:
        values = [entry.value for entry in logged]
        if reduction is None or not all(isinstance(v, (numbers.Number, torch.Tensor)) for v in values):
            return values[-1]  # a torchmetrics Metric keeps its own state; an unknown reduce_fx Lightning refuses
        if reduction == "mean":
            return self._mean(logged)
        if all(not isinstance(v, torch.Tensor) for v in values):
            return max(values) if reduction == "max" else min(values) if reduction == "min" else sum(values)
        device = next(v.device for v in values if isinstance(v, torch.Tensor))
        tensors = [torch.as_tensor(v, device=device) for v in values]
        combined = tensors[0]
        for tensor in tensors[1:]:
            if reduction == "max":
                combined = torch.maximum(combined, tensor)
            elif reduction == "min":
                combined = torch.minimum(combined, tensor)
            else:
                combined = combined + tensor
        return combined

    @staticmethod
    def _mean(logged: List[_Entry]) -> Any:
        """The micro-batches' values weighted as their losses are (the counts `_count` gave them)."""
        values = [entry.value for entry in logged]
        counts = [entry.part.count for entry in logged]
        total = sum(counts)
        if total <= 0:
            return values[-1]
        return sum(v * (count / total) for v, count in zip(values, counts, strict=True))

    @staticmethod
    def _batch_size(logged: List[_Entry], options: Dict[str, Any]) -> Dict[str, Any]:
        """The logical batch's `batch_size` from the micro-batches': their sum, unless every micro-batch gave the
        same number and it is not its own row count (a constant, such as the loader's batch size): that one.
        Without one (None, or not given), Lightning counts the logical batch itself, as in a plain run."""
        sizes = [entry.options.get("batch_size") for entry in logged]
        if any(size is None for size in sizes):
            return {key: value for key, value in options.items() if key != "batch_size"}
        constant = len(set(sizes)) == 1 and any(size != rows(entry.part.data) for size, entry in zip(sizes, logged))
        return options if constant else {**options, "batch_size": sum(sizes)}
