"""Gradient caching's micro-batch rows chosen by speed, not only by memory.

Under gradient caching (`toma.accumulation.gradient_cache`) the loss is computed once on the whole batch, so any
micro-batch rows give the same gradients: the size that fits is only a ceiling. The largest size is not always the
fastest (on a CPU smaller micro-batches stay in cache; near full memory a GPU's allocator retries), so the first
training calls of a call site after it chose gradient caching try the size, its half, quarter and eighth, one per
call, in two interleaved rounds, timing each attempt (both passes, per row; a call is a training step all the same);
the smallest within 2% of the fastest (each candidate's best round) is kept, as fast and leaving the most memory to
the rest, never above the size that fits. Eight calls of timing, then nothing: the hot path reads one attribute.
"""

import logging
import time
from typing import Dict, List, Optional

import torch

__all__ = ["ChunkSpeed", "synchronized", "now"]

log = logging.getLogger("toma")

_FRACTIONS = (1, 2, 4, 8)  # the size, its half, its quarter, its eighth
_ROUNDS = 2  # timings per candidate, interleaved: each candidate's best counts
_WITHIN = 0.02  # how much slower per row than the fastest the micro-batches chosen may be (for less memory)


class ChunkSpeed:
    """One call site's trials of micro-batch rows under gradient caching and the rows it settled on (`chosen`)."""

    __slots__ = ("candidates", "timings", "chosen")

    def __init__(self) -> None:
        self.candidates: List[int] = []  # the rows tried, set at the first trial, largest first
        self.timings: List[tuple] = []  # (rows, seconds per row) of each timed attempt, in order
        self.chosen: Optional[int] = None

    def __repr__(self) -> str:
        state = "trying" if self.chosen is None else f"{self.chosen} rows"
        return f"ChunkSpeed({state})"

    @property
    def timing(self) -> bool:
        return self.chosen is None

    @property
    def seconds_per_row(self) -> Dict[int, float]:
        """Each candidate's best time per row so far."""
        best: Dict[int, float] = {}
        for rows, seconds in self.timings:
            best[rows] = min(seconds, best.get(rows, seconds))
        return best

    def rows(self, size: int) -> int:
        """The rows for the next attempt's micro-batches at `size` (the most that fit): the chosen rows, or the next
        candidate to time."""
        if self.chosen is not None:
            return min(size, self.chosen)
        if not self.candidates:
            self.candidates = sorted({max(1, size // fraction) for fraction in _FRACTIONS}, reverse=True)
        return min(size, self.candidates[len(self.timings) % len(self.candidates)])

    def record(self, rows: int, seconds: float, timed_rows: int) -> None:
        """A finished attempt: `seconds` for `timed_rows` rows in micro-batches of `rows`."""
        if self.chosen is not None or timed_rows <= 0 or rows not in self.candidates:
            return
        self.timings.append((rows, seconds / timed_rows))
        if len(self.timings) < _ROUNDS * len(self.candidates):
            return
        times = self.seconds_per_row
        fastest = min(times.values())
        self.chosen = min(rows for rows, seconds in times.items() if seconds <= (1 + _WITHIN) * fastest)
        log.info(
            "toma: gradient caching runs the model's calls in micro-batches of %d rows (time per row: %s)",
            self.chosen,
            ", ".join(f"{rows} rows {1e6 * t:.1f} us" for rows, t in sorted(times.items())),
        )


def synchronized(tensors: List[torch.Tensor]) -> None:
    """Wait for the device work behind `tensors` (CUDA's queue), so that the time taken includes it."""
    for tensor in tensors:
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
            return


def now() -> float:
    return time.perf_counter()
