"""Gradient accumulation: a logical batch larger than memory, trained in micro-batches with exact gradients.

The logical batch is one unit of work for the engine: an attempt runs forward and backward for every
micro-batch at one size; an out-of-memory error anywhere in it (forward, backward, after some parameters
already got gradients) drops that attempt's gradients exactly (`GradientStash`), puts back the training
modules' buffers and the random state (`toma.accumulation.rollback`), and the engine redoes the whole logical batch at a
smaller micro-batch size. The logical batch itself never changes.

With `reduction="mean"` each micro-loss is weighted by its share of what the logical batch's loss averages
over: rows (n_i / N), or with `weight=` the count that function gives (label tokens, say), so the gradients
are those of one full-batch pass also when micro-batches hold different shares.
"""

import contextlib
import logging
import re
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable, List, Optional, Sequence, Tuple

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from toma.accumulation.gradients import GradientStash
from toma.accumulation.misuse import AccumulationMisuse, MisuseWatch
from toma.accumulation.options import (
    REDUCTIONS,
    NothingCounted,
    check_model,
    check_reduction,
    check_scaler,
    check_weight,
    nothing_counted,
)
from toma.accumulation.rollback import BufferStash, PendingStash, RandomState
from toma.accumulation.sync import DDPNoSync, model_device, sync_for
from toma.batching import transfer
from toma.batching.splitting import ArgumentBatch, LogicalBatch, MicroBatch
from toma.batching.transfer import MicroBatchTransfers, Pending, shared_transfers
from toma.core.caches import LearnedState
from toma.core.oom import add_note, should_reduce_batch_size
from toma.core.runner import Runner
from toma.core.steps import Step
from toma.sizing.defaults import ACCUMULATION
from toma.sizing.policies import SizePolicy

__all__ = [
    "accumulate",
    "AccumulationStats",
    "AccumulationMisuse",
    "NothingCounted",
    "check_model",
    "check_reduction",
    "check_scaler",
    "check_weight",
    "REDUCTIONS",
]

log = logging.getLogger("toma")

_AUTOCAST_DEVICE_TYPES = ("cuda", "cpu", "xpu", "mps", "hpu")


def _enabled_autocast() -> Tuple[str, ...]:
    """The device types autocast is on for here, where the backward passes run."""
    return tuple(kind for kind in _AUTOCAST_DEVICE_TYPES if _autocast_enabled(kind))


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except (TypeError, RuntimeError):  # torch < 2.4 has no device argument; unknown device types
        return device_type == "cuda" and torch.is_autocast_enabled()


def _autocast_off(device_types: Tuple[str, ...]) -> contextlib.ExitStack:
    """Backward outside autocast (PyTorch's advice): the forward's choice of dtypes already holds."""
    stack = contextlib.ExitStack()
    for kind in device_types:
        stack.enter_context(torch.autocast(kind, enabled=False))
    return stack


_checked_for_batchnorm: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _warn_once_about_batchnorm(model: torch.nn.Module) -> None:
    if model in _checked_for_batchnorm:
        return
    _checked_for_batchnorm.add(model)
    names = [name for name, m in model.named_modules() if isinstance(m, _BatchNorm) and m.training]
    if names:
        log.warning(
            "%s has BatchNorm layers (%s) in training mode: with the logical batch split into "
            "micro-batches their statistics are those of each micro-batch, not of the full batch",
            type(model).__name__,
            ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""),
        )


def _loss_error(func: Callable[..., Any], loss: Any) -> TypeError:
    what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)
    name = getattr(func, "__qualname__", repr(func))
    return TypeError(f"{name} must return the micro-batch's loss as a scalar tensor, got {what}")


def _counts(values: List[Any], weight: Callable[..., Any]) -> List[float]:
    """The micro-batches' counts as floats, with one device synchronisation for tensors on one device."""
    tensors = [value for value in values if isinstance(value, torch.Tensor)]
    floats: List[float]
    if len(tensors) == len(values) and len({t.device for t in tensors}) == 1:
        floats = torch.stack([t.detach().reshape(()).to(torch.float64) for t in tensors]).tolist()
    else:
        floats = [float(value) for value in values]
    name = getattr(weight, "__qualname__", repr(weight))
    for value in floats:
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"weight ({name}) must return a count of at least 0 for every micro-batch, got {value}")
    return floats


def _hint_whole(error: BaseException, piece: ArgumentBatch, rows: int) -> None:
    """An error that names the micro-batch's row count while the batch was split may come from a tensor
    that is not part of the batch but happened to have as many rows: say what was split."""
    if re.search(rf"(?<![\d.]){rows}(?![\d.])", str(error)) is None:
        return
    note = (
        f"toma: the logical batch of {piece.size} rows was split into micro-batches of {rows} along dim 0 of "
        f"every tensor with {piece.size} rows: {piece.describe()}. A tensor that is not part of the batch "
        "(class weights, say) goes to every micro-batch whole when wrapped in toma.whole(...)"
    )
    add_note(error, note)


# Accumulation sizes a micro-batch by measuring: its size matters for speed, and no 1.1.0 sequence binds it.
ACCUMULATION_POLICY: SizePolicy = ACCUMULATION  # accumulation's default (toma.sizing.defaults)


@dataclass
class AccumulationStats:
    """What the calls of one accumulating function went through (best effort across threads)."""

    micro_batch: Optional[int] = None  # the size the last finished logical batch ran at
    oom_retries: int = 0  # logical batches redone after an out-of-memory error, over all calls
    calls: int = 0
    weight: Optional[float] = None  # what the last logical batch's loss averaged over (rows, or weight's total)
    learned: Optional[LearnedState] = None  # what the policy learned at the call site's entry

    @property
    def model(self) -> Any:
        """FitToMemory's memory model of the call site once it measured (a need per item of the batch), read
        when asked: fitting it on every call would cost the hot path."""
        return None if self.learned is None else self.learned.model()


def _pipeline_for(params: List[torch.Tensor], batch: LogicalBatch) -> Optional[MicroBatchTransfers]:
    """The moves of this call's micro-batches to the model's CUDA device when the logical batch lives on the
    host: each micro-batch's split tensors move while the previous one computes, `toma.whole` values once per
    call. None when there is nothing to move (a CPU model, a batch already on the device)."""
    devices = dict.fromkeys(p.device for p in params)  # each device once, in the parameters' order
    device = next((d for d in devices if transfer.uses_cuda(d)), None)
    if device is None:
        return None
    if not any(t.device.type == "cpu" for piece in batch.pieces for _, t in piece.tensors):
        return None
    return MicroBatchTransfers(shared_transfers(device))


class AccumulateStep(Step):
    """One attempt at the whole logical batch: forward and backward of every micro-batch at `size`."""

    size_name = "micro-batch size"
    finished = False  # the logical batch is one unit: redone whole after an out-of-memory error

    def __init__(
        self,
        func: Callable[..., Any],
        model: torch.nn.Module,
        batch: LogicalBatch,
        reduction: str,
        weight: Optional[Callable[..., Any]],
        scaler: Any,
        policy: SizePolicy,
        name: Optional[str] = None,
        backward: Optional[Callable[[torch.Tensor], Any]] = None,
        total: Any = None,
        sync: Any = None,
    ) -> None:
        self.func, self.model, self.batch, self.policy, self.name = func, model, batch, policy, name
        self.mean = reduction == "mean"
        self.weight, self.scaler = weight, scaler
        self.backward: Callable[[torch.Tensor], Any] = backward or torch.Tensor.backward
        self.total = total
        self.sync = sync_for(model) if sync is None else sync
        self.params: List[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        self.buffers = BufferStash(model)
        self.pending = PendingStash(model)
        # DDP's reducer on one rank swaps gradients for views of its buckets: only parameters can be watched.
        self.watch = MisuseWatch(self.params, model, check_grads=not isinstance(self.sync, DDPNoSync))
        self.random: Optional[RandomState] = None
        self.transfers = _pipeline_for(self.params, batch)
        self.result: Optional[torch.Tensor] = None
        self.total_weight: Optional[float] = None
        self.attempts = 0
        self.size: Optional[int] = None

    @property
    def row_items(self) -> float:
        """The elements a row of the batch's widest piece holds, summed over its tensors: a learning policy
        sizes by elements, so batches padded to other widths need no new search."""
        return float(max(sum(t.numel() for _, t in piece.tensors) / piece.size for piece in self.batch.pieces))

    @property
    def device(self) -> Optional[torch.device]:
        """Where the model computes (see `toma.core.engine.Step`)."""
        return model_device(self.params)

    def effective(self, size: int) -> int:
        """A micro-batch never holds more rows than the largest piece of the logical batch."""
        return min(size, self.batch.largest)

    def _devices_in_use(self) -> List[torch.Tensor]:
        return self.params + [tensor for piece in self.batch.pieces for _, tensor in piece.tensors[:1]]

    def __call__(self, size: int) -> bool:
        self.attempts += 1
        if self.random is None:
            self.random = RandomState(self._devices_in_use())
        else:  # a retry: the same random numbers as the failed attempt drew
            self.random.restore()
        self.buffers.save_once()
        self.pending.save()
        asked, size = size, self.effective(size)
        self.size = size
        micro_batches = self.batch.micro_batches(size)
        if len(micro_batches) > 1:
            _warn_once_about_batchnorm(self.model)
        agreement = self.sync.agreement
        try:
            with GradientStash(self.params, copy=self.sync.copy_grads):
                try:
                    result = self._micro_batches(micro_batches)
                except Exception as error:
                    if agreement is not None:  # tell the other ranks, inside the stash: a retry restores all
                        agreement.after_attempt(asked, error, self.policy, size)
                    raise
                if agreement is not None:
                    agreement.after_attempt(asked, None, self.policy)
                    # only this call's gradients: earlier ones are set aside; with a `total` that spans the ranks
                    # already, their gradients are averaged as DDP does
                    rank_weight = self.total_weight if self.weight is not None and self.total is None else None
                    self.sync.synchronise(self.params, rank_weight)
                self.result = result
        except BaseException:
            self.sync.abort()
            self.buffers.restore()
            self.pending.restore()
            raise
        return True

    def _factors(self, micro_batches: Sequence[MicroBatch], arguments: List[Any]) -> List[Optional[float]]:
        """What each micro-loss is multiplied by (None: the micro-batch has nothing to average over)."""
        total_rows = self.batch.size
        if not self.mean:
            self.total_weight = float(total_rows)
            return [1.0] * len(micro_batches)
        if self.weight is None:
            self.total_weight = float(total_rows)
            return [(stop - start) / total_rows for _, start, stop in micro_batches]
        values = [self.weight(*args, **kwargs) for args, kwargs in arguments]
        if self.total is None:
            counts = _counts(values, self.weight)
            total = sum(counts)
            if total == 0 and self.sync.agreement is None:  # with ranks, the others' items count too (sync.py)
                raise nothing_counted(self.weight, total_rows)
        else:  # the counts and the total in one device synchronisation
            *counts, total = _counts(values + [self.total], self.weight)
            if total == 0 and any(counts):
                raise ValueError(f"total is 0, but the micro-batches count {sum(counts)} items")
        self.total_weight = sum(counts)
        return [count / total if count > 0 else None for count in counts]

    def _micro_batches(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
        autocast = _enabled_autocast()
        arguments = [piece.micro_batch(start, stop) for piece, start, stop in micro_batches]
        factors = self._factors(micro_batches, arguments)
        running = [index for index, factor in enumerate(factors) if factor is not None]
        last = running[-1] if running else -1
        total: Optional[torch.Tensor] = None
        moving = self.transfers
        ahead: Optional[Pending] = None
        if moving is not None and running:
            ahead = moving.prefetch(*micro_batches[running[0]])
        with self.watch:
            for position, index in enumerate(running):
                piece, start, stop = micro_batches[index]
                if moving is None or ahead is None:
                    args, kwargs = arguments[index]
                else:  # this micro-batch is on the device; the next one's copy overlaps its compute
                    args, kwargs = ahead.take()
                    following = running[position + 1] if position + 1 < len(running) else None
                    ahead = None if following is None else moving.prefetch(*micro_batches[following])
                factor = factors[index] or 0.0
                with self.sync.micro_batch(last=index == last):
                    try:
                        loss = self.func(*args, **kwargs)
                    except AccumulationMisuse:
                        raise
                    except Exception as error:
                        if 1 < stop - start < piece.size and not should_reduce_batch_size(error):
                            _hint_whole(error, piece, stop - start)
                        raise
                    self.watch.loss_done()
                    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                        raise _loss_error(self.func, loss)
                    if factor != 1.0:
                        loss = loss * factor
                    scaled = loss if self.scaler is None else self.scaler.scale(loss)
                    if autocast:
                        with _autocast_off(autocast):
                            self.backward(scaled)
                    else:
                        self.backward(scaled)
                self.watch.backward_done()
                loss = loss.detach()
                total = loss if total is None else total + loss
        if total is None:  # every micro-batch counted 0 items: nothing to learn from, no NaN
            return torch.zeros((), device=self.params[0].device if self.params else None)
        return total if total.dim() == 0 else total.reshape(())


def accumulate(
    func: Callable[..., Any],
    model: torch.nn.Module,
    initial_micro_batch: int,
    batch: LogicalBatch,
    *,
    reduction: str,
    scaler: Any,
    runner: Runner,
    context: Optional[Hashable] = None,
    weight: Optional[Callable[..., Any]] = None,
    stats: Optional[AccumulationStats] = None,
    name: Optional[str] = None,
    backward: Optional[Callable[[torch.Tensor], Any]] = None,
    total: Any = None,
    sync: Any = None,
) -> torch.Tensor:
    """Forward and backward `func(*micro_args, **micro_kwargs)` over the logical batch (an `ArgumentBatch` of
    a call's arguments, or `ArgumentPieces` of several) in micro-batches; returns the logical batch's loss, detached.
    Arguments are checked by the caller (`toma.forms`, `toma.training.trainer`). The cached size is the one asked
    for, not capped by this batch's rows: a short batch never shrinks it, only an out-of-memory error does.
    `runner`: the cache and the policy (`toma.sizing.defaults.ACCUMULATION` where none is given); `context`: the
    cache's context for this call.

    For frameworks that run the backward pass and count the items themselves (`toma.integrations`):
    `backward(loss)` replaces `loss.backward()` (an accelerator's backward, which scales for mixed precision);
    `total`, with `weight=`, is what each micro-batch's count is a share of: each micro-loss is weighted count /
    total instead of count / the batch's own count, and the ranks' gradients are averaged as DDP does (not weighted
    by their counts). It is the items of a larger mean where the loss is one (a gradient-accumulation window, every
    rank's batches), or the batch's own count where the framework's loss already accounts for the ranks
    (`TomaTrainer`). `sync`: how the
    gradients meet other ranks' (one of `toma.accumulation.sync`'s); None: the one `model` calls for
    (`sync_for`)."""
    step = AccumulateStep(
        func, model, batch, reduction, weight, scaler, runner.resolved_policy(), name, backward, total, sync
    )
    state = None
    try:
        state = runner.drive(step, initial_micro_batch, context, step.sync.agreement)
    finally:
        if stats is not None:
            stats.calls += 1
            stats.oom_retries += max(0, step.attempts - 1)
    if stats is not None:
        stats.micro_batch = step.size
        stats.weight = step.total_weight
        stats.learned = state.entry.learned if state is not None else None
    assert step.result is not None
    return step.result
