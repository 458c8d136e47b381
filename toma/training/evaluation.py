"""`Trainer.evaluate`'s pass over the data: the loss and metrics of each batch, computed in chunks that fit (a range
step on the trainer's evaluation Runner), averaged over rows or over what `weight` counts."""

import dataclasses
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

import torch

from toma.batching.batches import rows, take, to_device
from toma.batching.groups import GroupedBatch, Groups, grouped_batch, rows_belong_together
from toma.batching.splitting import ArgumentBatch
from toma.core.runner import Runner
from toma.training.data import WHOLE_BATCHES, EvaluationChunks, call_arguments
from toma.training.outputs import Metric, check_scalar, logits_of, loss_of

__all__ = ["Evaluation"]


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What one `Trainer.evaluate` call reads from its trainer: the model and loss, how a batch's rows count, the
    device, and the Runner that keeps the evaluation chunk size."""

    model: torch.nn.Module
    loss_fn: Optional[Callable[..., torch.Tensor]]
    forward: Optional[Callable[[Any], Any]]
    targets: Callable[[Any], Any]
    weight: Optional[Callable[..., Any]]
    reduction: str
    device: torch.device
    runner: Runner
    groups: Optional[Groups] = None
    metric_weight: Optional[Callable[..., Any]] = None  # what a metric's value is averaged over; None: rows

    def run(self, data: Iterable[Any], named: Dict[str, Metric]) -> Dict[str, float]:
        """The loss and the `named` metrics over `data`, without gradients, the model in eval mode for the pass."""
        was_training = self.model.training
        self.model.eval()
        totals = {"loss": 0.0, **{name: 0.0 for name in named}, "_seen": 0.0, "_counted": 0.0}
        try:
            with torch.no_grad():
                for batch in data:
                    if self.forward is not None and rows_belong_together(self.groups):
                        grouped = grouped_batch((batch,), {}, self.groups)
                        self._chunks(self._units, grouped.unit_count, grouped, self._forward_part, named, totals)
                    elif self.forward is not None:
                        self._chunks(self._forward_rows, rows(batch), batch, named, totals)
                    else:
                        pair = grouped_batch(call_arguments(batch, False), {}, self.groups)
                        self._chunks(self._units, pair.unit_count, pair, self._criterion_part, named, totals)
        finally:
            self.model.train(was_training)
        seen, counted = totals.pop("_seen"), totals.pop("_counted")
        if seen == 0:
            raise ValueError("data yielded no batches (or nothing to count): there is nothing to evaluate")
        loss = totals.pop("loss") / seen
        return {"loss": loss, **{name: total / counted if counted > 0 else 0.0 for name, total in totals.items()}}

    def _criterion_part(
        self, arguments: Tuple[Any, ...], rows_: int, named: Dict[str, Metric], totals: Dict[str, float]
    ) -> None:
        """One chunk `(inputs, targets)` of a batch: `loss_fn(model(inputs), targets)` and the metrics of the chunk,
        so that a criterion or metric out of memory is retried smaller as the model is, and the model's outputs (a
        tensor, a dict, a tuple) are never joined."""
        inputs, targets = arguments
        count = self._count(inputs, targets) if self.weight is not None else float(rows_)
        if count == 0:
            return
        counted = float(rows_)  # what the metrics average over, counted only where there are metrics
        if named and self.metric_weight is not None:
            counted = float(self.metric_weight(inputs, targets))
        inputs, targets = to_device((inputs, targets), self.device, non_blocking=True)
        output = self.model(inputs)
        loss = check_scalar(self.loss_fn(output, targets), "loss_fn(model(inputs), targets)")  # type: ignore[misc]
        results = {"loss": loss.detach().item() * (count if self.reduction == "mean" else 1)}
        results.update({name: float(metric(output, targets)) * counted for name, metric in named.items()})
        self._add(totals, results, count, counted)

    def _chunks(self, func: Callable[..., None], rows_: int, *args: Any) -> None:
        """`func(start, stop, *args)` over `[0, rows_)` in chunks that fit (the trainer's evaluation size)."""
        step = EvaluationChunks(func, 0, rows_, args, {}, name="Trainer.evaluate", device=self.device)
        self.runner.perform(step, WHOLE_BATCHES)

    def _forward_rows(
        self, start: int, stop: int, batch: Any, named: Dict[str, Metric], totals: Dict[str, float]
    ) -> None:
        self._forward_part((take(batch, start, stop),), stop - start, named, totals)

    @staticmethod
    def _units(
        start: int,
        stop: int,
        batch: Union[ArgumentBatch, GroupedBatch],
        part: Callable[..., None],
        named: Dict[str, Metric],
        totals: Dict[str, float],
    ) -> None:
        """Units `[start, stop)` of a batch (rows, or groups never cut apart) to `part`, with their rows."""
        arguments, _ = batch.arguments(start, stop)
        part(arguments, batch.rows_between(start, stop), named, totals)

    def _forward_part(
        self, arguments: Tuple[Any, ...], rows_: int, named: Dict[str, Metric], totals: Dict[str, float]
    ) -> None:
        """One chunk `(batch,)` of a `forward=` batch: its loss and metrics added to `totals` once it has finished."""
        (part,) = arguments
        count = self._count(part) if self.weight is not None else float(rows_)
        if count == 0:
            return
        output = self.forward(to_device(part, self.device, non_blocking=True))  # type: ignore[misc]
        results = {"loss": loss_of(output).detach().item() * (count if self.reduction == "mean" else 1)}
        if named:
            logits = logits_of(output)
            targets = to_device(self.targets(part), self.device, non_blocking=True)
            results.update({name: float(metric(logits, targets)) * count for name, metric in named.items()})
        self._add(totals, results, count, count)

    @staticmethod
    def _add(totals: Dict[str, float], results: Dict[str, float], count: float, counted: float) -> None:
        """A finished chunk's results into `totals`: one that runs out of memory half-way is redone whole, so only
        a chunk that finished counts, once. `count`: what its loss averaged over; `counted`: its metrics."""
        for name, value in results.items():
            totals[name] += value
        totals["_seen"] += count
        totals["_counted"] += counted

    def _count(self, *parts: Any) -> float:
        return float(self.weight(*parts))  # type: ignore[misc]
