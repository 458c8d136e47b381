"""CallState: one run of a step through the engine, as the policy and the observers see it.

The engine keeps everything about a run here (the step, its cache entry, the policy, the size, the attempt, the
failure being handled), so that a policy's hook or an observer receives one object, as tenacity's strategies
receive `RetryCallState`, instead of a growing list of loose arguments.
"""

from typing import Generic, Optional, TypeVar, Union

import torch

from toma.core.caches import Batchsize
from toma.core.policy import LearningPolicy, SizePolicy, Token, shrink_below
from toma.core.steps import Step

__all__ = ["CallState", "checked_size"]

S = TypeVar("S", bound=Step)


def checked_size(policy: SizePolicy, smaller: Optional[int], failed: int) -> Optional[int]:
    """A learning policy's next size after `failed` ran out of memory, refused unless it is smaller and at least 1."""
    if smaller is not None and not 1 <= smaller < failed:
        raise ValueError(
            f"{policy!r}.after_oom returned {smaller!r} after {failed} ran out of memory: a policy must return a "
            "smaller size of at least 1, or None when there is none"
        )
    return smaller


class CallState(Generic[S]):
    """One run of `step` from its cache `entry` (what a call asked for: `initial`) under `policy`.

    Per run: `device` (where the work runs, when the run needs to know), `scale` (items per row, for a policy
    that sizes by items), `recalled` (the size file gave the entry its size in this run), `quick` (a settled call
    site: no start, no measurement). Per attempt: `size`, `token` (the policy's measurement), `ran` (rows of the
    first chunk, when news to the entry), `attempts`. After an out-of-memory error: `failed` (the work that ran
    out), `error` (only while the engine handles it: the failed attempt's frames must not outlive the handler),
    `next_size`, `reason` and `detail` (the log line's words). `failures` counts this run's own OOMs.
    """

    __slots__ = (
        "step",
        "entry",
        "policy",
        "learner",
        "initial",
        "size",
        "scale",
        "device",
        "recalled",
        "quick",
        "token",
        "ran",
        "attempts",
        "failures",
        "failed",
        "error",
        "next_size",
        "reason",
        "detail",
        "_asked",
        "_outcome",
    )

    def __init__(self, step: S, entry: Batchsize, policy: SizePolicy, initial: int) -> None:
        self.step, self.entry, self.policy, self.initial = step, entry, policy, initial
        self.learner: Optional[LearningPolicy] = policy if isinstance(policy, LearningPolicy) else None
        self.size = initial
        self.scale = 1.0
        self.device: Optional[torch.device] = None
        self.recalled = self.quick = False
        self.token: Optional[Token] = None
        self.ran = self.attempts = self.failures = 0
        self.failed: Optional[int] = None
        self.error: Optional[BaseException] = None
        self.next_size: Optional[int] = None
        self.reason = self.detail = ""
        self._asked = False
        self._outcome: Union[int, None, ValueError] = None

    def new_attempt(self) -> None:
        """Forget the previous attempt's proposal."""
        self.attempts += 1
        self._asked, self.failed, self.detail = False, None, ""

    def propose(self, size: int, failed: int, error: BaseException) -> Optional[int]:
        """The size this rank would retry at after `error` at `size` (`failed` rows ran out), worked out once per
        attempt whether the ranks' agreement or the engine asks first; None at the smallest. A broken policy's
        ValueError is raised to every asker."""
        if not self._asked:
            self._asked = True
            learner = self.learner
            self.error = error
            try:
                if learner is None:
                    self._outcome = shrink_below(self.policy, size, failed)
                else:
                    smaller = learner.after_oom(self.entry, self.token, size, failed, error)
                    self._outcome = checked_size(learner, smaller, failed)
            except ValueError as broken:
                self._outcome = broken
            finally:
                self.error = None
            self.detail = learner.explain(self.entry) if learner is not None else ""
        outcome = self._outcome
        if isinstance(outcome, ValueError):
            raise outcome
        return outcome

    @property
    def proposed(self) -> bool:
        """Whether this attempt's own proposal was asked for (by the engine or the agreement)."""
        return self._asked

    def label(self) -> str:
        """What a log line calls the run: the step's function and what its size is."""
        return self.step.label()

    def __repr__(self) -> str:
        return f"CallState({self.label()}, size={self.size}, attempts={self.attempts}, failures={self.failures})"
