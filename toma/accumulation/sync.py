"""How an accumulation's gradients meet other ranks': `GradientSync`, the interface the accumulation step drives,
and its strategies: alone (LocalSync), through DDP with `no_sync` on all but the last micro-batch (DDPNoSync),
through the ranks' agreement and one all-reduce at the end (AgreeingDDP), or through the agreement alone when a
framework reduces the gradients after the logical batch (AgreeingOnly). FSDP2's are in
`toma.accumulation.fsdp2_syncs`; `toma.accumulation.sync_choice.sync_for` picks one for a model."""

import contextlib
from abc import ABC, abstractmethod
from typing import ContextManager, Iterable, Optional, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from toma.accumulation.gradient_collectives import GradientBuckets, broadcast_buffers
from toma.accumulation.plan import nothing_counted
from toma.core.agreement import Agreement

__all__ = [
    "GradientSync",
    "LocalSync",
    "DDPNoSync",
    "AgreeingDDP",
    "AgreeingOnly",
    "model_device",
    "rank_scale",
    "GRADIENT_SYNCS",
]

NOTHING: ContextManager[None] = contextlib.nullcontext()


class GradientSync(ABC):
    """How the gradients of one logical batch meet the other ranks' (or nobody's).

    The accumulation step (`toma.accumulation.step.AccumulateStep`) drives it, for every attempt at the logical
    batch, with the gradients the call started with set aside (`.grad` holds this attempt's only):

    0. `begin()` before the attempt's first micro-batch (FSDP2: every unit unsharded, nothing reduced in the
       passes).
    1. `with sync.scope(last):` around each micro-batch's forward and backward pass; `last` is True for
       the attempt's last micro-batch that runs (what DDP reduces in); then, where `each_micro_batch`,
       `micro_batch_done()`; after the last, `finish()`.
    2. After the last micro-batch, with an `agreement`, the ranks agree whether every one of them finished
       (`Agreement.after_attempt`; a rank that ran out of memory makes all retry together at one size).
    3. `reduce(params, weight)` once every rank finished: this attempt's gradients only, before they are added
       to the ones set aside.
    4. `reset()` after an attempt that raised (any exception, KeyboardInterrupt included), once its gradients,
       buffers and pending state are rolled back: whatever the strategy holds of the failed attempt goes.

    `agreement` (None: no collective may wait on this rank) is what the engine gives every rank's retry loop.
    `copy_grads`: whether the gradients set aside must be copied, because someone (DDP's reducer with
    `gradient_as_bucket_view`) writes into their memory meanwhile. `watch_grads`: whether the misuse watch may
    compare gradients between micro-batches (not where a reducer swaps them for views of its buckets).

    A new strategy is a subclass, returned by `sync_for` for its models (FSDP2's, `toma.accumulation.fsdp2_syncs`:
    `begin` holds the units unsharded, `reduce` reduces once after the agreement, `reset` clears the state a pass
    that failed half-way left behind); with a process group of several ranks it holds an `Agreement` on that
    group. Collectives inside an attempt (FSDP2's) must each be one the others can meet: an `Agreement` call
    (`before_attempt`, `all_finished`), which a failed rank's `after_attempt` matches, before any other collective.
    Where the passes themselves run collectives (`collectives_in_passes`), every rank runs as many micro-batches:
    one with fewer runs `rounds_to_join` more, counting nothing.
    """

    __slots__ = ()
    agreement: Optional[Agreement] = None
    copy_grads = False
    watch_grads = True
    layout = ""  # how the model is spread over the ranks, where that changes which sizes fit (the size file's key)
    lighter = False  # whether `lightened` has a strategy that needs less memory at the same micro-batch size
    each_micro_batch = False  # whether `micro_batch_done` and `finish` do anything
    collectives_in_passes = False  # whether a micro-batch's passes run collectives (every rank must run each)
    caches_gradients = True  # whether a loss that couples rows may train by gradient caching under it

    def rounds_to_join(self, ran: int) -> int:
        """After this rank ran `ran` micro-batches: how many more, counting nothing, the other ranks' make it run
        (where `collectives_in_passes`)."""
        return 0

    def begin(self, size: int, micro_batches: int, weight: Optional[float]) -> None:
        """Before the first micro-batch of an attempt at `size` that runs `micro_batches` of them (nothing, for
        most strategies). `weight`, as for `reduce`."""

    def micro_batch_done(self) -> None:
        """After each micro-batch's backward pass, where `each_micro_batch`."""

    def finish(self, params: Sequence[torch.Tensor]) -> None:
        """After the attempt's last micro-batch, before the ranks' agreement: what `reduce` needs of `params`'
        gradients allocated there, where a rank that runs out of memory can still tell the others."""

    def lightened(self) -> "GradientSync":
        """The strategy to retry with, on every rank, after an out-of-memory error at the smallest size, where
        `lighter`."""
        raise NotImplementedError(f"{type(self).__name__} has no lighter strategy")

    @abstractmethod
    def scope(self, last: bool) -> ContextManager[object]:
        """The context one micro-batch's forward and backward pass run in."""

    def reduce(self, params: Sequence[torch.Tensor], weight: Optional[float]) -> None:
        """After an attempt every rank finished: combine this attempt's gradients (in `.grad`) over the ranks.
        `weight`: the items this rank's mean loss averaged over (from `weight=`), to weigh each rank by its items;
        None: ranks weigh the same, as DDP does."""

    def reset(self) -> None:
        """After a failed attempt: forget what it left half-done (nothing, for most strategies)."""


class LocalSync(GradientSync):
    """A module on one process: micro-batches need no synchronisation context, nothing is reduced."""

    __slots__ = ()

    def scope(self, last: bool) -> ContextManager[object]:
        return NOTHING


class DDPNoSync(GradientSync):
    """DistributedDataParallel on one rank: all micro-batches but the last under `no_sync()`, so the gradients
    are all-reduced once per logical batch, overlapping the last micro-batch's backward pass. No agreement: DDP's
    reduction in the last backward pass cannot be left unmatched."""

    __slots__ = ("model", "copy_grads")
    watch_grads = False  # the reducer may swap gradients for views of its buckets

    def __init__(self, model: DistributedDataParallel) -> None:
        self.model = model
        # With gradient_as_bucket_view the reducer writes the reduced gradients into the memory the old
        # `.grad` tensors view, so the gradients a call starts with must be kept as copies.
        self.copy_grads = bool(model.gradient_as_bucket_view)

    def scope(self, last: bool) -> ContextManager[object]:
        return NOTHING if last else self.model.no_sync()

    def reset(self) -> None:
        # A backward pass that failed after DDP's hooks fired leaves its reducer expecting the rest of the
        # reduction; without a reset the retry's forward fails with "Expected to have finished reduction".
        reducer = getattr(self.model, "reducer", None)  # absent before DDP built it
        if reducer is not None and hasattr(reducer, "_reset_state"):  # torch >= 2.2
            reducer._reset_state()


class AgreeingDDP(GradientSync):
    """DistributedDataParallel over several ranks: no collective inside the region that may be retried.

    Every micro-batch runs under `no_sync()`; the buckets are filled (`finish`), then the ranks agree (one small
    all-reduce) whether any ran out of memory, and only if none did are the buckets all-reduced, once
    (`toma.accumulation.gradient_collectives.GradientBuckets`): a rank short of memory for the buckets says so at the
    agreement. Letting DDP reduce during the last backward pass would overlap
    communication with it, but a rank that runs out of memory there leaves the others' all-reduces unmatched:
    the hang this design exists to prevent. The lost overlap is the price (see the benchmark). DDP's reducer
    never runs, so nothing writes into the gradients set aside.
    """

    __slots__ = ("model", "agreement", "_buckets")

    def __init__(self, model: DistributedDataParallel) -> None:
        self.model = model
        self.agreement: Agreement = Agreement(model.process_group, _ddp_device(model))
        # Set on construction (and by a synchronised forward pass outside toma), it makes the next forward
        # pass broadcast buffers; `reduce` does that outside the retried region instead.
        model.require_forward_param_sync = False
        self._buckets: Optional[GradientBuckets] = None

    def scope(self, last: bool) -> ContextManager[object]:
        return self.model.no_sync()

    def finish(self, params: Sequence[torch.Tensor]) -> None:
        self._buckets = GradientBuckets(list(params))

    def reduce(self, params: Sequence[torch.Tensor], weight: Optional[float]) -> None:
        """Average this call's gradients over the ranks; with `weight` weigh each rank by its items, so the
        result is the mean over all of them rather than a mean of the ranks' means."""
        buckets, self._buckets = self._buckets, None
        assert buckets is not None
        buckets.all_reduce(self.model.process_group, scale=rank_scale(self.agreement, weight))
        if self.model.broadcast_buffers:
            # DDP would broadcast rank 0's buffers (BatchNorm statistics) in the next forward pass, a
            # collective inside the region that may be retried: a rank that skips its forward passes would
            # leave the others waiting. Broadcast them here, after the agreement, and keep DDP's off.
            broadcast_buffers(self.model)

    def reset(self) -> None:
        self._buckets = None  # a failed attempt's


def rank_scale(agreement: Agreement, weight: Optional[float]) -> float:
    """What this rank's gradients are multiplied by before the ranks' average: with `weight` (its items), its
    share of all ranks' items, so the average is the mean over all items rather than a mean of the ranks' means."""
    if weight is None:
        return 1.0
    total = agreement.sum(weight)
    if total == 0:  # every rank's: the same error on every rank, before the gradients' all-reduce
        raise nothing_counted(None, ranks=agreement.world_size)
    return weight * agreement.world_size / total


class AgreeingOnly(GradientSync):
    """Ranks whose gradients a framework reduces after the logical batch, outside the region toma may retry
    (Lightning's DDP, in the backward pass it runs on the logical batch's loss): every attempt is agreed on, as
    under AgreeingDDP, so the ranks start each logical batch at the same size and stop together, and nothing is
    reduced here."""

    __slots__ = ("agreement",)

    def __init__(self, agreement: Agreement) -> None:
        self.agreement: Agreement = agreement

    def scope(self, last: bool) -> ContextManager[object]:
        return NOTHING


def model_device(params: Iterable[torch.Tensor]) -> Optional[torch.device]:
    """Where a model computes: its first parameter's device, or a later one's on an accelerator when the
    first is on the CPU (None: no parameters)."""
    first = None
    for p in params:
        if p.device.type != "cpu":
            return p.device
        first = first or p.device
    return first


def _ddp_device(model: DistributedDataParallel) -> Optional[torch.device]:
    """DDP's device: its `device_ids[0]`, else its module's parameters' (the rank's GPU under NCCL)."""
    if model.device_ids:
        return torch.device(model.device_type, model.device_ids[0])
    return model_device(model.module.parameters())


GRADIENT_SYNCS = ("auto", "logical_batch", "micro_batch", "sharded")  # gradient_sync=, for FSDP2 models
