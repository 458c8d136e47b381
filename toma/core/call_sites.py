"""Call sites: readable tracebacks, cheap hashable keys, and the watermark that cuts outer frames off both.

`get_simple_traceback`, `watermark` and `set_watermark` keep toma 1.1.0's meaning. toma's own code uses
`call_site_key` instead: it walks `sys._getframe` for a few microseconds where `inspect.stack` costs
milliseconds, so it can run on every call.
"""

import functools
import linecache
import os
import sys
import threading
from types import FrameType
from typing import Any, Callable, List, Optional, Tuple, TypeVar

__all__ = ["get_simple_traceback", "watermark", "set_watermark", "call_site_key", "describe_call_site"]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # toma/, above core/

F = TypeVar("F", bound=Callable[..., Any])


class _Watermark(threading.local):
    """Per thread: the frame where tracebacks stop, and whether that frame itself is kept."""

    frame: Optional[FrameType] = None
    keep_frame: bool = True


_watermark = _Watermark()


def _is_toma_frame(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_PACKAGE_DIR)


def _first_caller_frame(frame: Optional[FrameType]) -> Optional[FrameType]:
    while frame is not None and _is_toma_frame(frame):
        frame = frame.f_back
    return frame


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
        _watermark.frame, _watermark.keep_frame = sys._getframe(1), True

    def __exit__(self, *exc_info: object) -> None:
        _watermark.frame, _watermark.keep_frame = self._saved
        del self._saved


def set_watermark(func: F) -> F:
    """Decorator: tracebacks taken inside `func` stop at `func`'s own frame."""

    @functools.wraps(func)
    def watermark_wrapper(*args: Any, **kwargs: Any) -> Any:
        saved = (_watermark.frame, _watermark.keep_frame)
        _watermark.frame, _watermark.keep_frame = sys._getframe(0), False
        try:
            return func(*args, **kwargs)
        finally:
            _watermark.frame, _watermark.keep_frame = saved

    return watermark_wrapper  # type: ignore[return-value]


def call_site_key(max_frames: int = 16) -> Tuple[int, ...]:
    """A hashable key for where toma was called from: the innermost `max_frames` frames outside toma.

    A frame is identified by its code object and the offset of the call instruction (`id(f_code)`,
    `f_lasti`): ints read and hash several times faster than file names or line numbers (`f_lineno` is
    computed from a line table on every access). Two calls on one line are two call sites.
    """
    frame = _first_caller_frame(sys._getframe(1))
    stop, keep = _watermark.frame, _watermark.keep_frame
    key: List[int] = []
    append = key.append
    remaining = max_frames
    while frame is not None and remaining > 0:
        if frame is stop and not keep:
            break
        append(id(frame.f_code))
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
