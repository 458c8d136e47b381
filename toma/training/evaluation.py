"""`Trainer.evaluate`'s pass over the data: the loss and metrics of each batch, computed in chunks that fit (a range
step on the trainer's evaluation Runner), averaged over rows or over what `weight` counts. A loss that couples rows
(found in training, or by checking the first batch that ran in chunks) is never averaged over chunks: each batch's
loss is computed whole, the model's calls cut into chunks (`toma.accumulation.gradient_cache.CutCalls`)."""

import dataclasses
import logging
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from toma.accumulation.coupling import CoupledRows, SplitCheck, check_split_once
from toma.accumulation.gradient_cache import CutCalls
from toma.batching.batches import rows, take, to_device
from toma.batching.groups import GroupedBatch, Groups, grouped_batch, rows_belong_together
from toma.batching.splitting import ArgumentBatch
from toma.core.runner import Runner
from toma.training.data import WHOLE_BATCHES, EvaluationChunks, call_arguments
from toma.training.outputs import Metric, check_scalar, logits_of, loss_of

__all__ = ["Evaluation"]

log = logging.getLogger("toma")


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
    # whether the loss couples rows: found by this trainer's evaluations (kept across them), or known from training
    coupling: SplitCheck = dataclasses.field(default_factory=SplitCheck)
    coupled_in_training: bool = False

    def run(self, data: Iterable[Any], named: Dict[str, Metric]) -> Dict[str, float]:
        """The loss and the `named` metrics over `data`, without gradients, the model in eval mode for the pass."""
        was_training = self.model.training
        self.model.eval()
        totals = {"loss": 0.0, **{name: 0.0 for name in named}, "_seen": 0.0, "_counted": 0.0}
        try:
            with torch.no_grad():
                for batch in data:
                    if not rows_belong_together(self.groups) and self.groups != "rows":
                        self._batch(batch, named, totals)
                    elif self.forward is not None and rows_belong_together(self.groups):
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

    def _batch(self, batch: Any, named: Dict[str, Metric], totals: Dict[str, float]) -> None:
        """One batch where the rows' relation is not declared: in chunks, unless its loss couples rows (known, or
        found here on the first batch that ran in chunks): then whole, the model's calls cut."""
        if self.coupling.coupled or self.coupled_in_training:
            self._whole(batch, named, totals)
            return
        forward = self.forward is not None
        piece = ArgumentBatch(call_arguments(batch, forward), {})
        own = {name: 0.0 for name in totals}
        ran: List[Tuple[int, int]] = []
        if forward:
            self._chunks(_recorded(ran, self._forward_rows), rows(batch), batch, named, own)
        else:
            self._chunks(_recorded(ran, self._units), piece.unit_count, piece, self._criterion_part, named, own)
        if len(ran) > 1 and not self.coupling.done and self._couples(piece, ran[0]):
            self._whole(batch, named, totals)
            return
        for name, value in own.items():
            totals[name] += value

    def _couples(self, piece: ArgumentBatch, first: Tuple[int, int]) -> bool:
        """Whether the loss is what its chunks' losses add up to, checked once on the first chunk of a batch that ran
        in chunks against its halves' (`toma.accumulation.coupling`)."""

        def loss(*arguments: Any) -> torch.Tensor:
            if self.forward is not None:
                return loss_of(self.forward(to_device(arguments[0], self.device, non_blocking=True)))
            inputs, targets = to_device(arguments, self.device, non_blocking=True)
            return self.loss_fn(self.model(inputs), targets)  # type: ignore[misc]

        def weight_of(part: Any, start: int, stop: int, arguments: Any) -> Optional[float]:
            counted = self._count(*arguments[0]) if self.weight is not None else float(stop - start)
            return counted if counted > 0 else None

        name = "Trainer.evaluate"
        try:
            check_split_once(
                self.coupling,
                loss,
                self.model,
                piece,
                *first,
                None,
                lambda part, start, stop, width: part.arguments(start, stop),
                weight_of,
                self.reduction == "sum",
                name,
            )
        except CoupledRows as found:
            self.coupling.coupled = self.coupling.done = True
            log.info(
                "toma: %s: the loss couples rows (%s): each batch's loss is computed whole, the model's calls cut into "
                "chunks",
                name,
                str(found).split(": the loss is not")[0],
            )
        return self.coupling.coupled

    def _whole(self, batch: Any, named: Dict[str, Metric], totals: Dict[str, float]) -> None:
        """A batch of a loss that couples rows: its loss and metrics on the whole batch's outputs, every call of the
        model cut into chunks that fit."""
        if self.forward is not None:
            count = self._count(batch) if self.weight is not None else float(rows(batch))
            counted = count
            run: Callable[..., Any] = self.forward
            arguments: Tuple[Any, ...] = (to_device(batch, self.device, non_blocking=True),)
        else:
            inputs, targets = call_arguments(batch, False)
            count = self._count(inputs, targets) if self.weight is not None else float(rows(inputs))
            counted = float(rows(inputs))
            if named and self.metric_weight is not None:
                counted = float(self.metric_weight(inputs, targets))
            model, loss_fn = self.model, self.loss_fn

            def run(inputs: Any, targets: Any) -> Tuple[Any, torch.Tensor]:
                output = model(inputs)
                return output, check_scalar(loss_fn(output, targets), "loss_fn(model(inputs), targets)")  # type: ignore[misc]

            arguments = tuple(to_device((inputs, targets), self.device, non_blocking=True))
        if count == 0:
            return
        step = CutCalls(
            self.model,
            run,
            (arguments, {}),
            rows(batch if self.forward else arguments[0]),
            self.coupling,
            "Trainer.evaluate",
        )
        found = self.runner.perform(step, WHOLE_BATCHES).result
        if self.forward is not None:
            output, loss, metrics = found, loss_of(found), {}
            if named:
                logits, targets = logits_of(output), to_device(self.targets(batch), self.device, non_blocking=True)
                metrics = {name: float(metric(logits, targets)) * counted for name, metric in named.items()}
        else:
            output, loss = found
            metrics = {name: float(metric(output, arguments[1])) * counted for name, metric in named.items()}
        results = {"loss": loss.detach().item() * (count if self.reduction == "mean" else 1), **metrics}
        self._add(totals, results, count, counted)

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


def _recorded(ran: List[Tuple[int, int]], func: Callable[..., None]) -> Callable[..., None]:
    """`func(start, stop, ...)`, each chunk that finished recorded in `ran` (one that failed half-way is redone)."""

    def chunk(start: int, stop: int, *args: Any) -> None:
        func(start, stop, *args)
        ran.append((start, stop))

    return chunk
