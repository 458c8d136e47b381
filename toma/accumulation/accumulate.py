"""Gradient accumulation: a logical batch larger than memory, trained in micro-batches with exact gradients.

The logical batch is one unit of work for the engine: an attempt (`toma.accumulation.step.AccumulateStep`)
runs forward and backward for every micro-batch at one size; an out-of-memory error anywhere in it rolls the
attempt back and the engine redoes the whole logical batch at a smaller micro-batch size.
"""

from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Callable, Hashable, List, NamedTuple, Optional

import torch

from toma.accumulation.coupling import CoupledRows, SplitCheck
from toma.accumulation.misuse import AccumulationMisuse
from toma.accumulation.options import (
    REDUCTIONS,
    AccumulationOptions,
    NothingCounted,
    check_model,
    check_reduction,
    check_scaler,
    check_weight,
)
from toma.accumulation.per_function import learned_about
from toma.accumulation.step import AccumulateStep
from toma.batching.logical import LogicalBatch
from toma.batching.micro_batch_cost import MicroBatchCost
from toma.core.caches import LearnedState
from toma.core.policy import CallState
from toma.core.runner import Runner
from toma.levers.cost import TIMED_CALLS, LeverCost

__all__ = [
    "accumulate",
    "MicroBatchSizing",
    "AccumulationStats",
    "AccumulationMisuse",
    "CoupledRows",
    "AccumulationOptions",
    "NothingCounted",
    "check_model",
    "check_reduction",
    "check_scaler",
    "check_weight",
    "REDUCTIONS",
]


@dataclass
class AccumulationStats:
    """What the calls of one accumulating function went through (best effort across threads)."""

    micro_batch: Optional[int] = None  # the size the last finished logical batch ran at
    by_tokens: bool = False  # whether that size is a token budget (`lengths=`) rather than rows
    oom_retries: int = 0  # logical batches redone after an out-of-memory error, over all calls
    calls: int = 0
    weight: Optional[float] = None  # what the last logical batch's loss averaged over (rows, or weight's total)
    learned: Optional[LearnedState] = None  # what the policy learned at the call site's entry
    # with `lengths=`: what one more micro-batch costs in padded positions (measured on the first ones)
    packing: MicroBatchCost = field(default_factory=MicroBatchCost)
    # whether the loss is what its parts add up to: checked once, on the first split (`toma.accumulation.coupling`)
    split_check: SplitCheck = field(default_factory=SplitCheck)
    # the memory levers the last call ran with (`toma.levers`: checkpointing, offload); the cache entry remembers
    # them with its size, so calls that use it start with them on
    levers: List[str] = field(default_factory=list)
    # the time per item (row, or token with `lengths=`) with the levers on and without (`toma.levers.cost`)
    lever_cost: LeverCost = field(default_factory=LeverCost)

    def __str__(self) -> str:
        """A short summary for people (`print(trainer.toma_stats)`); `repr` keeps every field."""
        unit = "token budget" if self.by_tokens else "micro-batch"
        size = "no call finished yet" if self.micro_batch is None else f"{unit} {self.micro_batch}"
        retries = f"{self.oom_retries} out-of-memory {'retry' if self.oom_retries == 1 else 'retries'}"
        parts = [size, f"{retries} over {self.calls} {'call' if self.calls == 1 else 'calls'}"]
        if self.split_check.coupled:
            chosen = self.split_check.speed.chosen
            fastest = f" in micro-batches of {chosen} rows, the fastest" if chosen is not None else ""
            parts.append(f"the loss couples rows: gradient caching{fastest}")
        if self.levers:
            parts.append(f"memory levers: {', '.join(self.levers)}")
        return f"toma: {'; '.join(parts)}"

    @property
    def model(self) -> Any:
        """FitToMemory's memory model of the call site once it measured (a need per item of the batch), read
        when asked: fitting it on every call would cost the hot path."""
        return None if self.learned is None else self.learned.model()


class MicroBatchSizing(NamedTuple):
    """Where a call's micro-batch size comes from and what it reports: `initial`, the size asked for (cached
    as it is: a short batch never shrinks it, only an out-of-memory error does; None: the whole logical batch, or
    `initial_tokens` where the options give a token budget), the `runner` (the cache and the
    policy: `toma.sizing.defaults.ACCUMULATION` where none is given), the cache's `context` for this call, the
    `stats` to update (None: none)."""

    initial: Optional[int]
    runner: Runner
    context: Optional[Hashable] = None
    stats: Optional[AccumulationStats] = None


def accumulate(
    func: Callable[..., Any],
    batch: LogicalBatch,
    options: AccumulationOptions,
    sizing: MicroBatchSizing,
    total: Any = None,
) -> torch.Tensor:
    """Forward and backward `func(*micro_args, **micro_kwargs)` over the logical batch (an `ArgumentBatch` of
    a call's arguments, or `ArgumentPieces` of several) in micro-batches; returns the logical batch's loss, detached.
    Options are checked by the caller (`toma.forms`, `toma.training.trainer`).

    `total` (for frameworks that count the items themselves), with `weight=`, is what each micro-batch's count is a
    share of: each micro-loss is weighted count / total instead of count / the batch's own count, and the ranks'
    gradients are averaged as DDP does (not weighted by their counts). It is the items of a larger mean where the
    loss is one (a gradient-accumulation window, every rank's batches), or the batch's own count where the
    framework's loss already accounts for the ranks (`TomaTrainer`)."""
    runner = sizing.runner
    stats = sizing.stats
    # without stats of its own (explicit.accumulate), what is learned about the function is kept for its code
    kept = stats if stats is not None else learned_about(func, options.reduction, options.weight, options.lengths)
    step = AccumulateStep(func, batch, options, runner.resolved_policy(), total, kept.packing, kept.split_check)
    state = None
    timing = stats is not None and stats.lever_cost.timing  # only the first calls of each kind are timed
    started = _clock(step.device) if timing else 0.0
    try:
        initial = step.initial_size(sizing.initial, options.initial_tokens)
        state = runner.drive(step, initial, sizing.context, step.sync.agreement)
    finally:
        levers = step.memory_levers.names
        if levers:
            step.memory_levers.turn_off()  # the model as the user gave it
        if stats is not None:
            stats.calls += 1
            stats.oom_retries += max(0, step.attempts - 1)
            if levers or stats.levers:
                stats.levers = list(levers)
                stats.lever_cost.saw(levers)
    if stats is not None:
        _finished(stats, step, state, started if timing else None)
    assert step.result is not None
    return step.result


def _clock(device: Optional[torch.device]) -> float:
    """The time, once the work queued on `device` ran (a CUDA device's queue would hide it)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return perf_counter()


def _finished(
    stats: AccumulationStats, step: AccumulateStep, state: Optional[CallState[Any]], started: Optional[float]
) -> None:
    """What a call that finished tells its stats; its time (from `started`, where it was taken) where it is among
    the first that ran once (a failed attempt's time is not the work's) with its levers, or without."""
    stats.micro_batch = step.size
    stats.by_tokens = step.tokens is not None
    stats.weight = step.total_weight
    stats.learned = state.entry.learned if state is not None else None
    cost, levers = stats.lever_cost, step.memory_levers.names
    if started is not None and step.attempts == 1 and (cost.lever_calls if levers else cost.plain_calls) < TIMED_CALLS:
        cost.timed(levers, _clock(step.device) - started, step.items)
