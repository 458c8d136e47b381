"""What a learning policy adds to a settled no-op call, beside `Halving` in the same process.

Run: python benchmarks/noop_policy.py [--repeats 5]

Three decorated no-op functions (`Halving`, `FitToMemory()`, and `FitToMemory` that never measures again once
settled) are called in turns, 20000 calls a timing, and each reports the fastest of its timings: the cost
of toma's own path without the machine's noise, which a per-call median from pytest-benchmark (seconds of
rounds, one function at a time) does not separate on a shared machine.
"""

import argparse
import timeit

from toma import FitToMemory, Halving, toma

CALLS = 20000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds of interleaved timings")
    args = parser.parse_args()

    @toma.batch(initial_batchsize=64, policy=Halving())
    def halving(batchsize: int) -> int:
        return batchsize

    @toma.batch(initial_batchsize=64, policy=FitToMemory())
    def fit(batchsize: int) -> int:
        return batchsize

    @toma.batch(initial_batchsize=64, policy=FitToMemory(measure_every=10**9))
    def fit_never(batchsize: int) -> int:
        return batchsize

    functions = {"Halving": halving, "FitToMemory()": fit, "FitToMemory(measure_every=10**9)": fit_never}
    for function in functions.values():  # settle every call site
        for _ in range(300):
            function()
    best = {name: float("inf") for name in functions}
    for _ in range(args.repeats):
        for name, function in functions.items():
            seconds = min(timeit.repeat(function, number=CALLS, repeat=3)) / CALLS
            best[name] = min(best[name], seconds)
    base = best["Halving"]
    print("| policy | settled no-op call | minus Halving |")
    print("|---|---|---|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds * 1e6:.2f} µs | {(seconds - base) * 1e6:+.2f} µs |")


if __name__ == "__main__":
    main()
