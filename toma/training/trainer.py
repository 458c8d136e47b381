"""A Keras-like training manager built on `toma.accumulate` and `toma.range`: no retry loop of its own.

`Trainer(model, optimizer, loss_fn, train_data, batch_size=4096).fit(10)` trains with logical batches of
4096 rows whatever the memory: each optimizer step accumulates exact gradients over micro-batches whose
size toma finds (and then keeps: later steps run at it with no out-of-memory error). The logical batch
stays on the host (or wherever the data is) and each micro-batch moves to the device on its own, so a
logical batch larger than GPU memory trains too.
"""

import dataclasses
import logging
import time
from typing import Any, Callable, Dict, Iterable, Iterator, Mapping, Optional, Sequence, TextIO, Tuple, Union

import torch

from toma.accumulation.accumulate import AccumulationStats, MicroBatchSizing, accumulate
from toma.accumulation.coupling import SplitCheck
from toma.accumulation.options import AccumulationOptions, NothingCounted
from toma.batching.batches import logical_batches, rows, to_device
from toma.core.arguments import check_size
from toma.core.caches import GlobalBatchsizeCache
from toma.core.runner import Runner
from toma.memory import MemoryHistory
from toma.memory.backends import backend_for
from toma.sizing.defaults import ACCUMULATION
from toma.sizing.policies import SizePolicy, check_policy
from toma.training.criteria import for_criterion, metric_weight
from toma.training.data import logical_batch, steps_per_epoch
from toma.training.evaluation import Evaluation
from toma.training.history import EpochTally, TrainingHistory
from toma.training.outputs import (
    METRICS,
    Metric,
    accuracy,
    check_metrics,
    check_scalar,
    default_targets,
    logits_of,
    loss_of,
)
from toma.training.progress import Progress
from toma.training.trainer_arguments import check_eval_data, check_functions, check_run, place

__all__ = ["Trainer", "Callback", "StopTraining", "accuracy", "METRICS"]

log = logging.getLogger("toma")


class StopTraining(Exception):
    """Raise it from a callback (or a loss function) to end `fit` cleanly after the current step."""


class Callback:
    """Hooks called with the trainer, which carries the state: `current_epoch` (epochs finished),
    `global_step`, `last_loss`, `history`, `micro_batch`, `oom_retries`, `memory`, `model`, `optimizer`."""

    def on_step_end(self, trainer: "Trainer") -> None:
        pass

    def on_epoch_end(self, trainer: "Trainer") -> None:
        pass


class Trainer:
    """Trains `model` on `train_data` in logical batches of `batch_size` rows, micro-batched to fit memory.

    `train_data` is a DataLoader or any iterable of `(inputs, targets)` batches, re-cut into logical batches
    of `batch_size` rows; the loss is `loss_fn(model(inputs), targets)` (a mean over the rows, like
    `nn.CrossEntropyLoss()`), or `forward(batch)` for batches of another shape (returning the loss, or a
    model output carrying `.loss`). `weight(inputs, targets)` (or `weight(batch)` with `forward=`) gives the
    number of items a batch's mean loss averages over when that is not its rows (label tokens, say).
    `lengths=` (a 0/1 mask's name in a dict batch, or a function of a batch giving each row's length) packs the
    rows by tokens, as `toma.accumulate(lengths=)` does: the micro-batch size is then a token budget;
    `lengths="position_ids"` takes padding-free batches, cut between their packed sequences (`batch_size` then
    counts sequences). `groups=`: rows that belong together, as `toma.accumulate`'s (with `loss_fn` the rows are
    the criterion's own; with `forward=` they are checked once, unless `groups=` says how they belong together).
    `gradient_sync=`: as `toma.accumulate`'s, for an FSDP2 model. `split_for_padding=False`: with `lengths=`, a
    batch that fits runs whole (else it may be split where that saves padding, as `toma.accumulate`'s).
    `levers=False`: where one row does not fit, the error (else activation checkpointing, as `toma.accumulate`'s).
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
        forward: Optional[Callable[[Any], Any]] = None,
        reduction: str = "mean",
        weight: Optional[Callable[..., Any]] = None,
        targets: Optional[Callable[[Any], Any]] = None,
        file: Optional[TextIO] = None,
        policy: Optional[SizePolicy] = None,
        lengths: Any = None,
        gradient_sync: str = "auto",
        groups: Any = None,
        split_for_padding: bool = True,
        levers: bool = True,
    ) -> None:
        self.accumulation = AccumulationOptions.checked(
            model, reduction=reduction, weight=weight, scaler=scaler, lengths=lengths, gradient_sync=gradient_sync,
            groups=groups, split_for_padding=split_for_padding, levers=levers,
        )  # fmt: skip
        self.model = self.accumulation.model
        given = check_policy(policy, "policy")
        check_functions(optimizer, loss_fn, forward, targets)
        if forward is None:
            self.accumulation = for_criterion(self.accumulation, loss_fn, weight_given=weight is not None)
        self.batch_size = check_size(batch_size, "batch_size")
        self.initial_micro_batch = (
            None if initial_micro_batch is None else check_size(initial_micro_batch, "initial_micro_batch")
        )
        check_run(verbose, callbacks, train_data)
        self.optimizer, self.loss_fn, self.forward, self.train_data = optimizer, loss_fn, forward, train_data
        self.scaler, self.reduction, self.weight = scaler, self.accumulation.reduction, self.accumulation.weight
        self.targets = targets or default_targets
        self._metric_weight = metric_weight(loss_fn, weight) if forward is None else weight
        self.device = place(self.model, device)
        self.callbacks, self.verbose, self.file = list(callbacks), verbose, file
        self._start_state(given)

    def _start_state(self, policy: Optional[SizePolicy]) -> None:
        """What the trainer keeps across steps: the history, the memory record, the counters, and the Runners
        that keep the micro-batch and evaluation sizes."""
        self.history = TrainingHistory()
        self.memory = MemoryHistory(self.device, max_length=10_000)
        self.current_epoch = 0  # epochs finished
        self.global_step = 0
        self.last_loss: Optional[torch.Tensor] = None
        self.stats = AccumulationStats()
        self._evaluation_coupling = SplitCheck()  # whether evaluate's loss couples rows (never averaged over chunks)
        self._nothing_learned, self._nothing_reason = 0, ""  # steps with nothing to learn from, and why the last
        self._logits_needed = False  # whether the next training forward= output is checked for the metrics' logits
        # One cached size per trainer, wherever and at whatever free memory a step runs: once the search
        # has settled, every later step starts at the size that worked.
        self._training = Runner(ACCUMULATION, policy=policy, cache=GlobalBatchsizeCache())
        self._evaluation = Runner(ACCUMULATION, policy=policy, cache=GlobalBatchsizeCache())

    # --- state ---------------------------------------------------------------------------------------

    @property
    def policy(self) -> SizePolicy:
        """How micro-batch and evaluation chunk sizes are found: the one given, else `toma.DEFAULT_POLICY` once
        assigned, else measured (`toma.sizing.defaults.ACCUMULATION`, a FitToMemory); read at each step."""
        return self._training.resolved_policy()

    @policy.setter
    def policy(self, policy: Optional[SizePolicy]) -> None:
        self._training = self._training.with_policy(policy)
        self._evaluation = self._evaluation.with_policy(policy)

    @property
    def micro_batch(self) -> Optional[int]:
        """The micro-batch size the last step ran at."""
        return self.stats.micro_batch

    @property
    def oom_retries(self) -> int:
        """Logical batches redone after an out-of-memory error, since the trainer was made."""
        return self.stats.oom_retries

    # --- training ------------------------------------------------------------------------------------

    def _micro_batch_loss(self, *batch: Any) -> torch.Tensor:
        batch = to_device(batch, self.device, non_blocking=True)
        if self.forward is not None:
            output = self.forward(batch[0])
            if self._logits_needed:  # fit's metrics need them: said at the first step, not after an epoch
                logits_of(output)
                self._logits_needed = False
            return loss_of(output)
        inputs, targets = batch
        return check_scalar(self.loss_fn(self.model(inputs), targets), "loss_fn(model(inputs), targets)")  # type: ignore[misc]

    def step(self, *batch: Any) -> torch.Tensor:
        """One logical batch: zero_grad, forward and backward in micro-batches, optimizer step. Returns the
        logical batch's loss (detached). `step(inputs, targets)`, or `step(batch)` with `forward=`."""
        options = self.accumulation
        logical = logical_batch(
            batch[0] if len(batch) == 1 else batch, self.forward is not None, options.lengths, options.groups
        )
        # The size the cache keeps is the trainer's, not this batch's: a short batch never shrinks it.
        initial = self.initial_micro_batch or self.batch_size
        self.optimizer.zero_grad()
        options = dataclasses.replace(options, name="Trainer.step")
        sizing = MicroBatchSizing(initial, self._training, stats=self.stats)
        try:
            loss = accumulate(self._micro_batch_loss, logical, options, sizing)
        except NothingCounted as nothing:
            # Nothing to learn from (every label padding), on every rank: an error in toma.accumulate; a step that
            # changes nothing here, as the batch asks, with no NaN in the history. A rank of several that counted
            # nothing holds the other ranks' gradients, so it steps as they do (no error there).
            return self._nothing_to_learn(nothing)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.global_step += 1
        self.last_loss = loss
        return loss

    def _nothing_to_learn(self, nothing: NothingCounted) -> torch.Tensor:
        """A logical batch whose weight counts nothing: no gradient, no optimizer step, a loss of 0 that counts
        for nothing in the epoch's mean; a warning says so (an epoch of nothing else is an error: a weight= that
        counts the wrong thing would never train)."""
        self._nothing_reason = str(nothing).split(": its mean loss", 1)[0]
        self._nothing_learned += 1
        log.warning(
            "toma: Trainer.step: %s: nothing to learn from (every label padding?); the step changes nothing and the "
            "optimizer does not step",
            self._nothing_reason,
        )
        loss = torch.zeros((), device=self.device)
        self.stats.weight = 0.0
        self.global_step += 1
        self.last_loss = loss
        return loss

    def _total_steps(self) -> Optional[int]:
        return steps_per_epoch(self.train_data, self.batch_size, self.accumulation.groups)

    def _record_step(self, loss: torch.Tensor, n: int, retries: int, progress: Progress, samples_per_s: float) -> None:
        """A step's record in the history (its loss still on the device), its memory, and the progress display.
        `retries`: the OOM retries before the step."""
        self.memory.record(f"step {self.global_step}")
        self.history.steps.append(
            dict(
                step=self.global_step,
                epoch=self.current_epoch + 1,
                loss=loss,
                micro_batch=self.micro_batch,
                rows=n,
                oom_retries=self.oom_retries - retries,
                memory_model=None if self.stats.model is None else str(self.stats.model),
            )
        )
        progress.step(
            dict(
                loss=lambda: f"{self.last_loss.item():.4g}",  # type: ignore[union-attr]
                samples_per_s=f"{samples_per_s:.0f}",
                micro_batch=self.micro_batch,
                ooms=self.oom_retries,
            )
        )

    def _train_epoch(self, progress: Progress, shown: int, epochs: int) -> Tuple[Dict[str, Any], bool]:
        """One pass over `train_data`: the epoch's record (added to `history`), and whether to stop. `shown`
        and `epochs` number it for the progress display (within one `fit`)."""
        self.model.train()
        self.memory.clear()
        self._reset_cuda_peak()
        progress.start_epoch(shown, epochs, self._total_steps())
        tally = EpochTally(mean=self.reduction == "mean")
        self._nothing_learned = 0  # the epoch's steps whose logical batch had nothing to learn from
        retries_before, first_step = self.oom_retries, len(self.history.steps)
        stopped = False
        try:
            for batch in logical_batches(self.train_data, self.batch_size, self.accumulation.groups):
                n = rows(batch)
                retries = self.oom_retries
                loss = self.step(batch)
                weight = self.stats.weight if self.stats.weight is not None else float(n)
                tally.add(loss, weight, n, self.micro_batch, full=n == self.batch_size)
                self._record_step(loss, n, retries, progress, sum(tally.sizes) / (time.perf_counter() - tally.started))
                self._callbacks("on_step_end")
        except StopTraining:
            stopped = True
        finally:
            for record in self.history.steps[first_step:]:
                record["loss"] = float(record["loss"])  # one device sync per step, once per epoch
        if not tally.sizes:
            progress.close()
            if stopped:
                return {}, True
            raise ValueError("train_data yielded no batches: there is nothing to train on")
        if self._nothing_learned == len(tally.sizes):
            progress.close()
            raise ValueError(
                f"not one of the epoch's {len(tally.sizes)} logical batches had anything to learn from: "
                f"{self._nothing_reason}. If the loss does average over something, weight= must count it"
            )
        seconds = time.perf_counter() - tally.started
        record = dict(
            epoch=self.current_epoch + 1,
            step=self.global_step,
            loss=tally.loss(),
            time=seconds,
            samples_per_s=sum(tally.sizes) / seconds if seconds > 0 else float("inf"),
            micro_batch=tally.micro_batch,
            oom_retries=self.oom_retries - retries_before,
            peak_rss=self.memory.peak("rss"),
            peak_cuda_allocated=self._cuda_peak(),
        )
        self.history.epochs.append(record)
        return record, stopped

    def _finish_epoch(self, record: Dict[str, Any], stopped: bool, progress: Progress, shown: int, epochs: int) -> bool:
        """Show the epoch, count it as finished, run the epoch callbacks; True when training should stop."""
        if record:
            progress.end_epoch(shown, epochs, record)
            self.current_epoch += 1  # before the callbacks: they see the epochs finished, this one included
            if not stopped:
                try:
                    self._callbacks("on_epoch_end")
                except StopTraining:
                    stopped = True
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
        metrics: Union[None, Mapping[str, Metric], Sequence[Union[str, Metric]]] = None,
    ) -> TrainingHistory:
        """Train for `epochs` epochs (evaluating on `eval_data` after each, if given); returns the history.
        A callback raising StopTraining ends it after the current step."""
        epochs = check_size(epochs, "epochs")
        named_metrics = check_metrics(metrics)
        if epochs > 1 and isinstance(self.train_data, Iterator):  # iter() on a DataLoader would draw its RNG
            raise TypeError(
                "train_data is an iterator that can be read only once; for several epochs pass a DataLoader, "
                "a list, or another iterable that starts over"
            )
        check_eval_data(eval_data, epochs)
        self._logits_needed = bool(named_metrics) and eval_data is not None and self.forward is not None
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

    def evaluate(
        self, data: Iterable[Any], metrics: Union[None, Mapping[str, Metric], Sequence[Union[str, Metric]]] = None
    ) -> Dict[str, float]:
        """The loss (and `metrics(outputs, targets)`) over `data`, without gradients, each batch's model, loss and
        metrics computed in chunks that fit (found like any toma.range step). Returns {"loss": ..., metric name:
        ...}: the loss averaged as training's, metrics over rows, `weight`'s counts or a criterion's targets.
        With `forward=`, metrics get the output's logits and the batch's targets (`batch["labels"]`, the second
        of a pair, or `targets(batch)`)."""
        named = check_metrics(metrics)
        evaluation = Evaluation(
            self.model,
            self.loss_fn,
            self.forward,
            self.targets,
            self.weight,
            self.reduction,
            self.device,
            self._evaluation,
            self.accumulation.groups,
            self._metric_weight,
            self._evaluation_coupling,
            self.stats.split_check.coupled,
        )
        return evaluation.run(data, named)

    # --- memory --------------------------------------------------------------------------------------

    def _reset_cuda_peak(self) -> None:
        backend_for(self.device).reset_peak(self.device)

    def _cuda_peak(self) -> Optional[int]:
        return backend_for(self.device).peak_allocated(self.device)
