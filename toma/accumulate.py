"""Gradient accumulation: a logical batch larger than memory, trained in micro-batches with exact gradients.

The logical batch is one unit of work for the engine: an attempt runs forward and backward for every
micro-batch at one size; an out-of-memory error anywhere in it (forward, backward, after some parameters
already got gradients) drops that attempt's gradients exactly (`GradientStash`), and the engine redoes the
whole logical batch at a smaller micro-batch size. The logical batch itself never changes.

With `reduction="mean"` each micro-loss is weighted by its share of the rows, n_i / N, so the gradients are
those of one full-batch pass also when the last micro-batch is smaller.
"""

import contextlib
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from toma import engine
from toma.batchsize_cache import BatchsizeCache
from toma.distributed import Agreement, all_reduce_gradients, is_distributed
from toma.gradients import GradientStash
from toma.policy import SizePolicy
from toma.splitting import BatchSplit

__all__ = ["accumulate", "AccumulationStats", "check_model", "check_reduction", "check_scaler", "REDUCTIONS"]

log = logging.getLogger("toma")

REDUCTIONS = ("mean", "sum")

_AUTOCAST_DEVICE_TYPES = ("cuda", "cpu", "xpu", "mps", "hpu")


def check_model(model: Any, name: str) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{name} must be the torch.nn.Module whose gradients are accumulated, got {model!r}")
    return model


def check_reduction(reduction: Any, name: str) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name} must be 'mean' or 'sum' (how the loss function reduces a batch), got {reduction!r}")
    return reduction


def check_scaler(scaler: Any, name: str) -> Any:
    if scaler is not None and not callable(getattr(scaler, "scale", None)):
        raise TypeError(f"{name} must be a torch.amp.GradScaler (or None), got {scaler!r}")
    return scaler


class LocalSync:
    """A module on one process: micro-batches need no synchronisation context."""

    _nothing = contextlib.nullcontext()
    copy_grads = False  # the gradients set aside are nobody else's to write
    agreement = None

    def micro_batch(self, last: bool) -> ContextManager[Any]:
        return self._nothing

    def abort(self) -> None:
        pass


class DDPNoSync:
    """DistributedDataParallel: all micro-batches but the last under `no_sync()`, so the gradients are
    all-reduced once per logical batch, overlapping the last micro-batch's backward pass."""

    agreement = None  # one rank: DDP's reduction in the last backward pass cannot be left unmatched

    def __init__(self, model: DistributedDataParallel) -> None:
        self.model = model
        # With gradient_as_bucket_view the reducer writes the reduced gradients into the memory the old
        # `.grad` tensors view, so the gradients a call starts with must be kept as copies.
        self.copy_grads = bool(getattr(model, "gradient_as_bucket_view", False))

    def micro_batch(self, last: bool) -> ContextManager[Any]:
        return contextlib.nullcontext() if last else self.model.no_sync()

    def abort(self) -> None:
        # A backward pass that failed after DDP's hooks fired leaves its reducer expecting the rest of the
        # reduction; without a reset the retry's forward fails with "Expected to have finished reduction".
        reducer = getattr(self.model, "reducer", None)
        if reducer is not None and hasattr(reducer, "_reset_state"):
            reducer._reset_state()


class AgreeingDDP:
    """DistributedDataParallel over several ranks: no collective inside the region that may be retried.

    Every micro-batch runs under `no_sync()`; after the logical batch the ranks agree (one small all-reduce)
    whether any ran out of memory, and only if none did are the gradients all-reduced, once, in buckets
    (`toma.distributed.all_reduce_gradients`). Letting DDP reduce during the last backward pass would overlap
    communication with it, but a rank that runs out of memory there leaves the others' all-reduces unmatched:
    the hang this design exists to prevent. The lost overlap is the price (see the benchmark).
    """

    copy_grads = False  # DDP's reducer never runs, so nothing writes into the gradients set aside

    def __init__(self, model: DistributedDataParallel) -> None:
        self.model = model
        self.agreement = Agreement(model.process_group)

    def micro_batch(self, last: bool) -> ContextManager[Any]:
        return self.model.no_sync()

    def synchronise(self, params: List[torch.Tensor]) -> None:
        all_reduce_gradients(params, self.model.process_group)
        if getattr(self.model, "broadcast_buffers", False):
            # Under no_sync DDP stops broadcasting buffers (BatchNorm statistics) before forward passes;
            # a real synchronised step would turn it back on for the next one, so do what it would.
            self.model.require_forward_param_sync = True

    def abort(self) -> None:
        pass


def sync_for(model: torch.nn.Module) -> Any:
    if not isinstance(model, DistributedDataParallel):
        return LocalSync()
    return AgreeingDDP(model) if is_distributed(model.process_group) else DDPNoSync(model)


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
            "toma: %s has BatchNorm layers (%s) in training mode: with the logical batch split into "
            "micro-batches their statistics are those of each micro-batch, not of the full batch",
            type(model).__name__,
            ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""),
        )


def _loss_error(func: Callable[..., Any], loss: Any) -> TypeError:
    what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)
    name = getattr(func, "__qualname__", repr(func))
    return TypeError(f"{name} must return the micro-batch's loss as a scalar tensor, got {what}")


@dataclass
class AccumulationStats:
    """What the calls of one accumulating function went through (best effort across threads)."""

    micro_batch: Optional[int] = None  # the size the last finished logical batch ran at
    oom_retries: int = 0  # logical batches redone after an out-of-memory error, over all calls
    calls: int = 0


class AccumulateStep:
    """One attempt at the whole logical batch: forward and backward of every micro-batch at `size`."""

    size_name = "micro-batch size"
    finished = False  # the logical batch is one unit: redone whole after an out-of-memory error

    def __init__(
        self,
        func: Callable[..., Any],
        model: torch.nn.Module,
        split: BatchSplit,
        reduction: str,
        scaler: Any,
        policy: SizePolicy,
    ) -> None:
        self.func, self.model, self.split, self.policy = func, model, split, policy
        self.mean = reduction == "mean"
        self.scaler = scaler
        self.sync = sync_for(model)
        self.params: List[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        self.result: Optional[torch.Tensor] = None
        self.attempts = 0
        self.size: Optional[int] = None

    def __call__(self, size: int) -> bool:
        self.attempts += 1
        self.size = size
        total_rows = self.split.size
        if size < total_rows:
            _warn_once_about_batchnorm(self.model)
        agreement = self.sync.agreement
        try:
            with GradientStash(self.params, copy=self.sync.copy_grads):
                try:
                    result = self._micro_batches(size, total_rows)
                except Exception as error:
                    if agreement is not None:  # tell the other ranks, inside the stash: a retry restores all
                        agreement.after_attempt(size, error, self.policy)
                    raise
                if agreement is not None:
                    agreement.after_attempt(size, None, self.policy)
                    self.sync.synchronise(self.params)  # only this call's gradients: earlier ones are set aside
                self.result = result
        except BaseException:
            self.sync.abort()
            raise
        return True

    def _micro_batches(self, size: int, total_rows: int) -> torch.Tensor:
        autocast = _enabled_autocast()
        total: Optional[torch.Tensor] = None
        for start in range(0, total_rows, size):
            stop = min(start + size, total_rows)
            args, kwargs = self.split.micro_batch(start, stop)
            with self.sync.micro_batch(last=stop >= total_rows):
                loss = self.func(*args, **kwargs)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise _loss_error(self.func, loss)
                if self.mean and stop - start < total_rows:
                    loss = loss * ((stop - start) / total_rows)
                scaled = loss if self.scaler is None else self.scaler.scale(loss)
                if autocast:
                    with _autocast_off(autocast):
                        scaled.backward()
                else:
                    scaled.backward()
            loss = loss.detach()
            total = loss if total is None else total + loss
        assert total is not None
        return total if total.dim() == 0 else total.reshape(())


def accumulate(
    func: Callable[..., Any],
    model: torch.nn.Module,
    initial_micro_batch: int,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    *,
    reduction: str,
    scaler: Any,
    cache: BatchsizeCache,
    policy: SizePolicy,
    stats: Optional[AccumulationStats] = None,
) -> torch.Tensor:
    """Forward and backward `func(*micro_args, **micro_kwargs)` over the logical batch in micro-batches;
    returns the logical batch's loss, detached. Arguments are checked by the caller (`toma.forms`)."""
    split = BatchSplit(args, kwargs)
    step = AccumulateStep(func, model, split, reduction, scaler, policy)
    try:
        engine.drive(step, cache, min(initial_micro_batch, split.size), policy, step.sync.agreement)
    finally:
        if stats is not None:
            stats.calls += 1
            stats.oom_retries += max(0, step.attempts - 1)
    if stats is not None:
        stats.micro_batch = step.size
    assert step.result is not None
    return step.result
