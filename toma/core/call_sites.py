"""Call sites: readable tracebacks, cheap hashable keys, and the watermark that cuts outer frames off both.

`get_simple_traceback`, `watermark` and `set_watermark` keep toma 1.1.0's meaning. toma's own code uses
`call_site_key` instead: it walks `sys._getframe` for a few microseconds where `inspect.stack` costs
milliseconds, and frames that run on keep their part of the key (`toma.core.kept_keys`), so a loop's calls
read it in a fraction of a microsecond and it can run on every call.
"""

import functools
import linecache
import os
import sys
import threading
from types import FrameType
from typing import Any, Callable, List, Optional, Set, Tuple, TypeVar

from toma.core.kept_keys import KeptKeys, code_identity, kept_key

__all__ = ["get_simple_traceback", "watermark", "set_watermark", "call_site_key", "describe_call_site"]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # toma/, above core/

F = TypeVar("F", bound=Callable[..., Any])


class _Watermark(threading.local):
    """Per thread: the frame where tracebacks stop, and whether that frame itself is kept."""

    frame: Optional[FrameType] = None
    keep_frame: bool = True


_watermark = _Watermark()
# How many watermarks are set, in all threads: while none is, the hot path skips reading the thread's own
_watermarks_set = 0
_watermarks_lock = threading.Lock()


def _count_watermark(change: int) -> None:
    global _watermarks_set
    with _watermarks_lock:
        _watermarks_set += change


# The file names of the code met on call paths, by whether they are toma's: a set lookup (the name's hash is kept
# in the string) is three times as fast as `startswith`; the others' are forgotten past _OTHER_FILES
_toma_files: Set[str] = set()
_other_files: Set[str] = set()
_OTHER_FILES = 4096


def _is_toma_frame(frame: FrameType) -> bool:
    filename = frame.f_code.co_filename
    if filename in _toma_files:
        return True
    if filename in _other_files:
        return False
    if filename.startswith(_PACKAGE_DIR):
        _toma_files.add(filename)
        return True
    if len(_other_files) >= _OTHER_FILES:
        _other_files.clear()
    _other_files.add(filename)
    return False


def _first_caller_frame(frame: Optional[FrameType]) -> Optional[FrameType]:
    """The innermost frame outside toma, from `frame` outwards."""
    toma_files, other_files = _toma_files, _other_files
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename not in toma_files and (filename in other_files or not _is_toma_frame(frame)):
            return frame
        frame = frame.f_back
    return None


def _frames(frame: Optional[FrameType]):
    """Yield frames from `frame` outwards, stopping at the watermark.

    Without a watermark the outermost frame (the script's module frame) is left out, as toma 1.1.0 did.
    """
    stop, keep = _watermark.frame, _watermark.keep_frame
    while frame is not None:
        if frame is stop:
            if keep:
                yield frame
            return
        if stop is None and frame.f_back is None:
            return
        yield frame
        frame = frame.f_back


def get_simple_traceback(ignore_top: int = 0) -> Tuple[tuple, ...]:
    """The caller's stack as hashable `(filename, lineno, function, source line, index)` tuples.

    `ignore_top` drops that many innermost frames above the caller. Holds no frames, so no cycles.
    """
    frame: Optional[FrameType] = sys._getframe(1)
    for _ in range(ignore_top):
        if frame is None:
            break
        frame = frame.f_back
    result = []
    for f in _frames(frame):
        filename, lineno = f.f_code.co_filename, f.f_lineno
        line = linecache.getline(filename, lineno) if lineno else ""
        result.append((filename, lineno, f.f_code.co_name, line or None, 0 if line else None))
    return tuple(result)


class watermark:
    """Context manager: tracebacks taken inside the `with` block stop at the frame holding it.

    Use it around a training loop so that cache keys do not depend on how the loop itself was reached.
    """

    def __enter__(self) -> None:
        self._saved = (_watermark.frame, _watermark.keep_frame)
        _count_watermark(1)
        _watermark.frame, _watermark.keep_frame = sys._getframe(1), True

    def __exit__(self, *exc_info: object) -> None:
        _watermark.frame, _watermark.keep_frame = self._saved
        _count_watermark(-1)
        del self._saved


def set_watermark(func: F) -> F:
    """Decorator: tracebacks taken inside `func` stop at `func`'s own frame."""

    @functools.wraps(func)
    def watermark_wrapper(*args: Any, **kwargs: Any) -> Any:
        saved = (_watermark.frame, _watermark.keep_frame)
        _count_watermark(1)
        _watermark.frame, _watermark.keep_frame = sys._getframe(0), False
        try:
            return func(*args, **kwargs)
        finally:
            _watermark.frame, _watermark.keep_frame = saved
            _count_watermark(-1)

    return watermark_wrapper  # type: ignore[return-value]


def call_site_key(max_frames: int = 16) -> Tuple[int, ...]:
    """A hashable key for where toma was called from: the innermost `max_frames` frames outside toma.

    A frame is identified by its code object and the offset of the call instruction (`code_identity(f_code)`,
    a number no other code object gets, and `f_lasti`): ints hash several times faster than file names or line
    numbers in the key (`f_lineno` is computed from a line table on every access). Two calls on one line are two call sites. Frames that run
    on keep their part of the key (`KeptKeys`), so a loop's calls read it instead of walking the stack.
    """
    frame = _first_caller_frame(sys._getframe(1))
    if _watermarks_set and _watermark.frame is not None:
        return _walked_key(frame, max_frames)
    if frame is not None:
        kept = frame.f_trace
        if kept.__class__ is KeptKeys:  # a loop calling toma: its frame keeps the key (inline: the hot path)
            found = kept.get((frame.f_lasti, max_frames))
            if found is not None:
                return found  # type: ignore[no-any-return]
    return kept_key(frame, max_frames)


def _walked_key(frame: Optional[FrameType], max_frames: int) -> Tuple[int, ...]:
    """`call_site_key` from `frame` outwards, walked frame by frame."""
    stop, keep = _watermark.frame, _watermark.keep_frame
    key: List[int] = []
    append = key.append
    remaining = max_frames
    while frame is not None and remaining > 0:
        if frame is stop and not keep:
            break
        append(code_identity(frame.f_code))
        append(frame.f_lasti)
        if frame is stop:
            break
        frame = frame.f_back
        remaining -= 1
    return tuple(key)


def describe_call_site() -> str:
    """`file:line in function` of the innermost frame outside toma, for log lines and error notes."""
    frame = _first_caller_frame(sys._getframe(1))
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
