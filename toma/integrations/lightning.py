"""Lightning: every loader batch trained as one logical batch, in micro-batches that toma finds (`MicroBatching`).

`L.Trainer(callbacks=[MicroBatching()])` leaves the LightningModule as it is written: `training_step(batch,
batch_idx)` returns the loss of what it is given, Lightning calls `backward` on what the step returns and steps
the optimizer. For the fit, the callback wraps the module's `training_step`: the wrapped step runs the loader's
batch through `toma.accumulate`'s machinery (forward and backward per micro-batch, redone smaller after an
out-of-memory error, the size cached) and returns the logical batch's loss as a tensor whose backward pass gives
each parameter the logical batch's gradient (`LogicalBatchLoss`). So whatever Lightning does to the returned loss
reaches the gradients as in a plain run: the division by `accumulate_grad_batches`, a precision plugin's loss
scaling, the `on_before_backward`/`on_after_backward` hooks, a module's own `backward`, DDP's all-reduce.

What Lightning decides from the step's output stays Lightning's: a step that returns None skips the batch (every
micro-batch must then return None), an output Lightning refuses reaches it unchanged, and a batch with nothing to
split (no tensor with a batch dimension, a `dataloader_iter` step) or in which `weight=` counts nothing runs whole
through the module's own step.

Why not leave the micro-batches' gradients in `.grad` and suppress Lightning's backward: Lightning zeroes the
gradients after the training step (its closure runs step, `zero_grad`, backward), which would erase them on the
first batch of every accumulation window, and DDP reduces only in the backward pass Lightning runs.
"""

import logging
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy, Strategy

from toma.accumulation.accumulate import AccumulationStats, MicroBatchSizing, accumulate
from toma.accumulation.options import AccumulationSettings, NothingCounted, SettingAttribute, check_flag
from toma.accumulation.sharded_models import fsdp2_root
from toma.accumulation.sync import AgreeingOnly, GradientSync, model_device
from toma.accumulation.sync_choice import sync_for
from toma.batching.logical import logical_batch_of
from toma.batching.packed import is_packed
from toma.core.agreement import Agreement, is_distributed
from toma.core.arguments import check_size
from toma.core.caches import GlobalBatchsizeCache
from toma.core.oom import should_reduce_batch_size
from toma.core.policy import SizePolicy
from toma.core.runner import Runner
from toma.integrations.lightning_logs import StepLogs
from toma.integrations.lightning_step import (
    NOT_SET,
    AsReturned,
    HeldGradients,
    LogicalBatchLoss,
    MicroBatchStep,
    ModuleAsModel,
    autograd_backward,
    micro_batch_region,
)
from toma.sizing.defaults import ACCUMULATION

__all__ = ["MicroBatching", "LogicalBatchLoss"]

log = logging.getLogger("toma")

_PACKED = "position_ids"  # what a padding-free batch's sequences are found by (or its cu_seq_lens, seq_idx)


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
    if isinstance(strategy, ModelParallelStrategy):
        return
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or strategy.handles_gradient_accumulation:
        raise ValueError(
            f"MicroBatching runs on one device, under DDP (strategy='ddp') or under FSDP2 (ModelParallelStrategy, "
            f"fully_shard in configure_model); {type(strategy).__name__} shards or accumulates the model in a way "
            "the micro-batches' rollback after an out-of-memory error does not cover (FSDP1, DeepSpeed)"
        )


class _Fit:
    """What one fit's wrapped training step works with: the module, its own step, the scaler, the ranks' sync."""

    __slots__ = ("module", "original", "model", "scaler", "sync", "root", "told_whole", "told_nothing")

    def __init__(
        self,
        module: "pl.LightningModule",
        original: Callable[..., Any],
        scaler: Any,
        sync: Optional[AgreeingOnly],
        root: Optional[torch.nn.Module] = None,
    ) -> None:
        self.module, self.original, self.scaler, self.sync, self.root = module, original, scaler, sync, root
        self.model: ModuleAsModel
        self.told_whole = False
        self.told_nothing = False  # whether a batch with nothing to learn from was named in a warning


def _stand_in_for(wrapper: Callable[..., Any], original: Callable[..., Any]) -> None:
    """Give `wrapper` the name of `original`, and as `__wrapped__` what Lightning finds by unwrapping `original`
    once (it reads a step's signature from its `__wrapped__`, one level deep): the same parameters as without it,
    so a decorated `training_step(self, batch)` is still called without `batch_idx`."""
    for attribute in ("__module__", "__name__", "__qualname__", "__doc__"):
        try:
            setattr(wrapper, attribute, getattr(original, attribute))
        except AttributeError:
            pass
    wrapper.__wrapped__ = getattr(original, "__wrapped__", original)  # type: ignore[attr-defined]


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
            `toma.accumulate` makes them (default True). Under FSDP2 they always do.
        log_micro_batch: also log the micro-batch size as "micro_batch" through the module's `self.log`, on the
            steps Lightning writes to its loggers (every `log_every_n_steps`); default False, so that the logged
            metrics are a plain run's.
        pack_tokens: a batch that carries an `attention_mask` (a dict batch) is packed by tokens: rows sorted by
            length, micro-batches within a token budget (`initial_micro_batch` rows of the batch's longest to
            start), each trimmed to its longest row, as `toma.accumulate(lengths="attention_mask")`; default True
            (False: micro-batches of rows in the loader's order, at the batch's padded width).
        gradient_sync: under FSDP2 (`ModelParallelStrategy` with `fully_shard` in `configure_model`), when the
            sharded gradients are reduced: "auto" (default), "logical_batch", "micro_batch" or "sharded", as
            `toma.accumulate`'s `gradient_sync=`.
        groups: rows that belong together, as `toma.accumulate`'s `groups=` ("pairs", "batch", a function of a
            batch giving each row's group, "rows"); None (default): rows on their own, which toma checks once,
            on the first batch it splits (the step runs then a few more times without gradients, in eval mode).
        split_for_padding: with `pack_tokens`, a batch that fits may still run as several micro-batches where the
            padding saved is worth more than a micro-batch costs (measured); False runs a batch that fits whole.
        levers: where even one row does not fit, activation checkpointing for that batch (the module's Hugging
            Face model's own switch, else its largest run of same-type blocks), as `toma.accumulate`'s `levers=`;
            default True (False: the error).

    A padding-free batch (a dict with `position_ids` or `cu_seq_lens_*` and no attention mask) is cut between its
    packed sequences, each micro-batch a padding-free row of its own, as `toma.accumulate(lengths="position_ids")`.

    `stats` (a `toma.accumulation.accumulate.AccumulationStats`) holds the last size and the retries so far. A copy
    (pickle, `copy.deepcopy`, the processes of `strategy="ddp_spawn"`) keeps the options, `stats` and the size found
    (with what the policy learned), in a size cache of its own: it starts where the original is, not from scratch.
    """

    def __init__(
        self,
        initial_micro_batch: Optional[int] = None,
        *,
        policy: Optional[SizePolicy] = None,
        weight: Optional[Callable[..., Any]] = None,
        reduction: str = "mean",
        distributed: bool = True,
        log_micro_batch: bool = False,
        pack_tokens: bool = True,
        gradient_sync: str = "auto",
        groups: Any = None,
        split_for_padding: bool = True,
        levers: bool = True,
    ) -> None:
        self.initial_micro_batch = (
            None if initial_micro_batch is None else check_size(initial_micro_batch, "initial_micro_batch")
        )
        self.settings = AccumulationSettings.checked(
            reduction=reduction,
            weight=weight,
            gradient_sync=gradient_sync,
            groups=groups,
            split_for_padding=split_for_padding,
            levers=levers,
        )
        self.distributed = check_flag(distributed, "distributed")
        self.log_micro_batch = check_flag(log_micro_batch, "log_micro_batch")
        self.pack_tokens = check_flag(pack_tokens, "pack_tokens")
        self.stats = AccumulationStats()
        self.cache = GlobalBatchsizeCache()  # one size per callback, wherever the step runs from
        self._runner = Runner(ACCUMULATION, policy=policy, cache=self.cache)
        # id(module) -> (the training_step this callback set, the one the instance had itself or NOT_SET)
        self._wrapped: Dict[int, Tuple[Callable[..., Any], Any]] = {}

    # The settings as attributes: `settings`, checked where they enter (and again where one is assigned)
    reduction = SettingAttribute("settings", "reduction")
    weight = SettingAttribute("settings", "weight")
    gradient_sync = SettingAttribute("settings", "gradient_sync")
    groups = SettingAttribute("settings", "groups")
    split_for_padding = SettingAttribute("settings", "split_for_padding")
    levers = SettingAttribute("settings", "levers")

    @property
    def policy(self) -> Optional[SizePolicy]:
        """The sizing policy given (None: `toma.DEFAULT_POLICY` once assigned, else a FitToMemory); assignable."""
        return self._runner.policy

    @policy.setter
    def policy(self, policy: Optional[SizePolicy]) -> None:
        self._runner = self._runner.with_policy(policy)

    # --- copies -----------------------------------------------------------------------------------------------

    def __getstate__(self) -> Dict[str, Any]:
        """All but a running fit's wrapped steps (functions of that fit, which a copy is not part of); the size
        cache copies itself with a lock of its own."""
        state = self.__dict__.copy()
        state["_wrapped"] = {}
        return state

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
        self._unwrap(module)  # a fit that ended without telling the callback
        own = module.__dict__.get("training_step", NOT_SET)
        original = module.training_step
        sync: Optional[AgreeingOnly] = None
        root = None
        if isinstance(trainer.strategy, ModelParallelStrategy):
            root = fsdp2_root(module, "MicroBatching under ModelParallelStrategy")
            if root is None:
                raise ValueError(
                    "MicroBatching under ModelParallelStrategy trains FSDP2 models: call fully_shard on the model in "
                    "configure_model (tensor parallelism alone is not supported)"
                )
        elif self.distributed and isinstance(trainer.strategy, DDPStrategy) and is_distributed():
            sync = AgreeingOnly(Agreement(None, model_device(module.parameters())))
        fit = _Fit(module, original, _scaler_of(trainer.precision_plugin), sync, root)
        fit.model = ModuleAsModel(module, StepLogs(self.weight, self.reduction))

        def training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            return self._logical_batch(fit, batch, args, kwargs)

        _stand_in_for(training_step, original)
        module.training_step = training_step  # type: ignore[method-assign]
        self._wrapped[id(module)] = (training_step, own)

    def _unwrap(self, module: "pl.LightningModule") -> None:
        wrapped, own = self._wrapped.pop(id(module), (None, NOT_SET))
        if wrapped is None or module.__dict__.get("training_step") is not wrapped:
            return
        if own is NOT_SET:
            del module.training_step
        else:
            module.training_step = own  # type: ignore[method-assign]

    def _logical_batch(self, fit: _Fit, batch: Any, args: tuple, kwargs: Dict[str, Any]) -> Any:
        """The logical batch through toma.accumulate's machinery, its gradients kept apart from `.grad` (which
        Lightning zeroes next) for the backward pass Lightning runs on the returned loss. A batch with nothing
        to split, or in which `weight=` counts nothing, runs whole through the module's own step, as in a plain
        run."""
        packed = is_packed(batch)
        try:
            split = logical_batch_of((batch,), {}, _PACKED if packed else None, None if packed else self.groups)
        except ValueError as reason:
            if packed or self.groups not in (None, "rows"):
                raise  # a batch the grouping asked for does not have: an error, not a batch to run whole
            if not fit.told_whole:
                fit.told_whole = True
                log.info("MicroBatching runs batches it cannot split whole, as Lightning does (%s)", reason)
            return fit.original(batch, *args, **kwargs)
        model = fit.model
        step = MicroBatchStep(fit.original, args, kwargs, model)
        params: List[torch.Tensor] = [p for p in fit.module.parameters() if p.requires_grad]
        model.returned.clear()
        try:
            with micro_batch_region(fit.module, params, model.logs):
                mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
                by_mask = self.pack_tokens and isinstance(mask, torch.Tensor) and mask.dim() == 2
                lengths = _PACKED if packed else "attention_mask" if by_mask else None
                # FSDP2's strategy each batch: "auto" may have switched to reducing after every micro-batch
                sync: Optional[GradientSync] = fit.sync if fit.root is None else sync_for(fit.root, self.gradient_sync)
                options = self.settings.for_model(
                    model, scaler=fit.scaler, backward=autograd_backward, gradient_sync=sync or self.gradient_sync,
                    name="MicroBatching", lengths=lengths,
                )  # fmt: skip
                sizing = MicroBatchSizing(self.initial_micro_batch or split.size, self._runner, stats=self.stats)
                loss = accumulate(step.function(), split, options, sizing)
                grads = [p.grad for p in params]
        except AsReturned as returned:
            model.logs.clear()
            return returned.output
        except NothingCounted:  # before any forward pass (after them under FSDP2)
            model.logs.clear()
            return self._nothing_to_learn(fit, batch, args, kwargs)
        return self._output(fit, step, loss, grads, params)

    def _nothing_to_learn(self, fit: _Fit, batch: Any, args: tuple, kwargs: Dict[str, Any]) -> Any:
        """A batch whose weight counts nothing (every label padding): the module's own step runs it whole, as in a
        plain run (its `None`, what it logs), but a loss it returns, a mean over nothing, is not trained on: the
        batch is skipped (None), changing nothing, and a warning says so once. Should it not fit whole, it is
        skipped all the same."""
        try:
            if fit.original(batch, *args, **kwargs) is None:
                return None
        except Exception as error:
            if not should_reduce_batch_size(error):
                raise
        if not fit.told_nothing:
            fit.told_nothing = True
            log.warning(
                "MicroBatching: a batch whose weight counts nothing (every label padding) has nothing to learn from: "
                "it is skipped (as Lightning skips a batch whose training_step returns None), changing nothing"
            )
        return None

    def _output(
        self,
        fit: _Fit,
        step: MicroBatchStep,
        loss: torch.Tensor,
        grads: List[Optional[torch.Tensor]],
        params: List[torch.Tensor],
    ) -> Any:
        """What the wrapped step returns to Lightning for a logical batch that ran: None when every micro-batch
        returned None (Lightning skips the batch), else the loss that hands over the batch's gradients; the
        micro-batches' logs replayed either way."""
        module, model = fit.module, fit.model
        skipped = model.returned.count(False)
        if skipped and skipped < len(model.returned):
            model.logs.clear()
            raise RuntimeError(
                f"training_step returned None for {skipped} of the {len(model.returned)} micro-batches of a batch "
                "and a loss for the others: MicroBatching trains or skips a logical batch whole. Return None for "
                "the whole batch (decided from the batch, not from the rows a micro-batch holds) or a loss for "
                "every micro-batch"
            )
        model.logs.replay(module)
        if skipped:
            return None  # Lightning skips the batch, as it does when a plain training step returns None
        if self.log_micro_batch and _writes_logs(module.trainer):
            module.log("micro_batch", float(self.stats.micro_batch or 0), on_step=True, on_epoch=False)
        scale = None if fit.scaler is None else fit.scaler.scale(torch.ones((), device=loss.device))
        result = LogicalBatchLoss.apply(loss, HeldGradients(grads, scale), *params)
        return result if step.extra is None else {"loss": result, **step.extra}
