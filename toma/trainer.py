"""A Keras-like training manager built on `toma.accumulate` and `toma.range`: no retry loop of its own.

`Trainer(model, optimizer, loss_fn, train_data, batch_size=4096).fit(10)` trains with logical batches of
4096 rows whatever the memory: each optimizer step accumulates exact gradients over micro-batches whose
size toma finds (and then keeps: later steps run at it with no out-of-memory error). The logical batch
stays on the host (or wherever the data is) and each micro-batch moves to the device on its own, so a
logical batch larger than GPU memory trains too.
"""

import math
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, TextIO, Tuple, Union

import torch

from toma.accumulate import check_model, check_reduction, check_scaler
from toma.arguments import check_size
from toma.batches import logical_batches, rows, take, to_device
from toma.batchsize_cache import GlobalBatchsizeCache
from toma.forms import toma
from toma.history import TrainingHistory
from toma.memory import History as MemoryHistory
from toma.progress import VERBOSITY, Progress

__all__ = ["Trainer", "Callback", "StopTraining", "accuracy"]

Metric = Callable[[torch.Tensor, torch.Tensor], Any]


class StopTraining(Exception):
    """Raise it from a callback (or a loss function) to end `fit` cleanly after the current step."""


class Callback:
    """Hooks called with the trainer, which carries the state: `current_epoch` (epochs finished),
    `global_step`, `last_loss`, `history`, `micro_batch`, `oom_retries`, `memory`, `model`, `optimizer`."""

    def on_step_end(self, trainer: "Trainer") -> None:
        pass

    def on_epoch_end(self, trainer: "Trainer") -> None:
        pass


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The share of rows whose largest output is the target class."""
    return (outputs.argmax(dim=-1) == targets).float().mean()


def _check_metrics(metrics: Union[None, Mapping[str, Metric], Sequence[Metric]]) -> Dict[str, Metric]:
    if metrics is None:
        return {}
    named = dict(metrics) if isinstance(metrics, Mapping) else {getattr(m, "__name__", repr(m)): m for m in metrics}
    for name, metric in named.items():
        if not callable(metric):
            raise TypeError(f"metrics[{name!r}] must be a function (outputs, targets) -> value, got {metric!r}")
    return named


def _check_scalar(loss: Any, what: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)
        raise TypeError(f"{what} must return a scalar tensor (the batch's loss), got {shape}")
    return loss


class Trainer:
    """Trains `model` on `train_data` in logical batches of `batch_size` rows, micro-batched to fit memory.

    `train_data` is a DataLoader or any iterable of `(inputs, targets)` batches, re-cut into logical batches
    of `batch_size` rows; the loss is `loss_fn(model(inputs), targets)` (a mean over the rows, like
    `nn.CrossEntropyLoss()`), or `forward(batch)` for batches of another shape.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Optional[Callable[..., torch.Tensor]],
        train_data: Iterable[Any],
        *,
        batch_size: int,
        initial_micro_batch: Optional[int] = None,
        scaler: Any = None,
        device: Any = None,
        callbacks: Sequence[Callback] = (),
        verbose: int = 1,
        forward: Optional[Callable[[Any], torch.Tensor]] = None,
        reduction: str = "mean",
        file: Optional[TextIO] = None,
    ) -> None:
        self.model = check_model(model, "model")
        if not (callable(getattr(optimizer, "step", None)) and callable(getattr(optimizer, "zero_grad", None))):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        if forward is None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be a criterion called as loss_fn(model(inputs), targets), got {loss_fn!r}")
        if forward is not None and not callable(forward):
            raise TypeError(f"forward must be a function batch -> loss, got {forward!r}")
        self.batch_size = check_size(batch_size, "batch_size")
        self.initial_micro_batch = (
            None if initial_micro_batch is None else check_size(initial_micro_batch, "initial_micro_batch")
        )
        if verbose not in VERBOSITY:
            raise ValueError(f"verbose must be 0 (silent), 1 (a line per epoch) or 2 (a progress bar), got {verbose!r}")
        for callback in callbacks:
            if not any(callable(getattr(callback, hook, None)) for hook in ("on_step_end", "on_epoch_end")):
                raise TypeError(f"callbacks must have on_step_end or on_epoch_end, got {callback!r}")
        if hasattr(train_data, "__len__") and len(train_data) == 0:  # type: ignore[arg-type]
            raise ValueError("train_data is empty: there is nothing to train on")
        self.optimizer, self.loss_fn, self.forward = optimizer, loss_fn, forward
        self.train_data = train_data
        self.scaler = check_scaler(scaler, "scaler")
        self.reduction = check_reduction(reduction, "reduction")
        if device is not None:
            self.device = torch.device(device)
            self.model.to(self.device)
        else:
            first = next(self.model.parameters(), None)
            self.device = first.device if first is not None else torch.device("cpu")
        self.callbacks = list(callbacks)
        self.verbose, self.file = verbose, file

        self.history = TrainingHistory()
        self.memory = MemoryHistory(self.device, max_length=10_000)
        self.current_epoch = 0  # epochs finished
        self.global_step = 0
        self.last_loss: Optional[torch.Tensor] = None
        # One cached size per trainer, wherever and at whatever free memory a step runs: once the search
        # has settled, every later step starts at the size that worked.
        self._accumulate = toma.accumulate(
            model=self.model,
            scaler=self.scaler,
            reduction=self.reduction,
            cache_type=GlobalBatchsizeCache,
        )(self._micro_batch_loss)
        self._predict = toma.range(cache_type=GlobalBatchsizeCache)(self._predict_rows)
        self._evaluate_loss = toma.range(cache_type=GlobalBatchsizeCache)(self._loss_rows)

    # --- state ---------------------------------------------------------------------------------------

    @property
    def micro_batch(self) -> Optional[int]:
        """The micro-batch size the last step ran at."""
        return self._accumulate.stats.micro_batch

    @property
    def oom_retries(self) -> int:
        """Logical batches redone after an out-of-memory error, since the trainer was made."""
        return self._accumulate.stats.oom_retries

    # --- training ------------------------------------------------------------------------------------

    def _micro_batch_loss(self, *batch: Any) -> torch.Tensor:
        batch = to_device(batch, self.device, non_blocking=True)
        if self.forward is not None:
            return _check_scalar(self.forward(batch[0] if len(batch) == 1 else batch), "forward(batch)")
        inputs, targets = batch
        return _check_scalar(self.loss_fn(self.model(inputs), targets), "loss_fn(model(inputs), targets)")  # type: ignore[misc]

    def _parts(self, batch: Any) -> tuple:
        """The arguments a micro-batch function takes for one data batch."""
        if self.forward is not None:
            return (batch,)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(
                "train_data must yield (inputs, targets) batches for loss_fn(model(inputs), targets); "
                f"got {type(batch).__name__}. For batches of another shape pass forward=batch -> loss"
            )
        return tuple(batch)

    def step(self, *batch: Any) -> torch.Tensor:
        """One logical batch: zero_grad, forward and backward in micro-batches, optimizer step. Returns the
        logical batch's loss (detached)."""
        parts = self._parts(batch[0] if len(batch) == 1 else batch)
        initial = self.initial_micro_batch or rows(parts)
        self.optimizer.zero_grad()
        loss = self._accumulate(*parts, toma_initial_micro_batch=initial)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.global_step += 1
        self.last_loss = loss
        return loss

    def _total_steps(self) -> Optional[int]:
        dataset = getattr(self.train_data, "dataset", None)
        if dataset is not None and hasattr(dataset, "__len__") and not getattr(self.train_data, "drop_last", False):
            return math.ceil(len(dataset) / self.batch_size)
        return None

    def _train_epoch(self, progress: Progress, shown: int, epochs: int) -> Tuple[Dict[str, Any], bool]:
        """One pass over `train_data`: the epoch's record (added to `history`), and whether to stop. `shown`
        and `epochs` number it for the progress display (within one `fit`)."""
        self.model.train()
        self.memory.clear()
        self._reset_cuda_peak()
        progress.start_epoch(shown, epochs, self._total_steps())
        settled_micro_batch = None  # the size full logical batches ran at (a short last one runs whole)
        started, retries_before, first_step = time.perf_counter(), self.oom_retries, len(self.history.steps)
        weighted: List[torch.Tensor] = []  # the loss of each step, times its rows for a mean loss
        sizes: List[int] = []
        stopped = False
        try:
            for batch in logical_batches(self.train_data, self.batch_size):
                n = rows(batch)
                retries = self.oom_retries
                loss = self.step(batch)
                weighted.append(loss.float() * n if self.reduction == "mean" else loss.float())
                sizes.append(n)
                if n == self.batch_size or settled_micro_batch is None:
                    settled_micro_batch = self.micro_batch
                self.memory.record(f"step {self.global_step}")
                self.history.steps.append(
                    dict(
                        step=self.global_step,
                        epoch=self.current_epoch + 1,
                        loss=loss,
                        micro_batch=self.micro_batch,
                        rows=n,
                        oom_retries=self.oom_retries - retries,
                    )
                )
                progress.step(
                    dict(
                        loss=lambda: f"{self.last_loss.item():.4g}",  # type: ignore[union-attr]
                        samples_per_s=f"{sum(sizes) / (time.perf_counter() - started):.0f}",
                        micro_batch=self.micro_batch,
                        ooms=self.oom_retries,
                    )
                )
                self._callbacks("on_step_end")
        except StopTraining:
            stopped = True
        finally:
            for record in self.history.steps[first_step:]:
                record["loss"] = float(record["loss"])  # one device sync per step, once per epoch
        if not sizes:
            progress.close()
            if stopped:
                return {}, True
            raise ValueError("train_data yielded no batches: there is nothing to train on")
        seconds = time.perf_counter() - started
        total = float(torch.stack(weighted).sum())
        record = dict(
            epoch=self.current_epoch + 1,
            step=self.global_step,
            loss=total / sum(sizes) if self.reduction == "mean" else total / len(sizes),
            time=seconds,
            samples_per_s=sum(sizes) / seconds if seconds > 0 else float("inf"),
            micro_batch=settled_micro_batch,
            oom_retries=self.oom_retries - retries_before,
            peak_rss=self.memory.peak("rss"),
            peak_cuda_allocated=self._cuda_peak(),
        )
        self.history.epochs.append(record)
        return record, stopped

    def _finish_epoch(self, record: Dict[str, Any], stopped: bool, progress: Progress, shown: int, epochs: int) -> bool:
        """Show the epoch, run the epoch callbacks, move on; True when training should stop."""
        if record:
            progress.end_epoch(shown, epochs, record)
            if not stopped:
                try:
                    self._callbacks("on_epoch_end")
                except StopTraining:
                    stopped = True
            self.current_epoch += 1
        return stopped

    def epoch(self) -> Dict[str, Any]:
        """One epoch over `train_data`, for code around it (evaluation, schedules); returns its record.
        Raises StopTraining if a callback asked to stop."""
        progress = Progress(self.verbose, self.file)
        try:
            shown = self.current_epoch
            record, stopped = self._train_epoch(progress, shown, shown + 1)
            stopped = self._finish_epoch(record, stopped, progress, shown, shown + 1)
        finally:
            progress.close()
        if stopped:
            raise StopTraining
        return record

    def fit(
        self,
        epochs: int,
        eval_data: Optional[Iterable[Any]] = None,
        metrics: Union[None, Mapping[str, Metric], Sequence[Metric]] = None,
    ) -> TrainingHistory:
        """Train for `epochs` epochs (evaluating on `eval_data` after each, if given); returns the history.
        A callback raising StopTraining ends it after the current step."""
        epochs = check_size(epochs, "epochs")
        named_metrics = _check_metrics(metrics)
        if named_metrics and self.forward is not None:
            raise ValueError("metrics need model outputs: they work with loss_fn, not with forward=")
        if epochs > 1 and isinstance(self.train_data, Iterator):  # iter() on a DataLoader would draw its RNG
            raise TypeError(
                "train_data is an iterator that can be read only once; for several epochs pass a DataLoader, "
                "a list, or another iterable that starts over"
            )
        progress = Progress(self.verbose, self.file)
        try:
            for shown in range(epochs):
                record, stopped = self._train_epoch(progress, shown, epochs)
                if record and eval_data is not None:
                    results = self.evaluate(eval_data, named_metrics)
                    record.update({f"eval_{name}": value for name, value in results.items()})
                if self._finish_epoch(record, stopped, progress, shown, epochs):
                    break
        finally:
            progress.close()
        return self.history

    def _callbacks(self, hook: str) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                method(self)

    # --- evaluation ----------------------------------------------------------------------------------

    def _predict_rows(self, start: int, stop: int, inputs: Any, outputs: List[torch.Tensor]) -> None:
        outputs.append(self.model(to_device(take(inputs, start, stop), self.device, non_blocking=True)))

    def _loss_rows(self, start: int, stop: int, batch: Any, losses: List[torch.Tensor]) -> None:
        part = to_device(take(batch, start, stop), self.device, non_blocking=True)
        loss = _check_scalar(self.forward(part), "forward(batch)").detach().float()  # type: ignore[misc]
        losses.append(loss * (stop - start) if self.reduction == "mean" else loss)

    def evaluate(
        self, data: Iterable[Any], metrics: Union[None, Mapping[str, Metric], Sequence[Metric]] = None
    ) -> Dict[str, float]:
        """The loss (and `metrics(outputs, targets)`) over `data`, without gradients, each batch computed in
        chunks that fit (found like any toma.range step). Returns {"loss": ..., metric name: ...} averaged
        over rows."""
        named = _check_metrics(metrics)
        if named and self.forward is not None:
            raise ValueError("metrics need model outputs: they work with loss_fn, not with forward=")
        was_training = self.model.training
        self.model.eval()
        totals = {"loss": 0.0, **{name: 0.0 for name in named}}
        seen = 0
        try:
            with torch.no_grad():
                for batch in data:
                    parts = self._parts(batch)
                    n = rows(parts[0])
                    seen += n
                    if self.forward is not None:
                        losses: List[torch.Tensor] = []
                        self._evaluate_loss(0, n, parts[0], losses, toma_initial_step=n)
                        totals["loss"] += torch.stack(losses).sum().item()
                        continue
                    outputs: List[torch.Tensor] = []
                    self._predict(0, n, parts[0], outputs, toma_initial_step=n)
                    output = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
                    targets = to_device(parts[1], self.device, non_blocking=True)
                    loss = _check_scalar(self.loss_fn(output, targets), "loss_fn(model(inputs), targets)")  # type: ignore[misc]
                    totals["loss"] += loss.item() * (n if self.reduction == "mean" else 1)
                    for name, metric in named.items():
                        totals[name] += float(metric(output, targets)) * n
        finally:
            self.model.train(was_training)
        if seen == 0:
            raise ValueError("data yielded no batches: there is nothing to evaluate")
        return {name: total / seen for name, total in totals.items()}

    # --- memory --------------------------------------------------------------------------------------

    def _reset_cuda_peak(self) -> None:
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats(self.device)

    def _cuda_peak(self) -> Optional[int]:
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            return int(torch.cuda.max_memory_allocated(self.device))
        return None
