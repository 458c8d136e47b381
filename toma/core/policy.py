"""The sizing policy interfaces the engine drives, `SizePolicy` and `LearningPolicy`, and the shrink step
every form shares.

Concrete policies live in `toma.sizing`; a new policy is a new subclass there.
"""

from typing import Any, Optional

import torch

from toma.core.caches import Batchsize

__all__ = [
    "SizePolicy",
    "LearningPolicy",
    "Token",
    "check_policy",
    "shrink_below",
    "assigned_default",
    "assign_default",
]


class SizePolicy:
    """Base class: `shrink(size)` returns the next smaller size to try, or None when none is left. A new
    back-off is a new subclass; one that learns from measurements subclasses `LearningPolicy`."""

    def shrink(self, size: int) -> Optional[int]:
        raise NotImplementedError


Token = Any  # what `LearningPolicy.begin` returns for an attempt it measures, handed back after it


class LearningPolicy(SizePolicy):
    """A policy that learns from measurements: the engine calls these hooks, per call and per attempt. `entry`
    is the call site's cache entry; the policy keeps what it learned there (`entry.learned`, a
    `LearnedState`) and may grow its size. A policy measures `device` (where the step's work runs: a model
    on `cuda:1` runs where the current device is 0), never initialises CUDA for a device that is not CUDA,
    and on the hot path (`quick`) does no more than a throttled check. Ranks that agree on sizes use
    `shrink` for the agreed retry and `observed` for what an attempt here showed."""

    def quick(self, entry: Batchsize, scale: float) -> bool:
        """True: a settled call site between measurements; the call runs at the entry's size, with no
        `start`, no `begin` and a token of None."""
        return False

    def start(
        self, entry: Batchsize, size: int, asked: int, scale: float, device: Optional[torch.device] = None
    ) -> int:
        """The size a call begins with (at most `asked`, the size the call asked for): `scale` is the items each
        row holds (the step's `row_items`)."""
        return size

    def begin(
        self, entry: Batchsize, size: int, scale: float = 1.0, device: Optional[torch.device] = None
    ) -> Optional[Token]:
        """Before an attempt: a token for its measurement, or None when it measures nothing this time."""
        return None

    def succeeded(self, entry: Batchsize, token: Optional[Token], ran: int) -> Optional[str]:
        """The attempt fit (`ran`: the rows of its first chunk); a description of a size change to log, or None."""
        return None

    def observed(self, entry: Batchsize, token: Optional[Token], ran: int) -> None:
        """This rank's attempt fit, but the ranks agreed to redo it smaller (another rank ran out of memory)."""

    def after_oom(
        self, entry: Batchsize, token: Optional[Token], size: int, failed: int, error: BaseException
    ) -> Optional[int]:
        """The attempt at `size` ran out of memory after `failed` rows: the next size (below `failed`), or None
        at the smallest."""
        return shrink_below(self, size, failed)

    def explain(self, entry: Batchsize) -> str:
        """Why the last size after an error was chosen, for the log line."""
        return ""

    def restore(self, entry: Batchsize, text: str) -> None:
        """Take back what `entry.learned.describe()` wrote to the size file in an earlier run."""


def check_policy(policy: Any, name: str) -> Optional[SizePolicy]:
    """A sizing policy, or None for the default at call time."""
    if policy is None:
        return None
    if not callable(getattr(policy, "shrink", None)):
        raise TypeError(f"{name} must be a sizing policy such as toma.ShrinkByFactor(0.8), got {policy!r}")
    return policy  # type: ignore[no-any-return]


def shrink_below(policy: SizePolicy, size: int, failed: int) -> Optional[int]:
    """The policy's first size below `failed` (the work that ran out of memory) going down from `size`, or None
    when there is none: the policy's own sequence (512, 256, ... for halving), and never the same chunk again
    when the chunk was shorter than `size`."""
    while True:
        smaller = policy.shrink(size)
        if smaller is not None and not 1 <= smaller < size:
            raise ValueError(
                f"{policy!r}.shrink({size}) returned {smaller!r}: a policy must return a smaller size "
                "of at least 1, or None when there is none"
            )
        if smaller is None or smaller < failed:
            return smaller
        size = smaller


_assigned: Optional[SizePolicy] = None  # what `toma.DEFAULT_POLICY = ...` set; None: each capability's own default


def assigned_default() -> Optional[SizePolicy]:
    """The policy assigned to `toma.DEFAULT_POLICY`, every capability's where none is given; None until then."""
    return _assigned


def assign_default(policy: SizePolicy) -> None:
    """`toma.DEFAULT_POLICY = policy`: from the next call on, the policy of every run given none."""
    global _assigned
    checked = check_policy(policy, "DEFAULT_POLICY")
    if checked is None:
        raise TypeError("DEFAULT_POLICY must be a sizing policy such as toma.Halving(), got None")
    _assigned = checked
