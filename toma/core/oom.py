"""Is this error an out-of-memory error (any backend)? And freeing memory once the failed attempt is gone."""

import contextlib
import gc
import threading
from typing import Callable, Iterator, List, Optional, Tuple, Type

import torch
import torch.distributed

from toma.memory.backends import backends

__all__ = [
    "ControlException",
    "should_reduce_batch_size",
    "failed_inside_collective",
    "inside_collective",
    "collective",
    "register_oom_predicate",
    "unregister_oom_predicate",
    "release_memory",
    "return_cached_blocks",
    "add_note",
]

OomPredicate = Callable[[BaseException], bool]

# Lower-case text that marks an out-of-memory error from any backend (MPS, XPU, cudaMallocAsync, ...).
_GENERIC_MARKER = "out of memory"

_extra_predicates: Tuple[OomPredicate, ...] = ()
_predicates_lock = threading.Lock()


# How far `raise ... from ...` chains are followed (a guard against cycles built by hand).
_MAX_CAUSES = 16

# The errors of torch.distributed's collectives and stores (DistBackendError, DistNetworkError, ...); absent in
# torch builds that predate them.
_COLLECTIVE_ERRORS: Tuple[Type[BaseException], ...] = tuple(
    kind for kind in (getattr(torch.distributed, "DistError", None),) if isinstance(kind, type)
)
# NCCL's wording, also where an older torch raises it as a plain RuntimeError ("NCCL error in: ...").
_NCCL_MARKER = "nccl error"


def add_note(exception: BaseException, note: str) -> None:
    """`exception.add_note(note)`, also on Python 3.10."""
    if hasattr(exception, "add_note"):
        exception.add_note(note)
    else:  # Python 3.10: keep the note where 3.11's traceback printer would look.
        setattr(exception, "__notes__", [*getattr(exception, "__notes__", ()), note])


class ControlException(Exception):
    """Base of toma's own control-flow exceptions (a rank that failed, an agreed retry): never an
    out-of-memory error, whatever caused them."""


def should_reduce_batch_size(exception: BaseException) -> bool:
    """True when `exception` means memory ran out, so retrying with less work may succeed.

    An error raised *from* an out-of-memory error (`raise X from oom`, as `torch.compile` wraps a
    `MemoryError`) counts too: the `__cause__` chain is followed. toma's own control exceptions never count.
    Nor does any chain with a collective's error in it (NCCL's "Cuda failure 2 'out of memory'" included):
    the other ranks wait in that collective or have left it, and a communicator that failed stays failed, so
    a local retry cannot mend it, only issue collectives that match nothing. The ranks stop instead.
    """
    chain = _causes(exception)
    if any(map(_is_collective_error, chain)):
        return False
    for cause in chain:
        if isinstance(cause, ControlException):
            return False
        if _is_out_of_memory(cause):
            return True
    return False


def _causes(exception: BaseException) -> List[BaseException]:
    """`exception` and what it was raised from, outermost first."""
    chain: List[BaseException] = []
    cause: Optional[BaseException] = exception
    while cause is not None and len(chain) < _MAX_CAUSES:
        chain.append(cause)
        cause = cause.__cause__
    return chain


def _is_collective_error(exception: BaseException) -> bool:
    """An error of torch.distributed's communication (a collective, the store, the network), not a local one, or
    any error raised inside a collective (`failed_inside_collective`)."""
    return (
        isinstance(exception, _COLLECTIVE_ERRORS)
        or getattr(exception, _INSIDE, None) is not None
        or (isinstance(exception, RuntimeError) and _NCCL_MARKER in str(exception).lower())
    )


_INSIDE = "_toma_inside_collective"  # the attribute `failed_inside_collective` marks an error with


def failed_inside_collective(exception: BaseException, collective: str) -> None:
    """Mark `exception` as raised inside `collective` after every rank agreed to run it (an allocation of gloo's
    included): never retried (the other ranks are inside that collective, not at an agreement), and the rank
    raises it at once. The error itself is unchanged but for a note saying so."""
    setattr(exception, _INSIDE, collective)
    add_note(
        exception,
        f"toma: this rank failed inside the {collective}, after every rank agreed to run it: it is not retried; the "
        "other ranks stop when the collective fails for them (this rank's process ends, or their process group "
        "times out)",
    )


@contextlib.contextmanager
def collective(name: str) -> Iterator[None]:
    """Around a collective toma issues: an error raised inside it is marked so (`failed_inside_collective`)."""
    try:
        yield
    except Exception as error:
        failed_inside_collective(error, name)
        raise


def inside_collective(exception: BaseException) -> bool:
    """Whether `exception` (or what it was raised from) was raised inside a collective (`failed_inside_collective`)."""
    return any(getattr(cause, _INSIDE, None) is not None for cause in _causes(exception))


def _is_out_of_memory(exception: BaseException) -> bool:
    if isinstance(exception, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exception, RuntimeError):  # torch.AcceleratorError included
        if _GENERIC_MARKER in str(exception).lower() or any(b.is_out_of_memory(exception) for b in backends()):
            return True
    return any(predicate(exception) for predicate in _extra_predicates)


def register_oom_predicate(predicate: OomPredicate) -> OomPredicate:
    """Also treat errors for which `predicate(exception)` is true as out-of-memory. Usable as a decorator."""
    global _extra_predicates
    if not callable(predicate):
        raise TypeError(f"predicate must be callable, got {predicate!r}")
    with _predicates_lock:
        if predicate not in _extra_predicates:
            _extra_predicates = _extra_predicates + (predicate,)
    return predicate


def unregister_oom_predicate(predicate: OomPredicate) -> None:
    """Undo `register_oom_predicate`; unknown predicates are ignored."""
    global _extra_predicates
    with _predicates_lock:
        _extra_predicates = tuple(p for p in _extra_predicates if p is not predicate)


def release_memory() -> None:
    """Collect garbage, then return cached accelerator blocks to the device.

    Call it only after the failed attempt's exception is gone: while its traceback lives, the attempt's
    frames and tensors are still reachable and nothing can be freed.
    """
    gc.collect()
    return_cached_blocks()


def return_cached_blocks() -> None:
    """Return the accelerators' cached but unused blocks to their devices (no garbage collection)."""
    for backend in backends():
        backend.empty_cache()
