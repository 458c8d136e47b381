"""Lightning: every loader batch trained as one logical batch, in micro-batches that toma finds (`MicroBatching`).

`L.Trainer(callbacks=[MicroBatching()])` leaves the LightningModule as it is written: `training_step(batch,
batch_idx)` returns the loss of what it is given, Lightning calls `backward` on what the step returns and steps
the optimizer. For the fit, the callback wraps the module's `training_step`: the wrapped step runs the loader's
batch through `toma.accumulate`'s machinery (forward and backward per micro-batch, redone smaller after an
out-of-memory error, the size cached) and returns the logical batch's loss as a tensor whose backward pass gives
each parameter the logical batch's gradient (`LogicalBatchLoss`). So whatever Lightning does to the returned loss
reaches the gradients as in a plain run: the division by `accumulate_grad_batches`, a precision plugin's loss
scaling, the `on_before_backward`/`on_after_backward` hooks, a module's own `backward`, DDP's all-reduce.

Why not leave the micro-batches' gradients in `.grad` and suppress Lightning's backward: Lightning zeroes the
gradients after the training step (its closure runs step, `zero_grad`, backward), which would erase them on the
first batch of every accumulation window, and DDP reduces only in the backward pass Lightning runs.
"""

import functools
import numbers
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy

from toma.accumulation.accumulate import AccumulationStats, accumulate
from toma.accumulation.options import check_reduction, check_weight
from toma.accumulation.sync import AgreeingOnly, model_device
from toma.batching.batches import rows
from toma.batching.splitting import ArgumentBatch
from toma.core.agreement import Agreement, is_distributed
from toma.core.arguments import check_size
from toma.core.caches import GlobalBatchsizeCache
from toma.core.policy import SizePolicy, check_policy

__all__ = ["MicroBatching", "LogicalBatchLoss"]


class _Gradients:
    """The logical batch's gradients, one per parameter (None: the batch gave it none), and the loss scale the
    micro-batches' backward passes were multiplied by (None: no scaler)."""

    __slots__ = ("grads", "scale")

    def __init__(self, grads: List[Optional[torch.Tensor]], scale: Optional[torch.Tensor]) -> None:
        self.grads: Optional[List[Optional[torch.Tensor]]] = grads
        self.scale = scale

    def take(self, grad_output: torch.Tensor) -> List[Optional[torch.Tensor]]:
        """The gradients times `grad_output` (what reached the loss) over the scale they already carry, handed
        over: kept nowhere else, so autograd can use them as `.grad` without a copy."""
        grads, self.grads = self.grads, None
        if grads is None:
            raise RuntimeError("the logical batch's loss can only be backpropagated once")
        factor = grad_output if self.scale is None else grad_output / self.scale
        for grad in grads:
            if grad is not None:
                grad.mul_(factor)
        return grads


class LogicalBatchLoss(torch.autograd.Function):
    """The logical batch's loss (already computed, with its gradients, in micro-batches) as a tensor of the
    parameters' graph: its backward pass gives each parameter the logical batch's gradient times the gradient
    that reached the loss (Lightning's 1 / `accumulate_grad_batches`, a scaler's scale)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, gradients: _Gradients, *params: torch.Tensor) -> torch.Tensor:
        ctx.gradients = gradients
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        gradients: _Gradients = ctx.gradients
        return (None, None, *gradients.take(grad_output))


class _Logs:
    """What `self.log` received during the micro-batches: logged once per logical batch instead, each value the
    mean over the micro-batches weighted as the loss is (by rows, or by `weight=`), so a logged loss is the logical
    batch's; and no `sync_dist` collective runs inside the region toma may retry."""

    __slots__ = ("entries", "micro_batch", "weight")

    def __init__(self, weight: Optional[Callable[..., Any]]) -> None:
        self.entries: List[Tuple[str, Any, tuple, Dict[str, Any], Any]] = []
        self.micro_batch: Any = None
        self.weight = weight

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        self.entries.append((name, value, args, kwargs, self.micro_batch))

    def replay(self, module: pl.LightningModule) -> None:
        entries, self.entries = self.entries, []
        self.micro_batch = None
        by_name: Dict[str, List[Tuple[Any, tuple, Dict[str, Any], Any]]] = {}
        for name, value, args, kwargs, micro_batch in entries:
            by_name.setdefault(name, []).append((value, args, kwargs, micro_batch))
        for name, logged in by_name.items():
            value, args, kwargs, _ = logged[-1]
            if len(logged) > 1:
                value = self._mean(logged)
                sizes: List[int] = [entry[2]["batch_size"] for entry in logged if "batch_size" in entry[2]]
                if len(sizes) == len(logged):  # batch sizes given per micro-batch: the logical batch's is their sum
                    kwargs = {**kwargs, "batch_size": sum(sizes)}
            module.log(name, value, *args, **kwargs)

    def _count(self, micro_batch: Any) -> float:
        return float(rows(micro_batch) if self.weight is None else self.weight(micro_batch))

    def _mean(self, logged: List[Tuple[Any, tuple, Dict[str, Any], Any]]) -> Any:
        values = [entry[0] for entry in logged]
        if not all(isinstance(v, (numbers.Number, torch.Tensor)) for v in values):
            return values[-1]  # a torchmetrics Metric keeps its own state over the micro-batches
        counts = [self._count(entry[3]) for entry in logged]
        total = sum(counts)
        if total <= 0:
            return values[-1]
        return sum(
            (v.detach() if isinstance(v, torch.Tensor) else v) * (count / total)
            for v, count in zip(values, counts, strict=True)
        )


class _Accumulated(torch.nn.Module):
    """The LightningModule as `toma.accumulate`'s model, with the values logged during the micro-batches as its
    pending state (`toma.accumulation.rollback.PendingState`): a failed attempt's are dropped with its gradients."""

    def __init__(self, module: pl.LightningModule, logs: _Logs) -> None:
        super().__init__()
        self.module = module
        self.logs = logs

    def pending_mark(self) -> int:
        return len(self.logs.entries)

    def pending_rewind(self, mark: int) -> None:
        del self.logs.entries[mark:]


class _MicroBatchStep:
    """The module's own training step, called once per micro-batch: its loss goes to toma; what else it returned
    (a dict's other keys) is kept from the last micro-batch."""

    def __init__(self, step: Callable[..., Any], args: tuple, kwargs: Dict[str, Any], logs: _Logs) -> None:
        self.step, self.args, self.kwargs, self.logs = step, args, kwargs, logs
        self.extra: Optional[Dict[str, Any]] = None
        self.name = getattr(step, "__qualname__", "training_step")

    def loss(self, micro_batch: Any) -> Any:
        self.logs.micro_batch = micro_batch
        output = self.step(micro_batch, *self.args, **self.kwargs)
        if isinstance(output, Mapping):
            if "loss" not in output:
                raise TypeError(f"{self.name} returned a dict without a 'loss' key: {sorted(output)}")
            self.extra = {key: value for key, value in output.items() if key != "loss"}
            return output["loss"]
        if output is None:
            raise TypeError(
                f"{self.name} returned None: MicroBatching trains every micro-batch of the logical batch, so "
                "training_step must return its loss (skipping a batch by returning None is not supported)"
            )
        return output

    def function(self) -> Callable[[Any], Any]:
        """`loss` as a function named after the module's training step (for toma's messages and the size file)."""

        def loss(micro_batch: Any) -> Any:
            return self.loss(micro_batch)

        loss.__qualname__, loss.__module__ = self.name, getattr(self.step, "__module__", loss.__module__)
        return loss


def _scaler_of(precision: Precision) -> Any:
    """The gradient scaler of Lightning's AMP plugin (`precision="16-mixed"`), None for every other plugin."""
    return precision.scaler if isinstance(precision, MixedPrecision) else None


def _writes_logs(trainer: "pl.Trainer") -> bool:
    """Whether Lightning writes this step's logged values to its loggers (every `log_every_n_steps` optimizer
    steps, the last, every step of a `fast_dev_run`): `self.log` costs a fair share of a small model's step, so the
    micro-batch size is logged on those steps only."""
    # both set on the Trainer at its start, by Lightning's logger connector and debugging setup
    every: int = trainer.log_every_n_steps  # type: ignore[attr-defined]
    if trainer.fast_dev_run:  # type: ignore[attr-defined]
        return True
    return bool(every) and ((trainer.global_step + 1) % every == 0 or trainer.should_stop)


def _check_strategy(strategy: Strategy) -> None:
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or strategy.handles_gradient_accumulation:
        raise ValueError(
            f"MicroBatching runs on one device or under DDP (strategy='ddp'); {type(strategy).__name__} shards or "
            "accumulates the model itself, which the micro-batches' rollback after an out-of-memory error does not "
            "cover"
        )


class MicroBatching(Callback):
    """Each loader batch as one logical batch, trained in micro-batches that fit: `L.Trainer(callbacks=
    [MicroBatching()])`. The parameters after each optimizer step equal a plain run's on the same batches.

    Args:
        initial_micro_batch: the micro-batch size to start with; None (default): each batch whole, until it runs
            out of memory. The size that worked is kept for the next batches (one size per callback).
        policy: how the size shrinks after an out-of-memory error (and grows back): `toma.FitToMemory()` by
            default, as for `toma.accumulate`.
        weight: for a loss that averages over something other than rows (label tokens): a function of a
            micro-batch that returns how many items its loss averages over (`toma.accumulate`'s `weight=`).
        reduction: how `training_step`'s loss reduces its batch, "mean" (default) or "sum".
        distributed: under DDP, the ranks agree on every micro-batch size and out-of-memory error, as
            `toma.accumulate` makes them (default True).
        log_micro_batch: log the micro-batch size as "micro_batch" through the module's `self.log` (default True),
            on the steps Lightning writes to its loggers (every `log_every_n_steps`).

    `stats` (a `toma.accumulation.accumulate.AccumulationStats`) holds the last size and the retries so far.
    """

    def __init__(
        self,
        initial_micro_batch: Optional[int] = None,
        *,
        policy: Optional[SizePolicy] = None,
        weight: Optional[Callable[..., Any]] = None,
        reduction: str = "mean",
        distributed: bool = True,
        log_micro_batch: bool = True,
    ) -> None:
        self.initial_micro_batch = (
            None if initial_micro_batch is None else check_size(initial_micro_batch, "initial_micro_batch")
        )
        self.policy = check_policy(policy, "policy")
        self.reduction = check_reduction(reduction, "reduction")
        self.weight = check_weight(weight, "weight", self.reduction)
        self.distributed, self.log_micro_batch = bool(distributed), bool(log_micro_batch)
        self.stats = AccumulationStats()
        self.cache = GlobalBatchsizeCache()  # one size per callback, wherever the step runs from
        self._wrapped: Dict[int, Callable[..., Any]] = {}  # id(module) -> the training_step this callback set

    # --- Lightning's hooks ------------------------------------------------------------------------------------

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not pl_module.automatic_optimization:
            raise ValueError(
                "MicroBatching trains with automatic optimization: with manual optimization training_step runs "
                "backward and the optimizer itself; use toma.accumulate inside it instead"
            )
        _check_strategy(trainer.strategy)
        self._wrap(trainer, pl_module)

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._unwrap(pl_module)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._unwrap(pl_module)

    # --- the wrapped training step ----------------------------------------------------------------------------

    def _wrap(self, trainer: "pl.Trainer", module: "pl.LightningModule") -> None:
        original = module.training_step
        logs = _Logs(self.weight)
        model = _Accumulated(module, logs)
        scaler = _scaler_of(trainer.precision_plugin)
        sync = None
        if self.distributed and isinstance(trainer.strategy, DDPStrategy) and is_distributed():
            sync = AgreeingOnly(Agreement(None, model_device(module.parameters())))

        @functools.wraps(original)
        def training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            return self._logical_batch(
                module, model, _MicroBatchStep(original, args, kwargs, logs), batch, scaler, sync
            )

        module.training_step = training_step  # type: ignore[method-assign]
        self._wrapped[id(module)] = training_step

    def _unwrap(self, module: "pl.LightningModule") -> None:
        wrapped = self._wrapped.pop(id(module), None)
        if wrapped is not None and module.__dict__.get("training_step") is wrapped:
            del module.training_step

    def _logical_batch(
        self,
        module: "pl.LightningModule",
        model: _Accumulated,
        step: _MicroBatchStep,
        batch: Any,
        scaler: Any,
        sync: Optional[AgreeingOnly],
    ) -> Any:
        """The logical batch through toma.accumulate's machinery, its gradients kept apart from `.grad` (which
        Lightning zeroes next) for the backward pass Lightning runs on the returned loss."""
        split = ArgumentBatch((batch,), {})
        params = [p for p in module.parameters() if p.requires_grad]
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        module.log = model.logs.log  # type: ignore[method-assign]
        try:
            loss = accumulate(
                step.function(),
                model,
                self.initial_micro_batch or split.size,
                split,
                reduction=self.reduction,
                weight=self.weight,
                scaler=scaler,
                cache=self.cache,
                policy=self.policy,
                stats=self.stats,
                name="MicroBatching",
                sync=sync,
            )
            grads = [p.grad for p in params]
        finally:
            del module.log
            for p, grad in zip(params, held, strict=True):
                p.grad = grad
        model.logs.replay(module)
        if self.log_micro_batch and _writes_logs(module.trainer):
            module.log("micro_batch", float(self.stats.micro_batch or 0), on_step=True, on_epoch=False)
        scale = None if scaler is None else scaler.scale(torch.ones((), device=loss.device))
        result = LogicalBatchLoss.apply(loss, _Gradients(grads, scale), *params)
        return result if step.extra is None else {"loss": result, **step.extra}
