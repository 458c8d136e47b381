"""accelerate's `find_executable_batch_size`, with its signature and behaviour, run by toma's engine.

`@find_executable_batch_size(starting_batch_size=128)` on a function whose first argument is the batch size:
callers leave it out, an out-of-memory error retries the call with the size times 0.9 (accelerate's back-off, or
`reduce_batch_size_fn()`), and running out at size 1 raises accelerate's `RuntimeError("No executable batch size
found, reached zero.")` (with the original error as its context). As accelerate's, the size that worked is kept
for the function: every later call starts at it, from wherever it is called. What toma's engine changes: a call that fits collects
no garbage and empties no cache (accelerate does both before every call, and after every error); the size is kept
by the function's code, so a function decorated anew starts at it too; out-of-memory errors of every backend toma
knows count; and `policy=` takes a toma sizing policy (`FitToMemory()`).
Nothing here imports accelerate.
"""

import functools
import inspect
from typing import Any, Callable, Optional

from toma.core.arguments import check_function
from toma.core.caches import GlobalBatchsizeCache
from toma.core.oom import should_reduce_batch_size
from toma.core.policy import SizePolicy, check_policy
from toma.core.runner import Runner
from toma.core.steps import BatchStep
from toma.sizing.defaults import ACCELERATE

__all__ = ["find_executable_batch_size", "ACCELERATE_POLICY", "NO_BATCH_SIZE"]

ACCELERATE_POLICY: SizePolicy = ACCELERATE.own  # accelerate's int(batch_size * 0.9), from the registry of defaults
NO_BATCH_SIZE = "No executable batch size found, reached zero."  # accelerate's words, for code that matches them


class ReduceBatchSizeFn(SizePolicy):
    """accelerate's `reduce_batch_size_fn` as a sizing policy: called with no argument after each out-of-memory
    error, it returns the next size; 0 (or less) means none is left."""

    def __init__(self, reduce: Callable[[], int]) -> None:
        self.reduce = reduce

    def shrink(self, size: int) -> Optional[int]:
        smaller = self.reduce()
        return smaller if smaller >= 1 else None

    def __repr__(self) -> str:
        return f"reduce_batch_size_fn={self.reduce!r}"


def _positional_limit(function: Callable[..., Any]) -> Optional[int]:
    """How many positional arguments `function` takes after the batch size (None: any number, *args)."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return None
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return max(0, sum(p.kind in positional for p in parameters) - 1)


def _chosen_policy(
    starting_batch_size: int, reduce_batch_size_fn: Optional[Callable[[], int]], policy: Optional[SizePolicy]
) -> Optional[SizePolicy]:
    """The decorator's arguments checked, and the sizing policy they choose (None: accelerate's back-off)."""
    if isinstance(starting_batch_size, bool) or not isinstance(starting_batch_size, int) or starting_batch_size < 0:
        raise ValueError(f"starting_batch_size must be a whole number of at least 0, got {starting_batch_size!r}")
    if reduce_batch_size_fn is not None and not callable(reduce_batch_size_fn):
        raise TypeError(f"reduce_batch_size_fn must be a function of no arguments, got {reduce_batch_size_fn!r}")
    if reduce_batch_size_fn is not None and policy is not None:
        raise ValueError("give reduce_batch_size_fn or policy, not both: each decides the size after an error")
    return check_policy(policy, "policy") or (
        None if reduce_batch_size_fn is None else ReduceBatchSizeFn(reduce_batch_size_fn)
    )


def _size_passed(function: Callable[..., Any], name: str, args: tuple, kwargs: dict) -> TypeError:
    """accelerate's error for a call that passes the batch size the decorator passes (one positional too many)."""
    named = zip(list(inspect.signature(function).parameters)[1:], args[1:])
    given = ", ".join(f"{p}={v!r}" for p, v in [*named, *kwargs.items()])
    return TypeError(
        f"Batch size was passed into `{name}` as the first argument when called. Remove this as the "
        f"decorator already does so: `{name}({given})`"
    )


def find_executable_batch_size(
    function: Optional[Callable[..., Any]] = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Optional[Callable[[], int]] = None,
    *,
    policy: Optional[SizePolicy] = None,
) -> Any:
    """Run `function(batch_size, *args, **kwargs)` at a batch size that fits, starting at `starting_batch_size`.

    A decorator with or without arguments, as accelerate's. `reduce_batch_size_fn()` gives the size after an
    out-of-memory error (default: times 0.9); `policy=` a toma sizing policy instead (`toma.FitToMemory()`).
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
            policy=policy,
        )
    check_function(function, "find_executable_batch_size", "starting_batch_size")
    chosen = _chosen_policy(starting_batch_size, reduce_batch_size_fn, policy)
    # One size per function's code, wherever it is called from (accelerate keeps one per decoration): an inner
    # training function decorated anew on every outer call, as accelerate's documentation does it, finds it too.
    cache = Runner(ACCELERATE, cache_type=GlobalBatchsizeCache).cache(function)
    runner = Runner(ACCELERATE, policy=chosen, cache=cache)
    initial = max(1, starting_batch_size)
    limit = _positional_limit(function)
    name = getattr(function, "__name__", repr(function))

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        if limit is not None and len(args) > limit:
            raise _size_passed(function, name, args, kwargs)
        if starting_batch_size == 0:
            raise RuntimeError(NO_BATCH_SIZE)
        try:
            return runner.perform(BatchStep(function, args, kwargs), initial).result
        except Exception as error:
            if should_reduce_batch_size(error):  # out of memory at the smallest size
                # The error stays as the context (the traceback shows it), not the cause: a cause would make an
                # outer find_executable_batch_size take this for out of memory and shrink; accelerate's passes.
                raise RuntimeError(NO_BATCH_SIZE)  # noqa: B904
            raise

    return decorator
