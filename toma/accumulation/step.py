"""The accumulation step: one attempt at the whole logical batch, forward and backward of every micro-batch at
one size, composed of its parts: the rollbacks (`toma.accumulation.rollback`, `gradients`), the gradient sync
(`sync`), the micro-batch plan (`plan`), the misuse watch (`misuse`) and the backward pass (`backward`).

An out-of-memory error anywhere in an attempt (forward, backward, after some parameters already got gradients)
drops that attempt's gradients exactly, puts back the training modules' buffers, the random state and the
modules' pending state, and the engine redoes the whole logical batch at a smaller micro-batch size. The logical
batch itself never changes.
"""

import functools
import logging
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

from toma.accumulation.backward import backward_pass
from toma.accumulation.coupling import CoupledRows, SplitCheck, check_split_once
from toma.accumulation.diagnostics import hint_whole, loss_error, warn_once_about_batchnorm
from toma.accumulation.gradient_cache import GradientCache, called_module, with_calls_cut
from toma.accumulation.gradients import GradientStash
from toma.accumulation.levers_in_use import LeversInUse
from toma.accumulation.misuse import AccumulationMisuse, MisuseWatch
from toma.accumulation.options import AccumulationOptions
from toma.accumulation.plan import Arguments, MicroBatchPlan, Weighting
from toma.accumulation.rollback import (
    BufferSlot,
    BufferStash,
    PendingStash,
    RandomRollback,
    Rollback,
    Rollbacks,
    buffer_slots,
    is_pending_state,
)
from toma.accumulation.sync import GradientSync, LocalSync, model_device
from toma.accumulation.sync_choice import sync_for
from toma.batching.groups import GroupedBatch
from toma.batching.logical import LogicalBatch
from toma.batching.micro_batch_cost import NEVER, MicroBatchCost
from toma.batching.micro_batch_moves import pipeline_for, prefetched
from toma.batching.splitting import ArgumentBatch, MicroBatch
from toma.batching.tokens import TokenBatch, TokenPiece, token_batches
from toma.core.agreement import AgreedRetry
from toma.core.oom import collective, should_reduce_batch_size
from toma.core.steps import TOKEN_BUDGET, Step
from toma.sizing.policies import SizePolicy

__all__ = ["AccumulateStep"]

log = logging.getLogger("toma")


def _walk(model: torch.nn.Module) -> Tuple[List[torch.Tensor], List[BufferSlot], List[Any]]:
    """In one walk over the modules: the parameters that train (in `model.parameters()`'s order), the buffers a
    forward pass may update, and the modules that keep pending state."""
    params: List[torch.Tensor] = []
    slots: List[BufferSlot] = []
    pending: List[Any] = []
    seen = set()
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        if is_pending_state(module):
            pending.append(module)
        elif module._buffers:
            slots += buffer_slots(module)
    return params, slots, pending


class AccumulateStep(Step):
    """One attempt at the whole logical batch: forward and backward of every micro-batch at `size`. `policy` is
    the engine's (the ranks' agreement asks it); `total`, with `weight=`, what each micro-batch's count is a share
    of (see `toma.accumulation.accumulate.accumulate`)."""

    size_name = "micro-batch size"

    @property
    def layout(self) -> str:  # type: ignore[override]
        return self.sync.layout

    finished = False  # the logical batch is one unit: redone whole after an out-of-memory error
    first_asked: Optional[int] = None  # the size the call's first attempt was asked to run at

    def __init__(
        self,
        func: Callable[..., Any],
        batch: LogicalBatch,
        options: AccumulationOptions,
        policy: SizePolicy,
        total: Any = None,
        cost: Optional[MicroBatchCost] = None,
        split_check: Optional[SplitCheck] = None,
    ) -> None:
        self.func, self.batch, self.options, self.policy, self.name = func, batch, options, policy, options.name
        self.model = model = options.model
        given = options.gradient_sync
        self.sync = sync = given if isinstance(given, GradientSync) else sync_for(model, given)
        self.weighting = Weighting(options.reduction == "mean", options.weight, total, sync.agreement is not None)
        # with a `total` that spans the ranks already, their gradients are averaged as DDP does
        self.rank_weighted = options.weight is not None and total is None
        self.params, slots, pending = _walk(model)
        self.random_on = self.params + [
            t for piece in batch.pieces for _, t in piece.tensors[:1]
        ]  # generators' devices
        parts: List[Rollback] = [RandomRollback(self.random_on)]
        if pending:
            parts.append(PendingStash(modules=pending))
        if slots:
            parts.append(BufferStash(slots=slots))
        parts.append(GradientStash(self.params, copy=sync.copy_grads))
        if options.rollback is not None:
            parts.append(options.rollback)
        self.rollbacks = Rollbacks(parts)
        self.watch = MisuseWatch(self.params, model, check_grads=sync.watch_grads)
        self.transfers = pipeline_for(self.params, batch)
        # With `lengths=`: the pieces sorted by row length, and the size a token budget
        self.tokens: Optional[List[TokenPiece]] = None
        if options.lengths is not None:
            # never split to save padding: a micro-batch so costly that no padding saved pays for one more
            whole = MicroBatchCost(NEVER) if not options.split_for_padding else None
            self.tokens = token_batches(batch.pieces, options.lengths, whole or cost or MicroBatchCost())
            self.size_name = TOKEN_BUDGET
        # Whether the loss is what its parts add up to: checked once per call site, on its first split
        checks = options.check_split and split_check is not None and not split_check.done
        self.split_check = split_check if checks else None
        self.coupling = split_check if options.check_split else None  # coupled: gradient caching (`_cached`)
        self.result: Optional[torch.Tensor] = None
        self.total_weight: Optional[float] = None
        self.attempts = 0
        self.size: Optional[int] = None
        self.failing_units: Optional[int] = None  # the units of the micro-batch in flight when an attempt failed
        self.failing_piece: Any = None
        self.grouped = any(isinstance(piece, GroupedBatch) for piece in batch.pieces)
        # below one unit: memory levers, on this process alone or on every rank together (by agreement)
        enabled = options.levers and (sync.agreement is not None or isinstance(sync, LocalSync))
        self.memory_levers = LeversInUse(model, enabled)

    @property
    def row_items(self) -> float:
        """The elements a row of the batch's widest piece holds, summed over its tensors (a token's, with a token
        budget): a learning policy sizes by elements, so batches padded to other widths need no new search."""
        if self.tokens is not None:
            return float(max(sum(t.numel() for _, t in s.batch.tensors) / s.area for s in self.tokens))
        return float(max(sum(t.numel() for _, t in piece.tensors) / piece.size for piece in self.batch.pieces))

    @property
    def items(self) -> int:
        """What the logical batch holds, as the size counts it: rows, or with a token budget its padded area."""
        if self.tokens is not None:
            return sum(piece.area for piece in self.tokens)
        return sum(piece.size for piece in self.batch.pieces)

    def initial_size(self, rows: Optional[int], tokens: Optional[int]) -> int:
        """The size a call starts from: `rows` (None: the whole logical batch, its largest piece); with a token
        budget, `rows` rows of the batch's longest, else `tokens` where the budget was given, else the whole
        batch's padded area."""
        if self.tokens is None:
            return rows if rows is not None else max(piece.size for piece in self.batch.pieces)
        if rows is not None:
            return rows * max(s.longest for s in self.tokens)
        return tokens if tokens is not None else max(s.area for s in self.tokens)

    def at_smallest(self, size: int) -> bool:
        """With a token budget or groups: the micro-batch that ran out of memory held one unit (a row trimmed to its
        own length, a group, a packed sequence), which no smaller size makes any smaller."""
        return (self.tokens is not None or self.grouped) and self.failing_units == 1

    def lighten(self) -> str:
        """The next memory lever, turned on for the rest of the call (see `toma.accumulation.levers_in_use`);
        ranks that agree turn levers on together instead, when they agree to retry lighter (`__call__`)."""
        return self.memory_levers.next() if self.sync.agreement is None else ""

    @property
    def levers(self) -> Tuple[str, ...]:
        return self.memory_levers.in_effect

    def use_levers(self, names: Tuple[str, ...]) -> None:
        self.memory_levers.turn_on(names)

    def smallest_reason(self) -> str:
        """What the one unit that did not fit was, and the memory levers tried on it."""
        reason, tried = self._unit_reason(), ", ".join(self.memory_levers.names)
        return f"{reason}{'; ' if reason and tried else ''}{tried + ' tried too' if tried else ''}"

    def _unit_reason(self) -> str:
        """What the one unit that did not fit was (a row trimmed to its length, a group, a packed sequence)."""
        if self.failing_units != 1 or not (self.tokens is not None or self.grouped):
            return ""
        if self.options.groups == "batch":
            return "groups='batch': the batch is never split, its rows relate to each other"
        piece = self.failing_piece
        rows = piece.rows_between(0, 1) if isinstance(piece, GroupedBatch) else 1
        if self.options.groups == "pairs":
            return "the micro-batch held one pair of rows (groups='pairs'), which stay together"
        if isinstance(piece, GroupedBatch):
            return f"the micro-batch held one group ({rows} rows), which stays together"
        if getattr(piece, "unit_name", "") == "packed sequences":
            return "the micro-batch held one packed sequence"
        return "the micro-batch held one row, trimmed to its own length"

    @property
    def device(self) -> Optional[torch.device]:
        """Where the model computes (see `toma.core.steps.Step`)."""
        return model_device(self.params)

    def effective(self, size: int) -> int:
        """A micro-batch never holds more rows than the largest piece of the logical batch (nor a token budget more
        than its padded area)."""
        if self.tokens is not None:
            return min(size, max(s.area for s in self.tokens))
        return min(size, self.batch.largest)

    def __call__(self, size: int) -> bool:
        self.attempts += 1
        if self.first_asked is None:
            self.first_asked = size  # the ranks agreed on it: the same on every rank
        asked, size = size, self.effective(size)
        self.size = size
        self.rollbacks.begin()
        try:
            result = self._agreed(asked, size)
        except BaseException as error:
            try:
                self.rollbacks.undo()
            finally:
                self.sync.reset()
            if isinstance(error, AgreedRetry) and error.lighter and self._lightened() and asked < self.first_asked:
                # FSDP2's next mode: sizing starts again where this call started, not at the size the old one
                # could not fit (the cause kept: the engine names it in the log line)
                raise AgreedRetry(self.first_asked, error.reason, lighter=True, restart=True) from error.__cause__
            raise
        self.rollbacks.keep()
        self.result = result
        return True

    def _has_lighter(self) -> bool:
        """Whether the ranks may retry at the smallest size in a way that needs less memory (see `_lightened`)."""
        return self.sync.lighter or self.memory_levers.has_next()

    def _lightened(self) -> bool:
        """Every rank agreed to retry at the smallest size in a way that needs less memory: FSDP2's next mode
        where the sync has one (True: what the old mode's sizes taught does not hold for it), else the next memory
        lever."""
        if self.sync.lighter:
            self.sync = self.sync.lightened()
            return True
        self.memory_levers.next()
        return False

    def _agreed(self, asked: int, size: int) -> torch.Tensor:
        """The attempt, then, with other ranks, their agreement and the gradients' reduction (this call's only:
        the ones it started with are set aside)."""
        agreement = self.sync.agreement
        if agreement is None:
            result = self._attempt(asked, size)
        else:  # the other ranks told this rank's outcome (the retry restores all); agreements within pass
            attempt = functools.partial(self._attempt, asked, size)
            result = agreement.reported(
                attempt, asked, self.policy, lambda: size, lighter=self._has_lighter, met_within=True
            )
        if agreement is None:
            self.sync.reduce(self.params, self.total_weight if self.rank_weighted else None)
        else:  # every rank agreed to reduce: an error from here on is one the others cannot meet (never retried)
            with collective("gradients' reduction, after every rank agreed to it"):
                self.sync.reduce(self.params, self.total_weight if self.rank_weighted else None)
        return result

    def _attempt(self, asked: int, size: int) -> torch.Tensor:
        """Forward and backward of every micro-batch at `size` (`asked`: what the ranks agreed on); the loss, detached."""
        plan = MicroBatchPlan(self.batch, size, self.weighting, self.tokens)
        self.total_weight = plan.weight
        if len(plan.micro_batches) > 1:
            warn_once_about_batchnorm(self.model)
        backward = backward_pass(self.options.backward, self.options.scaler) if torch.is_grad_enabled() else _none
        func, sync, watch = self.func, self.sync, self.watch
        sync.begin(asked, len(plan.running), self.total_weight if self.rank_weighted else None)
        if self.split_check is not None:
            self._check_split(plan)
        if len(plan.micro_batches) > 1 and self.coupling is not None and self.coupling.coupled:
            if not self._may_cache():  # a later batch gradient caching cannot cut: never trained split
                raise CoupledRows(
                    f"{self.label()}: its loss couples rows (found before), and this batch cannot be cut by gradient "
                    "caching (loader batches in pieces, or padding-free rows): pass groups= or a batch that fits"
                )
            return self._cached(size, backward)
        each = sync.each_micro_batch
        last = plan.running[-1][0] if plan.running else -1
        total: Optional[torch.Tensor] = None
        timer = self.tokens[0].cost.timer(self.device) if self.tokens else None
        with watch:
            for (index, factor), (args, kwargs) in zip(plan.running, self._arguments(plan)):
                _, start, stop = plan.micro_batches[index]
                self.failing_units, self.failing_piece = stop - start, plan.micro_batches[index][0]
                if timer is not None:
                    timer.begin(plan.areas[index])  # type: ignore[index]
                with sync.scope(index == last):
                    try:
                        loss = func(*args, **kwargs)
                    except AccumulationMisuse:
                        raise
                    except Exception as error:
                        _hint(error, plan.micro_batches[index])
                        raise
                    watch.loss_done()
                    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                        raise loss_error(func, loss)
                    if factor != 1.0:
                        loss = loss * factor
                    backward(loss)
                if index != last:
                    watch.backward_done()
                if each:
                    sync.micro_batch_done()
                loss = loss.detach()
                total = loss if total is None else total + loss
        if timer is not None:
            timer.end()
        if sync.collectives_in_passes:
            self._join(plan, sync.rounds_to_join(len(plan.running)), backward)
        sync.finish(self.params)
        self.failing_units = None
        if total is None:  # every micro-batch counted 0 items: nothing to learn from, no NaN
            return torch.zeros((), device=self.params[0].device if self.params else None)
        return total if total.dim() == 0 else total.reshape(())

    def _join(self, plan: MicroBatchPlan, rounds: int, backward: Callable[[torch.Tensor], None]) -> None:
        """The rounds other ranks' micro-batches make this one run where the passes run collectives (they must
        match on every rank): its last micro-batch again, its loss and gradients counting nothing (a training-mode
        forward pass: BatchNorm statistics and the random state move on as in one more micro-batch)."""
        if rounds <= 0:
            return
        if not plan.micro_batches:
            raise ValueError(
                "toma.accumulate: this rank's logical batch is empty, but the other ranks' micro-batches run FSDP2's "
                "collectives in their passes (gradient_sync='sharded'), which every rank must join: give it a row"
            )
        index = plan.running[-1][0] if plan.running else len(plan.micro_batches) - 1  # one with a loss, if any
        piece, start, stop = plan.micro_batches[index]
        width = None if plan.widths is None else plan.widths[index]
        for _ in range(rounds):
            args, kwargs = self._part_arguments(piece, start, stop, width)
            backward(self.func(*args, **kwargs) * 0.0)

    def _check_split(self, plan: MicroBatchPlan) -> None:
        """The first split of this call site: its first micro-batch's loss against its halves'
        (`toma.accumulation.coupling`), then everything the check changed rolled back. Not where the passes run
        collectives (every strategy's others run none after begin()): the check's passes would be this rank's."""
        check = self.split_check
        if len(plan.running) < 2 or check is None or check.done or self.sync.collectives_in_passes:
            return
        index = plan.running[0][0]
        piece, start, stop = plan.micro_batches[index]
        width = None if plan.widths is None else plan.widths[index]
        try:
            check_split_once(
                check,
                self.func,
                self.model,
                piece,
                start,
                stop,
                width,
                self._part_arguments,
                self._unit_weight,
                not self.weighting.mean,
                self.label(),
                self._cut_loss if self._may_cache() else None,
            )
        except CoupledRows as refused:
            if getattr(refused, "other_reduction", False) or not self._may_cache():
                raise  # a reduction= to fix is said, not cached around
            check.coupled = check.done = True  # from now on by gradient caching (`_cached`)
            log.info(
                "toma: %s: %s; it trains by gradient caching from now on (the model's calls twice per row; where "
                "rows are independent and the loss averages over something else, weight= counts it for less)",
                self.label(),
                _found(refused),
            )
        except Exception as error:  # the user's own error, met first here: with the training pass's hint
            _hint(error, plan.micro_batches[index])
            raise
        finally:
            self.rollbacks.undo()
            self.rollbacks.begin()

    def _cut_loss(self, arguments: Arguments) -> Any:
        """The loss of a part with the model's calls cut into single rows, without gradients: the split check's whole
        where two rows do not fit together (the model's rows not checked here: that takes two rows at once)."""
        trusted = SplitCheck()
        trusted.rows_checked = True
        return with_calls_cut(called_module(self.model), 1, self.func, arguments, trusted, self.label())

    def _may_cache(self) -> bool:
        """Whether a loss that couples rows can train here by gradient caching: the model's calls can be cut (one
        piece of rows, no groups) and the gradient sync allows it."""
        return (
            self.sync.caches_gradients
            and not self.grouped
            and len(self.batch.pieces) == 1
            and isinstance(self.batch.pieces[0], ArgumentBatch)  # rows (a padding-free row's sequences: not yet)
            and isinstance(self.options.model, torch.nn.Module)
        )

    def _cached(self, size: int, backward: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """The attempt by gradient caching (`toma.accumulation.gradient_cache`) at `size` rows per model call; the
        whole batch's loss, detached."""
        whole = MicroBatchPlan(self.batch, self.batch.largest, self.weighting, None)
        self.total_weight = whole.weight
        if not whole.running:  # it counts nothing: nothing to learn from, no NaN (the sync told, as ever)
            self.sync.finish(self.params)
            return torch.zeros((), device=self.params[0].device if self.params else None)
        (_, factor), arguments = whole.running[0], next(iter(self._arguments(whole)))
        assert self.coupling is not None
        tokens = self.tokens is not None  # `size` is a token budget
        rows, by_width = size, tokens
        if self.tokens is not None and isinstance(self.tokens[0], TokenBatch):
            # the rows a micro-batch of the longest rows holds at this budget: each call's micro-batches hold as many
            # (sorted, trimmed), never more than the budget allows, down to one row at the smallest budget
            _, start, stop, _ = self.tokens[0].micro_batches(size)[0]
            rows, by_width = max(1, stop - start), False
        if not by_width and torch.is_grad_enabled():  # any rows give the same gradients: the fastest that fit
            rows = self.coupling.speed.rows(rows)
        cache = GradientCache(called_module(self.model), rows, self.random_on, self.coupling, self.label(), by_width)
        try:
            loss = cache.train(self.func, arguments, factor, backward, self.sync, self.watch)
        except BaseException:  # with a token budget, micro-batches of one row are the smallest
            self.failing_units, self.failing_piece = cache.chunk_rows if tokens else size, self.batch.pieces[0]
            raise
        self.sync.finish(self.params)
        return loss

    def _part_arguments(self, piece: Any, start: int, stop: int, width: Optional[int]) -> Arguments:
        """Units `[start, stop)` of `piece` as a micro-batch's arguments, where the micro-batches' are (moved to
        the model's device when it has a pipeline)."""
        if self.transfers is None:
            return piece.arguments(start, stop, width=width)  # type: ignore[no-any-return]
        return self.transfers.prefetch(piece, start, stop, width).take()  # type: ignore[no-any-return]

    def _unit_weight(self, piece: Any, start: int, stop: int, arguments: Arguments) -> Optional[float]:
        """What the loss of units `[start, stop)` averages over: `weight=`'s count, else its rows (None: 0)."""
        weight = self.weighting.weight
        if weight is None:
            return float(piece.rows_between(start, stop))
        args, kwargs = arguments
        value = weight(*args, **kwargs)
        counted = float(value.detach().reshape(()) if isinstance(value, torch.Tensor) else value)
        return counted if counted > 0 else None

    def _arguments(self, plan: MicroBatchPlan) -> Iterator[Arguments]:
        """The running micro-batches' arguments; moved to the model's device ahead of use when it has a pipeline."""
        if self.transfers is None:
            return (plan.arguments[index] for index, _ in plan.running)
        widths = plan.widths
        moving = [(*plan.micro_batches[i], None if widths is None else widths[i]) for i, _ in plan.running]
        return prefetched(self.transfers, moving)


def _none(loss: torch.Tensor) -> None:
    """No backward pass: the call runs without gradients (evaluation)."""


def _found(refused: CoupledRows) -> str:
    """What the split check found, from its error's first sentence."""
    text = str(refused)
    end = text.find(": the loss is not")
    return text[text.find(": ") + 2 : end] if end > 0 else "its loss is not what its parts add up to"


def _hint(error: Exception, micro_batch: MicroBatch) -> None:
    piece, start, stop = micro_batch
    if 1 < stop - start < piece.size and not should_reduce_batch_size(error):
        hint_whole(error, piece, stop - start)
