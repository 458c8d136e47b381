"""FSDP2's gradient syncs (`toma.accumulation.sync.GradientSync`): the units held unsharded for an attempt, the
gradients reduced once after it (AgreeingFSDP2) or after every micro-batch (ReducingFSDP2), each after the ranks'
agreement; or the parameters left sharded in FSDP2's own schedule, every collective of the passes agreed on first
(ShardedFSDP2). `fsdp2_sync` picks one for a model and its `gradient_sync=`; "auto" goes from the first to the
next where memory runs short, and remembers where it got for the model's later calls."""

import logging
import weakref
from typing import TYPE_CHECKING, ContextManager, Dict, Optional, Sequence, Tuple

import torch

from toma.accumulation.fsdp2_agreed import CollectiveAgreements
from toma.accumulation.plan import nothing_counted
from toma.accumulation.sync import NOTHING, GradientSync, model_device, rank_scale
from toma.core.agreement import AgreedRetry, Agreement
from toma.core.host_min import host_min_for

if TYPE_CHECKING:  # FSDP2 is imported when a model needs it (`fsdp2_sync`), not by `import toma`
    from toma.accumulation.fsdp2 import ShardedUnits

__all__ = ["AgreeingFSDP2", "ReducingFSDP2", "ShardedFSDP2", "fsdp2_sync"]

_log = logging.getLogger("toma")
_SHORT = 1 << 32  # added to a rank's `before_attempt` count: it cannot hold the units unsharded


class AgreeingFSDP2(GradientSync):
    """An FSDP2 model (`fully_shard` on its root and, usually, its blocks) over a process group: micro-batches
    free of collectives, then the agreement, then one reduction.

    Before an attempt every unit is unsharded (`toma.accumulation.fsdp2.ShardedUnits.hold`: the all-gathers
    FSDP2 would run in each forward pass, once), and the micro-batches' forward and backward passes neither
    all-gather, nor reduce-scatter, nor reshard: a rank that runs out of memory in any of them leaves no other
    rank waiting in a collective. After the ranks agree that all finished, the unsharded gradients are
    reduce-scattered, one unit at a time into buffers allocated before that agreement (averaged, weighted as
    `AgreeingDDP` weighs them, in FSDP2's `reduce_dtype`), each rank keeping its shard as FSDP2 leaves it; then
    the units are resharded. The price: each rank holds the unsharded parameters and gradients for the
    logical batch, as FSDP2 itself does when accumulating without `reshard_after_backward`.

    `lighter` (gradient_sync="auto"): when even the smallest micro-batch runs out of memory with the gradients
    held, every rank switches to `ReducingFSDP2` and retries, for this call and the model's later ones; where a
    rank cannot hold the units unsharded at all, to `ShardedFSDP2`."""

    caches_gradients = False  # not yet: the first pass would hold (or all-gather) the units for every call

    __slots__ = ("model", "units", "agreement", "mode", "_buffers", "_short")
    watch_grads = False  # the sharded parameters' gradients change only in `reduce`

    def __init__(self, model: torch.nn.Module, units: "ShardedUnits", agreement: Agreement, mode: str) -> None:
        self.model, self.units, self.mode = model, units, mode
        self.agreement: Agreement = agreement
        self._buffers: Optional[Dict[torch.dtype, Tuple[torch.Tensor, torch.Tensor]]] = None
        self._short = False  # a rank could not hold the units unsharded: "auto" goes on with them sharded

    @property
    def layout(self) -> str:  # type: ignore[override]
        return f"FSDP2: {len(self.units.units)} units sharded over {self.agreement.world_size} ranks"

    @property
    def lighter(self) -> bool:  # type: ignore[override]
        return self.mode == "auto"

    def lightened(self) -> GradientSync:
        if self._short:
            return _sharded(self)
        _MODES[self.model] = "micro_batch"
        _log.info(
            "toma: the FSDP2 model's unsharded gradients did not fit beside one micro-batch; from now on they are "
            "reduce-scattered after every micro-batch"
        )
        return ReducingFSDP2(self.model, self.units, self.agreement, self.mode)

    def begin(self, size: int, micro_batches: int, weight: Optional[float]) -> None:
        self._buffers = None
        self._agreed_start(size, 0)
        self.units.hold(CollectiveAgreements(self.agreement, size, 1.0))

    def _agreed_start(self, size: int, micro_batches: int) -> int:
        """Whether this rank can hold the units unsharded (`ShardedUnits.probe`), then the ranks' agreement to
        start (the largest of their `micro_batches`). In "auto", a rank that cannot makes every rank retry
        with the units sharded (`AgreedRetry.lighter`); else it raises `UnshardedDoesNotFit`, the others
        `RankFailed`."""
        from toma.accumulation.fsdp2 import UnshardedDoesNotFit

        short = False
        try:
            self.units.probe()
        except UnshardedDoesNotFit:
            if self.mode != "auto" or not self.units.can_reset:
                raise
            short = True
        agreed = self.agreement.before_attempt(size, micro_batches + (_SHORT if short else 0))
        if agreed >= _SHORT:
            self._short = True
            raise AgreedRetry(size, "a rank cannot hold the FSDP2 units unsharded; all go on with them sharded", True)
        return agreed

    def scope(self, last: bool) -> ContextManager[object]:
        return NOTHING

    def finish(self, params: Sequence[torch.Tensor]) -> None:
        self._buffers = self.units.scatter_buffers()  # before the ranks agree: see `ShardedUnits.scatter_buffers`

    def reduce(self, params: Sequence[torch.Tensor], weight: Optional[float]) -> None:
        buffers, self._buffers = self._buffers, None
        assert buffers is not None
        self.units.reduce_scatter(rank_scale(self.agreement, weight), buffers)
        self.units.keep_sums()

    def reset(self) -> None:
        self._buffers = None  # a failed attempt's: not held through the retry's probe
        self.units.reset()


class ReducingFSDP2(AgreeingFSDP2):
    """FSDP2 with the gradients reduce-scattered after every micro-batch (gradient_sync="micro_batch", or "auto"
    once the held ones did not fit): a micro-batch's forward pass no longer shares memory with the gradients of
    the ones before, for one reduce-scatter per micro-batch.

    The passes stay free of collectives; after each micro-batch the ranks agree that all finished it (a rank
    that ran out of memory in it answers with its `after_attempt`) and only then reduce-scatter. Everything the
    reduce-scatter needs is allocated before that agreement. Ranks with fewer micro-batches join the remaining
    rounds with zeros, so every rank runs as many collectives."""

    __slots__ = ("_size", "_rounds", "_done", "_weight", "_scale")
    each_micro_batch = True

    @property
    def lighter(self) -> bool:  # type: ignore[override]
        return self.mode == "auto" and self.units.can_reset

    def lightened(self) -> GradientSync:
        return _sharded(self)

    def begin(self, size: int, micro_batches: int, weight: Optional[float]) -> None:
        self._size, self._done, self._weight = size, 0, weight
        self._scale: Optional[float] = None
        self._rounds = self._agreed_start(size, micro_batches)
        self.units.hold(CollectiveAgreements(self.agreement, size, 1.0))

    def micro_batch_done(self) -> None:
        buffers = self.units.scatter_buffers()
        self.agreement.all_finished(self._size)
        if self._scale is None:
            self._scale = rank_scale(self.agreement, self._weight)
        self.units.reduce_scatter(self._scale, buffers)
        self._done += 1

    def finish(self, params: Sequence[torch.Tensor]) -> None:
        while self._done < self._rounds:
            self.micro_batch_done()

    def reduce(self, params: Sequence[torch.Tensor], weight: Optional[float]) -> None:
        if self._scale is None:  # no round ran on any rank: weighted, every rank counted nothing
            rank_scale(self.agreement, self._weight)  # raises NothingCounted, as AgreeingFSDP2 does
        self.units.keep_sums()


class ShardedFSDP2(AgreeingFSDP2):
    """FSDP2's own schedule, parameters sharded (gradient_sync="sharded", or "auto" where the units do not fit
    unsharded, or no micro-batch fits beside them): per-unit all-gathers inside the passes, resharding as the
    model was set up, FSDP2's prefetching, a reduce-scatter after every micro-batch's backward pass into FSDP2's
    sharded gradients. The memory is FSDP2's own loop's.

    What makes it retry-safe: the ranks agree before every collective FSDP2 issues in a pass, after it allocated
    the collective's buffers (`toma.accumulation.fsdp2_agreed`), so a rank that runs out of memory anywhere meets
    the others at their next collective and all leave the attempt; FSDP2's per-iteration state is then reset.
    The price: one small all-reduce per all-gather and per reduce-scatter. Every rank runs as many micro-batches
    (their passes' collectives must match): one with fewer runs its last micro-batch again, counting nothing."""

    __slots__ = ("_rounds", "_nothing", "agreements")
    collectives_in_passes = True

    @property
    def layout(self) -> str:  # type: ignore[override]
        return f"FSDP2, parameters sharded: {len(self.units.units)} units over {self.agreement.world_size} ranks"

    @property
    def lighter(self) -> bool:  # type: ignore[override]
        return False

    def begin(self, size: int, micro_batches: int, weight: Optional[float]) -> None:
        if not self.units.can_reset:
            raise NotImplementedError(
                f"gradient_sync='sharded' needs FSDP2's reset_iter_state (torch 2.13 and later), not in torch "
                f"{torch.__version__}: without it a failed pass leaves state that makes the ranks' retries differ"
            )
        self._rounds = self.agreement.before_attempt(size, micro_batches)
        # the ranks' items summed before any pass (no rank can fail between the two collectives); where they
        # count nothing, every rank raises that after the agreement, as the other FSDP2 syncs do
        total = None if weight is None else self.agreement.sum(weight)
        self._nothing = total == 0
        scale = 1.0 if weight is None or not total else weight * self.agreement.world_size / total
        self.agreements = CollectiveAgreements(self.agreement, size, scale)
        self.units.agree_before_collectives(self.agreements)

    def rounds_to_join(self, ran: int) -> int:
        rounds = self._rounds - ran
        if rounds > 0:  # what this rank reduce-scatters from here on counts nothing
            self.agreements.joining = True
        return rounds

    def finish(self, params: Sequence[torch.Tensor]) -> None:
        pass

    def reduce(self, params: Sequence[torch.Tensor], weight: Optional[float]) -> None:
        self.units.stop_agreeing()  # FSDP2 reduce-scattered each micro-batch's gradients into its sharded ones
        if self._nothing:
            raise nothing_counted(None, ranks=self.agreement.world_size)

    def reset(self) -> None:
        self.units.reset()


def _sharded(sync: AgreeingFSDP2) -> ShardedFSDP2:
    """ "auto" from here on with the parameters sharded, for this call and the model's later ones."""
    _MODES[sync.model] = "sharded"
    _log.info(
        "toma: the FSDP2 model's units do not fit unsharded beside one micro-batch on every rank; from now on it "
        "trains with its parameters sharded, in FSDP2's own schedule, every collective agreed on first"
    )
    return ShardedFSDP2(sync.model, sync.units, sync.agreement, sync.mode)


# FSDP2 models whose "auto" gradient sync moved on ("micro_batch", "sharded"): for their later calls too
_MODES: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
_SYNCS = {"logical_batch": AgreeingFSDP2, "micro_batch": ReducingFSDP2, "sharded": ShardedFSDP2}


def fsdp2_sync(model: torch.nn.Module, mode: str) -> AgreeingFSDP2:
    """The FSDP2 sync `mode` (`gradient_sync=`) calls for; "auto": where the model's earlier calls got to."""
    from toma.accumulation.fsdp2 import ShardedUnits

    units = ShardedUnits(model)
    agreement = Agreement(units.process_group, model_device(model.parameters()))
    if units.world > 1:  # ranks on one host agree without a collective (the sharded mode agrees very often)
        agreement.exchange = host_min_for(units.process_group)
    chosen = _MODES.get(model, "logical_batch") if mode == "auto" else mode
    return _SYNCS[chosen](model, units, agreement, mode)
