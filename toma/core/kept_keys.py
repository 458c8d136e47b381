"""Call-site keys kept on the frames that run on, so that a loop calling toma reads its key instead of walking
the stack (`toma.core.call_sites.call_site_key`, which walks it only where no frame keeps one).

A frame keeps its part of the key in its `f_trace` slot while no trace function holds it. While a frame runs,
the frames that called it wait at their calls, so that part cannot change; a frame that ends takes it along,
and a new frame at the same address starts without one. Generators and coroutines are resumed from wherever
they are next driven, so they keep nothing.
"""

import functools
import inspect
import itertools
import weakref
from types import CodeType, FrameType
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["KeptKeys", "kept_key", "code_identity"]


# How many keys one frame keeps at most (one per call instruction of its own, one per path from a frame inside it)
MAX_KEPT = 256
# A path's key is handed to the new frame inside once, then at every 8th new frame: a frame made at every call
# (a helper's) would take it in vain each time, one that runs on (an epoch's loop) reads its own after 8 calls
_HAND_IN_EVERY = 8


class KeptKeys(dict):  # type: ignore[type-arg]
    """Left in the `f_trace` slot of a frame on the call path to toma, while no trace function holds that slot:
    keys by `(f_lasti, depth)` (the key from this frame outwards to `depth` frames) and by `(*inner, f_lasti,
    depth)` (`[the whole key of a call from the frames inside it, how many new frames asked for it]`, `inner`
    their ids and offsets: one tuple handed out again, so the caches need not hash its ints). It holds ints only,
    never a frame."""

    __slots__ = ()

    def __bool__(self) -> bool:
        """False, as an empty slot: pdb (bdb) puts its tracer on a caller only where `not frame.f_trace`, and a
        frame keeping keys must still stop when a step returns into it."""
        return False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> "KeptKeys":
        """Asked about the frame's lines by a tracer started later (`sys.settrace` calls whatever the slot holds):
        there is nothing to trace; a tracer that wants the frame sets the slot itself, as pdb does."""
        return self


# A generator's or coroutine's frame is resumed from wherever it is next driven: its callers can change.
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


# Each code object met on a call path, by id: its serial number, and a weak reference that tells whether the
# object at that id is still the one numbered (ids are reused once an object is freed)
_serials: Dict[int, Tuple["weakref.ref[CodeType]", int]] = {}
_next_serial = itertools.count(1)


def code_identity(code: CodeType) -> int:
    """A frame's code in a call site's key: a number no other code object ever gets, even one made at the same
    address after this one was freed (an edited notebook cell, `exec`, a reloaded module), so new code is a new
    call site and never starts from the size freed code learned. A dict look-up by id on the hot path."""
    address = id(code)
    known = _serials.get(address)
    if known is not None and known[0]() is code:
        return known[1]
    serial = next(_next_serial)
    _serials[address] = (weakref.ref(code, functools.partial(_forget, address, serial)), serial)
    return serial


def _forget(address: int, serial: int, _: Any) -> None:
    """A numbered code object was freed: drop its number (unless a newer object at its address has one)."""
    known = _serials.get(address)
    if known is not None and known[1] == serial:
        del _serials[address]


def kept_key(frame: Optional[FrameType], max_frames: int) -> Tuple[int, ...]:
    """The key from `frame` outwards, read from the innermost frame that keeps its part. The first call along a
    new path from there keeps the whole key there too, and lets the frame just inside keep its part (a loop's
    frame at its next call: one frame further in per call; later new frames on that path, every 8th). With no
    frame within reach keeping anything, the key is walked, and the innermost and outermost frames of the walk
    keep theirs."""
    head: List[int] = []
    inner: Optional[FrameType] = None  # the frame inside `walked`
    walked = frame
    depth = 0
    while walked is not None and depth < max_frames:
        kept = walked.f_trace
        if kept.__class__ is KeptKeys:
            own = (walked.f_lasti, max_frames - depth)
            if inner is None:
                found = kept.get(own)
                if found is not None:
                    return found  # type: ignore[no-any-return]
            else:
                path = (*head, *own)
                known = kept.get(path)
                if known is not None:  # [key, how many new frames inside asked]
                    known[1] += 1
                    if not known[1] % _HAND_IN_EVERY:
                        _keep(inner, known[0][2 * depth - 2 :], max_frames - depth + 1)
                    return known[0]  # type: ignore[no-any-return]
                part = kept.get(own)
                if part is not None:
                    key = (*head, *part)
                    if len(kept) < MAX_KEPT:
                        kept[path] = [key, 0]
                    _keep(inner, key[2 * depth - 2 :], max_frames - depth + 1)
                    return key
        head.append(code_identity(walked.f_code))
        head.append(walked.f_lasti)
        inner, walked = walked, walked.f_back
        depth += 1
    key = tuple(head)
    if frame is not None:
        _keep(frame, key, max_frames)
        if inner is not None and inner is not frame:
            _keep(inner, key[2 * depth - 2 :], max_frames - depth + 1)
    return key


def _keep(frame: FrameType, key: Tuple[int, ...], depth: int) -> None:
    """Let `frame` keep `key`, its part of a call site's key to `depth` frames, unless it is resumable or a
    trace function holds its slot."""
    if frame.f_code.co_flags & _RESUMABLE:
        return
    kept = frame.f_trace
    if kept is None:
        kept = frame.f_trace = KeptKeys()
    elif kept.__class__ is not KeptKeys or len(kept) >= MAX_KEPT:
        return
    kept[(frame.f_lasti, depth)] = key
