"""What the default cache adds to a no-op `toma.batch` call, beside the same call without a cache, in one process.

Run: python benchmarks/noop_cache.py [--repeats 7] [--depth 24]

Three no-op functions (a plain function, `toma.batch` with `NoBatchsizeCache`, `toma.batch` with the default
`StacktraceMemoryBatchsizeCache`) are called `--depth` frames down the stack in two ways: from the loop's own
frame (a loop calling toma: its frame keeps its call site's key), and through a helper function whose frame is
new at every call (the key is read from the loop's frame, one frame out). Timings of 20000 calls in turns; each
reports the fastest (a shared machine's noise moves medians by 2x). Prints one JSON line: microseconds per call,
and the default cache's cost over the call without a cache.
"""

import argparse
import json
import time
from typing import Callable, Dict

from toma import NoBatchsizeCache, toma

CALLS = 20000


def plain(batchsize: int = 64) -> int:
    return batchsize


@toma.batch(initial_batchsize=64, cache_type=NoBatchsizeCache)
def uncached(batchsize: int) -> int:
    return batchsize


@toma.batch(initial_batchsize=64)
def cached(batchsize: int) -> int:
    return batchsize


def looped(function: Callable[[], int]) -> float:
    """Seconds per call, the loop's frame calling `function`."""
    started = time.perf_counter()
    for _ in range(CALLS):
        function()
    return (time.perf_counter() - started) / CALLS


def through_helper(function: Callable[[], int]) -> float:
    """Seconds per call, through a helper whose frame is new at every call."""

    def helper() -> int:
        return function()

    started = time.perf_counter()
    for _ in range(CALLS):
        helper()
    return (time.perf_counter() - started) / CALLS


def at_depth(depth: int, measure: Callable[[], Dict[str, float]]) -> Dict[str, float]:
    """`measure()` run `depth` frames further down the stack."""
    return measure() if depth <= 0 else at_depth(depth - 1, measure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="rounds of interleaved timings")
    parser.add_argument("--depth", type=int, default=24, help="frames between the module and the loop")
    args = parser.parse_args()
    functions = {"plain function": plain, "no cache": uncached, "default cache": cached}
    ways = {"loop": looped, "helper": through_helper}
    best = {f"{name}, {way}": float("inf") for name in functions for way in ways}

    def one_round() -> Dict[str, float]:
        for name, function in functions.items():
            for way, timed in ways.items():
                key = f"{name}, {way}"
                best[key] = min(best[key], timed(function))
        return best

    for _ in range(args.repeats):
        at_depth(args.depth, one_round)
    figures: Dict[str, float] = {f"{key} (us)": round(seconds * 1e6, 3) for key, seconds in best.items()}
    for way in ways:
        figures[f"default cache over no cache, {way} (us)"] = round(
            (best[f"default cache, {way}"] - best[f"no cache, {way}"]) * 1e6, 3
        )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
