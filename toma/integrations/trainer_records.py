"""What a Trainer's `compute_loss` records on each call, kept as the plain Trainer keeps it for a whole batch.

A trainer's `compute_loss` may count and log as it goes: TRL's trainers add the batch's tokens to a counter
(`_total_train_tokens`) and append one value per call to lists of metrics (`_metrics[mode][key]`:
`mean_token_accuracy`, `entropy`, `rewards/chosen`, ...), averaged when the trainer logs. Split into micro-batches,
one batch makes several calls, and an attempt that runs out of memory makes calls whose records must not count.
`TrainerRecords` is the `Rollback` that keeps them right:

- before every attempt, the counters and metric lists are put back as they were before the batch (a failed
  attempt counts nothing);
- after the batch, the values each metric list got from the micro-batches' calls are replaced by one value, the
  batch's: a mean weighted by what each micro-batch's value averages over (`MetricRule.weight`: label tokens,
  completion tokens, pairs; by default the micro-batch's share of the batch), a minimum or a maximum. Counters
  add up over the micro-batches by themselves;
- with several ranks whose collectives were made local (`toma.integrations.local_collectives`), the ranks' values
  are combined as the gathers would have: weighted means over every rank's weights, minima and maxima over every
  rank, counters summed — in two collectives per batch, on every rank.
"""

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

from toma.accumulation.rollback import Rollback

__all__ = ["MetricRule", "RecordRules", "TrainerRecords", "SHARE"]

Weight = Callable[[Any], Any]
"""Of a micro-batch's inputs: what its value of a metric averages over (a number or a 0-dim tensor)."""

SHARE = None
"""A rule's weight when the metric averages over what the micro-batch's share of the batch counts."""

_KINDS = ("mean", "min", "max", "counter")


@dataclass(frozen=True)
class MetricRule:
    """How the values of one metric from a batch's micro-batches make the batch's value: `kind` "mean" (weighted by
    `weight(inputs)`, None: the micro-batch's share), "min" or "max" (NaN ignored, as TRL's `nanmin`), or "counter"
    (the list holds a counter's running total, `counter` the trainer attribute: set to the counter once it is
    final)."""

    kind: str = "mean"
    weight: Optional[Weight] = SHARE
    counter: Optional[str] = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"MetricRule.kind must be one of {', '.join(_KINDS)}, got {self.kind!r}")
        if (self.kind == "counter") != (self.counter is not None):
            raise ValueError("MetricRule: a 'counter' rule names its counter, and only it does")


@dataclass(frozen=True)
class RecordRules:
    """What a trainer records: its metric lists' attribute (`metrics`: a dict of modes, each a dict of lists), the
    rule for each metric key (`rules`, else `default`), and the numeric attributes that count items (`counters`:
    summed over the ranks)."""

    metrics: str = "_metrics"
    rules: Mapping[str, MetricRule] = field(default_factory=dict)
    default: MetricRule = MetricRule()
    counters: Tuple[str, ...] = ()

    def rule(self, key: str) -> MetricRule:
        return self.rules.get(key, self.default)


_Lists = Dict[str, Dict[str, List[Any]]]


def _numbers(trainer: Any) -> Dict[str, Any]:
    """The trainer's numeric attributes (ints and floats, not flags)."""
    return {name: value for name, value in vars(trainer).items() if type(value) in (int, float)}


class _Call:
    """One `compute_loss` call of an attempt: the lists as they were before it (object and length), its inputs and
    its share weight."""

    __slots__ = ("before", "inputs", "share")

    def __init__(self, before: Dict[Tuple[str, str], Tuple[int, int]], inputs: Any, share: Any) -> None:
        self.before, self.inputs, self.share = before, inputs, share


class TrainerRecords(Rollback):
    """The records of one trainer over one logical batch (see the module's docstring). `ranks`: the collectives
    were made local and the ranks' records are combined after the batch."""

    def __init__(self, trainer: Any, rules: RecordRules, ranks: bool = False) -> None:
        self.trainer, self.rules, self.ranks = trainer, rules, ranks
        self._numbers: Optional[Dict[str, Any]] = None  # as before the batch
        self._lists: Optional[_Lists] = None
        self._calls: List[Tuple[_Call, Dict[Tuple[str, str], List[Any]]]] = []  # the attempt's calls, what they added
        self._open: Optional[_Call] = None

    # --- the lists ---------------------------------------------------------------------------------

    def _live(self) -> Dict[str, Any]:
        lists = getattr(self.trainer, self.rules.metrics, None)
        return lists if isinstance(lists, dict) else {}

    def _lists_now(self) -> Iterator[Tuple[Tuple[str, str], List[Any]]]:
        """Every metric list the trainer holds now, by (mode, key)."""
        for mode, keyed in self._live().items():
            if isinstance(keyed, dict):
                for key, values in keyed.items():
                    if isinstance(values, list):
                        yield (mode, key), values

    def _list_marks(self) -> Dict[Tuple[str, str], Tuple[int, int]]:
        return {slot: (id(values), len(values)) for slot, values in self._lists_now()}

    def _copy_lists(self) -> _Lists:
        return {
            mode: {key: list(values) for key, values in keyed.items() if isinstance(values, list)}
            for mode, keyed in self._live().items()
            if isinstance(keyed, dict)
        }

    # --- Rollback ------------------------------------------------------------------------------------

    def begin(self) -> None:
        if self._numbers is None:
            self._numbers, self._lists = _numbers(self.trainer), self._copy_lists()
        else:
            self._restore()
        self._calls, self._open = [], None

    def undo(self) -> None:
        self._restore()
        self._calls, self._open = [], None

    def _restore(self) -> None:
        assert self._numbers is not None and self._lists is not None
        for name, value in self._numbers.items():
            if getattr(self.trainer, name, None) != value:
                setattr(self.trainer, name, value)
        live = self._live()
        for mode, keyed in live.items():
            if not isinstance(keyed, dict):
                continue
            saved = self._lists.get(mode, {})
            for key in [key for key in keyed if key not in saved]:
                del keyed[key]
            for key, values in saved.items():
                keyed[key] = list(values)

    # --- the calls ---------------------------------------------------------------------------------

    def before_call(self, inputs: Any, share: Any) -> None:
        """A micro-batch's `compute_loss` call starts (`share`: its share weight, for the default rule). What a call
        that failed half-way appended is dropped first."""
        if self._open is not None:
            self._truncate(self._open.before)
        self._open = _Call(self._list_marks(), inputs, share)

    def _truncate(self, marks: Dict[Tuple[str, str], Tuple[int, int]]) -> None:
        """Each list back to the length it had at `marks` (lists made since are emptied)."""
        for slot, values in self._lists_now():
            mark = marks.get(slot)
            if mark is None:
                del values[:]
            elif mark[0] == id(values):
                del values[mark[1] :]

    def after_call(self) -> None:
        """The call finished: what it appended to each list is noted (a list it replaced is left as it wrote it)."""
        call, self._open = self._open, None
        if call is None:
            return
        added: Dict[Tuple[str, str], List[Any]] = {}
        for slot, values in self._lists_now():
            mark = call.before.get(slot)
            if mark is None:  # a list made by this call (a defaultdict's new key)
                added[slot] = list(values)
            elif mark[0] == id(values) and len(values) > mark[1]:
                added[slot] = values[mark[1] :]
        self._calls.append((call, added))

    @property
    def calls(self) -> int:
        """The calls noted so far in this attempt."""
        return len(self._calls)

    def rewind(self, calls: int) -> None:
        """Forget the calls after the first `calls` of this attempt and what they appended (an evaluation chunk
        the ranks agreed to redo)."""
        if calls >= len(self._calls):
            return
        self._truncate(self._calls[calls][0].before)
        del self._calls[calls:]

    # --- after the batch -----------------------------------------------------------------------------

    def merge(self) -> None:
        """The batch finished: each list's values from the micro-batches become the batch's one value; with ranks,
        combined over the ranks. Ends the batch (the next `begin()` saves anew)."""
        try:
            combined = self._combined()
            if self.ranks:
                combined = self._over_ranks(combined)
            self._write(combined)
        finally:
            self._numbers, self._lists, self._calls = None, None, []

    def _combined(self) -> Dict[Tuple[str, str], Tuple[str, float, float]]:
        """(mode, key) -> (kind, value, weight) of this rank's micro-batches."""
        gathered: Dict[Tuple[str, str], List[Tuple[Any, _Call]]] = {}
        for call, added in self._calls:
            for slot, values in added.items():
                gathered.setdefault(slot, []).extend((value, call) for value in values)
        weights = self._weights(gathered)
        combined: Dict[Tuple[str, str], Tuple[str, float, float]] = {}
        for slot, entries in gathered.items():
            rule = self.rules.rule(slot[1])
            if rule.kind == "counter":
                continue
            values = [_as_float(value) for value, _ in entries]
            if rule.kind == "mean" and len(values) == 1:  # the batch ran whole: its value as the trainer wrote it
                combined[slot] = ("mean", values[0], weights[slot][0])
            elif rule.kind == "mean":
                slot_weights = weights[slot]
                total = sum(slot_weights)
                if total > 0:
                    value = sum(v * w for v, w in zip(values, slot_weights) if w > 0) / total
                else:  # nothing to average over anywhere: the values are the trainer's own stand-in (0.0)
                    value = sum(values) / len(values)
                combined[slot] = ("mean", value, total)
            else:
                finite = [v for v in values if not math.isnan(v)]
                pick = min if rule.kind == "min" else max
                combined[slot] = (rule.kind, pick(finite) if finite else math.nan, 1.0)
        return combined

    def _weights(self, gathered: Dict[Tuple[str, str], List[Tuple[Any, _Call]]]) -> Dict[Tuple[str, str], List[float]]:
        """Each mean metric's weights, one per value, read in one device synchronisation."""
        pending: List[Any] = []
        where: Dict[Tuple[str, str], List[int]] = {}
        for slot, entries in gathered.items():
            rule = self.rules.rule(slot[1])
            if rule.kind != "mean":
                continue
            where[slot] = []
            for _, call in entries:
                weight = call.share if rule.weight is None else rule.weight(call.inputs)
                where[slot].append(len(pending))
                pending.append(weight)
        floats = _floats(pending)
        return {slot: [floats[i] for i in indexes] for slot, indexes in where.items()}

    def _over_ranks(
        self, combined: Dict[Tuple[str, str], Tuple[str, float, float]]
    ) -> Dict[Tuple[str, str], Tuple[str, float, float]]:
        """Every rank's combined values and counters put together, as the trainer's gathers would have."""
        import torch.distributed as dist

        slots: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(slots, sorted((mode, key, kind) for (mode, key), (kind, _, _) in combined.items()))
        every = sorted({tuple(entry) for entries in slots for entry in entries})
        counters = [name for name in self.rules.counters if isinstance(getattr(self.trainer, name, None), (int, float))]
        assert self._numbers is not None
        deltas = [float(getattr(self.trainer, name)) - float(self._numbers.get(name, 0)) for name in counters]
        sums, lows, highs = list(deltas), [], []
        for mode, key, kind in every:
            mine = combined.get((mode, key))
            _, value, weight = (kind, math.nan, 0.0) if mine is None else mine
            if kind == "mean":
                sums += [0.0, 0.0, 0.0, 0.0] if mine is None else [value * weight, weight, value, 1.0]
            elif kind == "min":
                lows.append(math.inf if math.isnan(value) else value)
            else:
                highs.append(-math.inf if math.isnan(value) else value)
        device = _collective_device()
        totals = _all_reduce(sums, dist.ReduceOp.SUM, device)
        lowest = _all_reduce(lows, dist.ReduceOp.MIN, device)
        highest = _all_reduce(highs, dist.ReduceOp.MAX, device)
        for name, delta in zip(counters, totals[: len(counters)]):
            start = self._numbers.get(name, 0)
            setattr(self.trainer, name, type(start)(start + delta) if isinstance(start, int) else start + delta)
        result: Dict[Tuple[str, str], Tuple[str, float, float]] = {}
        at, low, high = len(counters), 0, 0
        for mode, key, kind in every:
            if kind == "mean":
                weighted, weight, plain, count = totals[at : at + 4]
                at += 4
                result[(mode, key)] = ("mean", weighted / weight if weight > 0 else plain / max(count, 1.0), weight)
            elif kind == "min":
                result[(mode, key)] = ("min", lowest[low] if math.isfinite(lowest[low]) else math.nan, 1.0)
                low += 1
            else:
                result[(mode, key)] = ("max", highest[high] if math.isfinite(highest[high]) else math.nan, 1.0)
                high += 1
        return result

    def _write(self, combined: Dict[Tuple[str, str], Tuple[str, float, float]]) -> None:
        """Each list holds what it held before the batch and the batch's one value; counter lists the final
        counter."""
        assert self._lists is not None
        live = self._live()
        for (mode, key), (_, value, _) in combined.items():
            keyed = live.get(mode)
            if not isinstance(keyed, dict):
                continue
            keyed[key] = self._lists.get(mode, {}).get(key, []) + [value]
        for mode, keyed in live.items():
            if not isinstance(keyed, dict):
                continue
            for key in keyed:
                rule = self.rules.rule(key)
                if rule.kind == "counter" and rule.counter is not None and hasattr(self.trainer, rule.counter):
                    keyed[key] = [getattr(self.trainer, rule.counter)]


def _as_float(value: Any) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _floats(values: List[Any]) -> List[float]:
    """The values as floats, tensors on one device read in one synchronisation."""
    tensors = [(i, v) for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    floats = [0.0 if isinstance(v, torch.Tensor) else float(v) for v in values]
    if tensors:
        stacked = torch.stack(
            [v.detach().reshape(()).to(device=tensors[0][1].device, dtype=torch.float64) for _, v in tensors]
        )
        for (i, _), value in zip(tensors, stacked.tolist()):
            floats[i] = value
    return floats


def _collective_device() -> torch.device:
    """Where the default process group's collectives take their tensors (NCCL: this rank's GPU)."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(values: List[float], op: Any, device: torch.device) -> List[float]:
    import torch.distributed as dist

    if not values:
        return []
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return [float(v) for v in tensor.tolist()]
