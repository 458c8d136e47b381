"""The sizing policy interfaces the engine drives, `SizePolicy` and `LearningPolicy`, the `CallState` their hooks
receive, and the shrink step every form shares.

Concrete policies live in `toma.sizing`; a new policy is a new subclass there.
"""

import numbers
from typing import Any, Generic, Optional, Protocol, TypeVar, Union

import torch

from toma.core.caches import Batchsize
from toma.core.steps import Step

__all__ = [
    "SizePolicy",
    "LearningPolicy",
    "Token",
    "check_policy",
    "shrink_below",
    "DefaultPolicy",
    "CallState",
    "checked_size",
]

S = TypeVar("S", bound=Step)


class SizePolicy:
    """Base class: `shrink(size)` returns the next smaller size to try, or None when none is left. A new
    back-off is a new subclass; one that learns from measurements subclasses `LearningPolicy`."""

    def shrink(self, size: int) -> Optional[int]:
        raise NotImplementedError


Token = Any  # what `LearningPolicy.begin` returns for an attempt it measures, handed back after it


class LearningPolicy(SizePolicy):
    """A policy that learns from measurements: the engine calls these hooks, per call and per attempt, each with
    the run's `CallState` (`call`): `call.entry` is the call site's cache entry, where the policy keeps what it
    learned (`entry.learned`, a `LearnedState`) and may grow its size. A policy measures `call.device` (where the
    step's work runs: a model on `cuda:1` runs where the current device is 0), never initialises CUDA for a
    device that is not CUDA, and on the hot path (`quick`) does no more than a throttled check. Ranks that agree
    on sizes use `shrink` for the agreed retry and `observed` for what an attempt here showed."""

    def quick(self, call: "CallState[Any]") -> bool:
        """True: a settled call site between measurements; the call runs at the entry's size, with no `start`,
        no `begin`, and no `succeeded` when it fits (`call.scale` is set, `call.device` not yet); after an OOM the
        retries are measured as usual."""
        return False

    def start(self, call: "CallState[Any]") -> int:
        """The size a call begins with instead of `call.size` (the entry's), at most `call.initial` (the size the
        call asked for); `call.scale` is the items each row holds (the step's `row_items`)."""
        return call.size

    def begin(self, call: "CallState[Any]") -> Optional[Token]:
        """Before an attempt at `call.size`: a token for its measurement, or None when it measures nothing."""
        return None

    def succeeded(self, call: "CallState[Any]") -> Optional[str]:
        """The attempt fit (`call.ran`: the rows of its first chunk, `call.token`: its measurement); a description
        of a size change to log, or None (with `call.confirmed` set where the size stays but what was learned is
        new, such as the first measurement at a size it moved to)."""
        return None

    def observed(self, call: "CallState[Any]") -> None:
        """This rank's attempt fit, but the ranks agreed to redo it smaller (another rank ran out of memory)."""

    def after_oom(self, call: "CallState[Any]") -> Optional[int]:
        """The attempt at `call.size` ran out of memory after `call.failed` rows (`call.error`): the next size
        (below `call.failed`), or None at the smallest."""
        assert call.failed is not None
        return shrink_below(self, call.size, call.failed)

    def explain(self, call: "CallState[Any]") -> str:
        """Why the last size after an error was chosen, for the log line."""
        return ""

    def restore(self, entry: Batchsize, text: str) -> None:
        """Take back what `entry.learned.describe()` wrote to the size file in an earlier run."""


def check_policy(policy: Any, name: str) -> Optional[SizePolicy]:
    """A sizing policy, or None for the default at call time."""
    if policy is None:
        return None
    if isinstance(policy, type):  # `policy=Halving`: its shrink would fail only at the first out-of-memory error
        raise TypeError(
            f"{name} must be a sizing policy instance such as {policy.__name__}(), got the class {policy!r}"
        )
    if not callable(getattr(policy, "shrink", None)):
        raise TypeError(f"{name} must be a sizing policy such as toma.ShrinkByFactor(0.8), got {policy!r}")
    return policy  # type: ignore[no-any-return]


def shrink_below(policy: SizePolicy, size: int, failed: int) -> Optional[int]:
    """The policy's first size below `failed` (the work that ran out of memory) going down from `size`, or None
    when there is none: the policy's own sequence (512, 256, ... for halving), and never the same chunk again
    when the chunk was shorter than `size`."""
    while True:
        smaller = policy.shrink(size)
        if smaller is not None and not (_whole(smaller) and 1 <= smaller < size):
            raise ValueError(
                f"{policy!r}.shrink({size}) returned {smaller!r}: a policy must return a smaller whole size "
                "(an int) of at least 1, or None when there is none"
            )
        if smaller is None or smaller < failed:
            return smaller
        size = smaller


def _whole(size: Any) -> bool:
    """An integer that is not a bool (a float size would reach the user's `range(batch_size)`)."""
    return isinstance(size, numbers.Integral) and not isinstance(size, bool)


class DefaultPolicy(Protocol):
    """A capability's policy where a call gives none, read at the start of each run (`current`; the registry of
    them all is `toma.sizing.defaults`)."""

    @property
    def current(self) -> SizePolicy: ...


def checked_size(policy: SizePolicy, smaller: Optional[int], failed: int) -> Optional[int]:
    """A learning policy's next size after `failed` ran out of memory, refused unless it is smaller and at least 1."""
    if smaller is not None and not (_whole(smaller) and 1 <= smaller < failed):
        raise ValueError(
            f"{policy!r}.after_oom returned {smaller!r} after {failed} ran out of memory: a policy must return a "
            "smaller whole size (an int) of at least 1, or None when there is none"
        )
    return smaller


class CallState(Generic[S]):
    """One run of `step` from its cache `entry` (what a call asked for: `initial`) under `policy`.

    Per run: `device` (where the work runs, when the run needs to know), `scale` (items per row, for a policy
    that sizes by items), `recalled` (the size file gave the entry its size in this run), `quick` (a settled call
    site: no start, no measurement), `confirmed` (a learning policy kept the size after a measurement that was
    news to it: worth keeping in the size file). Per attempt: `size`, `token` (the policy's measurement), `ran` (rows of the
    first chunk, when news to the entry), `attempts`. After an out-of-memory error: `failed` (the work that ran
    out), `error` (only while the engine handles it: the failed attempt's frames must not outlive the handler),
    `next_size`, `reason` and `detail` (the log line's words). `failures` counts this run's own OOMs.
    """

    # A run that fits sets only the slots; the rest start as these class attributes and go to the instance's
    # dictionary (made on first use) only when a run changes them: the hot path builds a small object.
    __slots__ = (
        "step",
        "entry",
        "policy",
        "learner",
        "initial",
        "size",
        "attempts",
        "ran",
        "__dict__",
    )
    scale: float = 1.0
    quick: bool = False
    device: Optional[torch.device] = None
    recalled: bool = False
    confirmed: bool = False
    token: Optional[Token] = None
    failures: int = 0
    failed: Optional[int] = None
    error: Optional[BaseException] = None
    next_size: Optional[int] = None
    reason: str = ""
    detail: str = ""
    proposed: bool = False  # whether this attempt's own proposal was asked for (by the engine or the agreement)
    _outcome: Union[int, None, ValueError] = None

    def __init__(self, step: S, entry: Batchsize, policy: SizePolicy, initial: int) -> None:
        self.step = step
        self.entry = entry
        self.policy = policy
        self.initial = self.size = initial
        self.learner: Optional[LearningPolicy] = policy if isinstance(policy, LearningPolicy) else None
        self.attempts = self.ran = 0

    def new_attempt(self) -> None:
        """Forget the previous attempt's proposal, failure and detail."""
        self.proposed, self.failed, self.detail = False, None, ""

    def propose(self, size: int, failed: int, error: BaseException) -> Optional[int]:
        """The size this rank would retry at after `error` at `size` (`failed` rows ran out), worked out once per
        attempt whether the ranks' agreement or the engine asks first; None at the smallest. A broken policy's
        ValueError is raised to every asker."""
        if not self.proposed:
            self.proposed = True
            learner = self.learner
            self.size, self.failed, self.error = size, failed, error
            try:
                if self.step.at_smallest(size):
                    self._outcome = None
                elif learner is None:
                    self._outcome = shrink_below(self.policy, size, failed)
                else:
                    self._outcome = checked_size(learner, learner.after_oom(self), failed)
            except ValueError as broken:
                self._outcome = broken
            finally:
                self.error = None
            self.detail = learner.explain(self) if learner is not None else ""
        outcome = self._outcome
        if isinstance(outcome, ValueError):
            raise outcome
        return outcome

    def label(self) -> str:
        """What a log line calls the run: the step's function and what its size is."""
        return self.step.label()

    def __repr__(self) -> str:
        return f"CallState({self.label()}, size={self.size}, attempts={self.attempts}, failures={self.failures})"
