"""Ranks of a torch.distributed job that agree on every size, so a retry never leaves collectives unmatched.

When one rank runs out of memory and retries while the others have gone on into a collective, the
collectives no longer match and the job hangs. toma's protocol keeps every retried region free of
collectives of its own and puts one small all-reduce (MIN over int64s) at two points (and, for steps with
collectives of their own such as FSDP2's, before each of them: `before_attempt`, `all_finished`, which a failed
rank's `after_attempt` meets):

- before the first attempt, the ranks agree on the size to start with (the smallest of their cached
  sizes), so every rank's cache holds the same size afterwards;
- after every attempt, each rank reports its outcome: finished, out of memory (with the size it would
  retry at), failed with another error, or out of memory at the smallest size. If all finished, they go
  on; if any ran out of memory, all redo the attempt at the smallest size any of them proposed; if any
  failed, all stop: the failing rank raises its own error, the others a RankFailed naming it.

Every rank must reach the agreement after an attempt that failed, wherever it failed: under an address-space
limit (the CPU's real out-of-memory errors) an attempt runs with a few MiB of address space kept aside
(`toma.memory.reserve`), given back the moment it ends, so that what runs then (the exception, the proposal, the
agreement itself) finds room; the agreement's tensors are allocated once, before any attempt (on a full GPU a new
one-number tensor can fail too); a proposal that cannot be worked out still reaches the others, as a stop. An
error inside a collective (after every rank agreed to run it) is the one failure no agreement can follow: that
rank raises at once, without waiting for the others, who are in the collective with it and stop when it
fails there (or at the process group's timeout).

A rank that dies, or is interrupted (KeyboardInterrupt is never held back for the agreement), leaves the
others in the agreement's all-reduce until the process group's timeout (or gloo's lost connection)
raises there.
"""

from typing import Any, Callable, Optional, Protocol, TypeVar

import torch
import torch.distributed as dist

from toma.core.oom import ControlException, collective, inside_collective, should_reduce_batch_size
from toma.core.policy import SizePolicy, shrink_below
from toma.core.steps import Step
from toma.memory.reserve import AddressSpaceReserve

__all__ = [
    "Agreement",
    "MinExchange",
    "AgreedRetry",
    "RankFailed",
    "AgreedStep",
    "agreement_for",
    "check_distributed",
    "is_distributed",
]

R = TypeVar("R")


class _Never(Exception):
    """Raised by nothing: the `except` clause of `Agreement.reported` that lets no error pass untold."""


FINISHED = 2**62  # larger than any size: the MIN over ranks is FINISHED only when every rank finished
_COUNTS = 2**40  # FINISHED - n, for a count n below this, also means every rank finished (`before_attempt`)
LIGHTER = 0  # below every size, above every stop: all retry at the same size in the lighter way


def _NO_LIGHTER() -> bool:
    return False


class RankFailed(ControlException):
    """Raised on the ranks that did not fail when another rank stopped the logical batch. Deliberately not a
    RuntimeError, and a control exception: its message and cause may be an out-of-memory error, and it must
    never be mistaken for one."""


class AgreedRetry(ControlException):
    """Raised on every rank when the ranks agreed to redo the attempt at `size` (some rank ran out of memory);
    `lighter`: in the way that needs less memory (see `Agreement.after_attempt`); `restart`: a way whose memory
    differs so much (FSDP2's parameters sharded) that what the sizes taught before no longer holds, so the sizing
    starts again from `size`, larger than the one that failed."""

    def __init__(self, size: int, reason: str, lighter: bool = False, restart: bool = False) -> None:
        super().__init__(f"the ranks agreed to retry at {size}: {reason}")
        self.size, self.reason, self.lighter, self.restart = size, reason, lighter, restart


def is_distributed(group: Any = None) -> bool:
    """True inside an initialised process group with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _device_for(group: Any, device: Optional[torch.device] = None) -> torch.device:
    """Where the agreement's tensor lives: gloo's on the CPU; NCCL's on this rank's GPU, the one the work
    runs on (`device`: DDP's device, the model's, the tensors'), else the current CUDA device."""
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        if device is not None and device.type == "cuda" and device.index is not None:
            return device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class MinExchange(Protocol):
    """How the ranks find the smallest of their numbers, where not by the group's all-reduce (`Agreement.exchange`;
    `toma.core.host_min.HostMin`: through memory shared on one host)."""

    def min(self, value: int) -> int:
        """The smallest `value` any rank gave to this agreement (every rank's n-th call meets the others')."""
        ...


class Agreement:
    """The agreement collectives of one process group (None: the default group). `device`: where the
    agreed work runs, when known; else the engine tells it (`work_on`) before the first collective.
    `exchange`: the ranks' MIN where not through the group (set alike on every rank, before the first)."""

    def __init__(self, group: Any = None, device: Optional[torch.device] = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.work_device = device
        self._device: Optional[torch.device] = None
        self.exchange: Optional[MinExchange] = None
        self.reserve = AddressSpaceReserve()  # held while an attempt runs: room for what runs after its error
        self._numbers: Optional[torch.Tensor] = None  # the all-reduce's tensors: made once, before any failure
        self._sums: Optional[torch.Tensor] = None
        # The size this rank proposes after an out-of-memory error, (size, failed, error) -> next or None: the
        # engine sets it to its run's `CallState.propose` (worked out once per attempt). None: the policy's shrink.
        self.propose: Optional[Callable[[int, int, BaseException], Optional[int]]] = None

    @property
    def device(self) -> torch.device:
        """The device of the agreement's tensors, chosen at the first collective."""
        if self._device is None:
            self._device = _device_for(self.group, self.work_device)
        return self._device

    def work_on(self, device: Optional[torch.device]) -> None:
        """Where the agreed work runs, unless the agreement was told already (DDP's device comes first)."""
        if self.work_device is None and device is not None:
            self.work_device, self._device = device, None
            self._numbers = self._sums = None

    def _min(self, value: int) -> int:
        if self.exchange is not None:
            return self.exchange.min(value)
        tensor = self._numbers
        if tensor is None:  # the first agreement comes before any attempt: nothing has failed yet
            tensor = self._numbers = torch.zeros(1, dtype=torch.int64, device=self.device)
        tensor.fill_(value)
        with collective("agreement's all-reduce"):
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def sum(self, value: float) -> float:
        """`value` summed over the ranks (in float64: token counts stay exact)."""
        tensor = self._sums
        if tensor is None:
            tensor = self._sums = torch.zeros(1, dtype=torch.float64, device=self.device)
        tensor.fill_(value)
        with collective("ranks' sum"):
            dist.all_reduce(tensor, group=self.group)
        return float(tensor.item())

    def start(self, size: int) -> int:
        """The size every rank starts with: the smallest any of them would start with."""
        return self._min(size)

    def after_attempt(
        self,
        size: int,
        error: Optional[BaseException],
        policy: SizePolicy,
        failed: Optional[int] = None,
        lighter: Callable[[], bool] = _NO_LIGHTER,
    ) -> None:
        """Called on every rank after every attempt at `size`, inside the `except` block that caught `error`
        (None when the attempt finished; `failed`: the work that ran out of memory, when less than `size`).
        Returns when all finished, or when this rank's own `error` is the one to re-raise; raises AgreedRetry
        when all must redo the attempt, RankFailed when another rank failed. `lighter`: the step has a way to
        need less memory at the same size; an out-of-memory error at the smallest size then makes every rank
        retry at `size` that way (`AgreedRetry.lighter`) instead of stopping (asked only then: it may cost a walk over
        the model)."""
        oom = error is not None and should_reduce_batch_size(error)
        try:
            proposal = self._proposal(size, error, oom, policy, failed, lighter)
        except Exception:  # this rank fails here for good; the others are told so before it raises
            self._min(-(1 + self.rank))
            raise
        self._decide(self._min(proposal), proposal, size, oom, error)

    def _proposal(
        self,
        size: int,
        error: Optional[BaseException],
        oom: bool,
        policy: SizePolicy,
        failed: Optional[int],
        lighter: Callable[[], bool],
    ) -> int:
        """What this rank tells the others after an attempt at `size` (see `after_attempt`)."""
        if error is None:
            return FINISHED
        if not oom:
            return -(1 + self.rank)
        failed = size if failed is None else failed
        try:
            propose = self.propose
            smaller = shrink_below(policy, size, failed) if propose is None else propose(size, failed, error)
        except ValueError:
            smaller = None
        if smaller is not None:
            return smaller
        if lighter():
            return LIGHTER
        return -(1 + self.world_size + self.rank)  # out of memory at the smallest size: every rank stops

    def reported(
        self,
        attempt: Callable[[], R],
        size: int,
        policy: SizePolicy,
        failed: Callable[[], Optional[int]],
        *,
        lighter: Callable[[], bool] = _NO_LIGHTER,
        met_within: bool = False,
        undo: Optional[Callable[[], None]] = None,
    ) -> R:
        """`attempt()` on this rank, its outcome then told to every rank (`after_attempt`, the protocol's one
        caller): the result once all finished; this rank's error re-raised once told; AgreedRetry or RankFailed as
        agreed. `failed()`: the work that ran out of memory. `met_within`: the attempt meets the others itself
        (`before_attempt`, `all_finished`), so an AgreedRetry or RankFailed from there was agreed already. `undo`:
        what a finished attempt takes back when another rank makes all redo it. Under an address-space limit the
        attempt runs with `reserve` held, given back before anything else runs after it. An error inside a
        collective is raised at once: the others are in that collective, not at an agreement."""
        try:
            try:
                self.reserve.hold()
                result = attempt()
            finally:
                self.reserve.release()
        except ControlException if met_within else _Never:
            raise
        except Exception as error:
            if not inside_collective(error):
                self.after_attempt(size, error, policy, failed(), lighter)
            raise
        try:
            self.after_attempt(size, None, policy)
        except AgreedRetry:
            if undo is not None:
                undo()
            raise
        return result

    def before_attempt(self, size: int, count: int = 0) -> int:
        """For an attempt with collectives of its own, before the first: every rank reached it (one that failed
        earlier in its attempt reports through `after_attempt`, which this matches: then AgreedRetry or
        RankFailed, as there). Returns the largest `count` (>= 0) any rank gave, such as its micro-batches."""
        agreed = self._min(FINISHED - count)
        if agreed > FINISHED - _COUNTS:
            return FINISHED - agreed
        self._decide(agreed, FINISHED, size, False, None)
        return 0  # not reached: _decide raises for another rank's outcome

    def all_finished(self, size: int) -> None:
        """Within an attempt, where every rank gets to the same point (a micro-batch's end): returns when all got
        there; a rank whose attempt failed before reports through `after_attempt`, which this matches."""
        self._decide(self._min(FINISHED), FINISHED, size, False, None)

    def _decide(self, agreed: int, proposal: int, size: int, oom: bool, error: Optional[BaseException]) -> None:
        """What the ranks' MIN of their proposals means for this rank."""
        if agreed >= FINISHED - _COUNTS:
            return
        if agreed == LIGHTER:
            reason = "out of memory at the smallest size; all retry at it in the way that needs less memory"
            raise AgreedRetry(size, reason, lighter=True) from error
        if agreed > 0:
            reason = f"rank {self.rank} ran out of memory" if oom else "another rank ran out of memory"
            raise AgreedRetry(agreed, reason) from error
        if proposal < 0:
            # this rank failed for good itself (an error not out of memory, or out of memory at its smallest size):
            # it raises its own error, untouched, whatever other rank failed at the same attempt
            return
        failed = -agreed - 1
        if failed >= self.world_size:
            raise RankFailed(
                f"toma: rank {failed - self.world_size} ran out of memory at its smallest size ({size}); "
                f"rank {self.rank} stops with it"
            ) from error
        raise RankFailed(
            f"toma: rank {failed} failed with an error that is not out of memory; rank {self.rank} stops with it"
        ) from error


class AgreedStep(Step):
    """A decorator's step whose every attempt ends in the ranks' agreement: for functions that contain
    collectives themselves, every rank runs every attempt at the same size. A rank whose attempt finished
    while another's ran out of memory rewinds and redoes it with the others."""

    def __init__(self, step: Step, agreement: Agreement, policy: SizePolicy) -> None:
        self.step, self.agreement, self.policy = step, agreement, policy
        self.func, self.size_name, self.name = step.func, step.size_name, step.name

    @property
    def finished(self) -> bool:
        return bool(self.step.finished)

    @property
    def device(self) -> Optional[torch.device]:
        return self.step.device

    def effective(self, size: int) -> int:
        return int(self.step.effective(size))

    def at_smallest(self, size: int) -> bool:
        return self.step.at_smallest(size)

    def smallest_reason(self) -> str:
        return self.step.smallest_reason()

    def __call__(self, size: int) -> bool:
        mark = self.step.mark()
        return bool(
            self.agreement.reported(
                lambda: self.step(size),
                size,
                self.policy,
                lambda: self.step.effective(size),
                undo=lambda: self.step.rewind(mark),
            )
        )


def check_distributed(distributed: Any, name: str) -> Any:
    """The decorators' `distributed=` option as given, or a TypeError naming it: False/None, True, or a process
    group (anything else would be taken for a group only once ranks run, or never outside one)."""
    if distributed is None or isinstance(distributed, bool) or _not_a_member(distributed):
        return distributed
    if dist.is_available() and isinstance(distributed, dist.ProcessGroup):
        return distributed
    raise TypeError(
        f"{name} must be False, True (the default process group) or a torch.distributed process group, "
        f"got {distributed!r}"
    )


def _not_a_member(distributed: Any) -> bool:
    """What `dist.new_group` returns on a rank outside the group (torch's placeholder): this rank agrees with no
    one, as torch's collectives on it do nothing, so the option does nothing here."""
    return (
        dist.is_available()
        and type(distributed) is int
        and distributed == getattr(dist.GroupMember, "NON_GROUP_MEMBER", None)
    )


def agreement_for(distributed: Any) -> Optional[Agreement]:
    """The decorators' `distributed=` option: False/None for none, True for the default process group, or a
    process group. Outside a process group of several ranks there is nothing to agree on."""
    if distributed is None or distributed is False or _not_a_member(distributed):
        return None
    group = None if distributed is True else distributed
    return Agreement(group) if is_distributed(group) else None
