"""The sizing policy interface the engine drives: `SizePolicy`, and the shrink step every form shares.

Concrete policies live in `toma.sizing`; a new policy is a new subclass there.
"""

from typing import Any, Optional

__all__ = ["SizePolicy", "check_policy", "shrink_below"]


class SizePolicy:
    """Base class: `shrink(size)` returns the next smaller size to try, or None when none is left.

    A policy that learns from measurements sets `learns = True`; the engine then asks, per call,
    `quick(entry, scale)` (True: a settled call site between measurements; the call runs at the entry's size
    with no `start`, no `begin` and a token of None), else calls `start(entry, size, asked, scale, device)` (the size to begin with, at most `asked`; `scale`: the items
    each row holds, the step's `row_items`, 1 unless a step says otherwise; `device`: where the step's work
    runs, a `torch.device`, or None when not known), and per attempt `begin(entry, size, scale, device)` (a
    token, or None when it measures nothing this time), and after it either `succeeded(entry, token, ran)`
    (`ran`: the rows the attempt's first chunk had; returns a description of a size change to log, or None)
    or `after_oom(entry, token, size, failed, error)`, which returns the next size (below `failed`) or None,
    and `explain(entry)` says why for the log line. `entry` is the call site's cache entry: a policy keeps
    what it learned there, and may grow its size. A policy measures `device`, not the current CUDA device
    (a model on `cuda:1` runs where the current device is 0), and never initialises CUDA for a device that
    is not CUDA. Ranks that agree on sizes use `shrink` alone, and a learning policy may define
    `observed(entry, token, ran)`: this rank's attempt fit, but the ranks agreed to redo it smaller.
    """

    learns = False

    def shrink(self, size: int) -> Optional[int]:
        raise NotImplementedError


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
