"""GPU figures for micro-batches by tokens (issue 31 on CUDA; needs CUDA: prints a note and exits 0 without it).

Run: python benchmarks/varlen_gpu.py [--quick]
With TOMA_FIGURES=<path> set, each figure is also appended to that file as a JSON line, for benchmarks/gpu_check.py.

1. Speed: benchmarks/varlen.py's long-tailed workload (logical batches of 32 rows right-padded to their longest,
   lengths log-normal with median ~48 and a tail to 512) on a larger GPT-2 (6 layers, width 512, SDPA, TF32),
   fp32 weights: (1) fixed micro-batches of 8 rows, (2) `toma.accumulate` by rows, (3) a hand-written sorted,
   packed and trimmed loop, (4) `toma.accumulate(lengths="attention_mask")`, the same budget (8 x 512 tokens).
   (5) is (4) told never to split a micro-batch early: (3)'s packing through toma, what toma costs beside its
   packing. Wall time with the device synchronised, interleaved, three rounds; tokens/s ratios to (1), the peak memory
   each method allocated, the gradients' largest relative difference from one pass over the widest batch.
2. Learning under a cap: the device capped (`set_per_process_memory_fraction`) at what the model, its optimizer
   and one micro-batch of 8 x 512 tokens need (+ 64 MiB); an epoch whose widest logical batch comes last. Rows
   (`accumulate`, starting at the whole batch) against tokens (`accumulate(lengths=)`, starting at the whole
   batch's tokens): real CUDA out-of-memory errors in the first two logical batches and after them.
"""

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benchmarks folder, however run
from figure_lines import record  # noqa: E402
from varlen import (  # noqa: E402
    MICRO_ROWS,
    ROWS,
    Batch,
    Workload,
    label_tokens,
    logical_batches,
    long_tailed,
    make_model,
    methods,
    relative_difference,
)

from toma import toma  # noqa: E402
from toma.batching.micro_batch_cost import NEVER, MicroBatchCost  # noqa: E402

SHAPE = dict(vocab_size=8192, n_positions=512, n_embd=512, n_layer=6, n_head=8)
QUICK_SHAPE = dict(vocab_size=1024, n_positions=512, n_embd=128, n_layer=2, n_head=4)
LONGEST = 512
MiB = 2**20
NAMES = (
    "fixed rows (1)",
    "accumulate by rows (2)",
    "hand-written by tokens (3)",
    "accumulate(lengths=) (4)",
    "accumulate(lengths=), never split early (5)",
)


DEVICE = torch.device("cuda")  # main() may set cpu: a dry run of the speed part


def on(batch: Batch) -> Batch:
    return {key: value.to(DEVICE) for key, value in batch.items()}


def synchronise() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def synchronised(func: Callable[[], Any]) -> float:
    synchronise()
    start = time.perf_counter()
    func()
    synchronise()
    return time.perf_counter() - start


def peak_since_reset() -> int:
    """The peak memory allocated since the last reset (0 on the CPU)."""
    return torch.cuda.max_memory_allocated() if DEVICE.type == "cuda" else 0


def reset_peak() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def speed(quick: bool) -> None:
    workload = Workload("A: long-tailed", LONGEST, 4 if quick else 16, long_tailed(LONGEST))
    shape = QUICK_SHAPE if quick else SHAPE
    batches = [on(batch) for batch in logical_batches(workload, shape["vocab_size"])]
    model = make_model(shape).to(DEVICE)
    runs = methods(model, MICRO_ROWS * LONGEST, context="varlen_gpu")
    assert all(run is not None for run in runs), "this toma has no lengths="

    @toma.accumulate(
        model=model, lengths="attention_mask", initial_tokens=MICRO_ROWS * LONGEST, weight=label_tokens, context="fill"
    )
    def filled(batch: Batch) -> torch.Tensor:
        return model(**batch).loss

    filled.stats.packing = MicroBatchCost(NEVER)  # packs as (3) does: what toma costs beside its packing
    runs.append(filled)

    widest = max(batches, key=lambda batch: batch["input_ids"].shape[1])
    model.zero_grad(set_to_none=True)
    model(**widest).loss.backward()
    full = [p.grad.detach().clone() for p in model.parameters()]
    differences = []
    for run in runs:
        model.zero_grad(set_to_none=True)
        run(widest)
        differences.append(relative_difference([p.grad for p in model.parameters()], full))
    del full

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(run: Callable[[Batch], Any], batch: Batch) -> None:
        optimizer.zero_grad(set_to_none=True)
        run(batch)
        optimizer.step()

    for batch in batches[:2]:
        for run in runs:
            step(run, batch)
    rounds = 1 if quick else 3
    times: List[List[float]] = [[] for _ in runs]
    peaks = [0] * len(runs)
    for _ in range(rounds):
        sums = [0.0] * len(runs)
        for number, batch in enumerate(batches):
            order = list(range(len(runs)))
            turn = number % len(runs)
            for index in order[turn:] + order[:turn]:
                reset_peak()
                sums[index] += synchronised(lambda: step(runs[index], batch))
                peaks[index] = max(peaks[index], peak_since_reset())
        for index, total in enumerate(sums):
            times[index].append(total)
    tokens = sum(int(batch["attention_mask"].sum()) for batch in batches)
    area = sum(batch["attention_mask"].numel() for batch in batches)
    print(
        f"GPT-2 {shape['n_layer']} layers, width {shape['n_embd']}, SDPA, TF32; {len(batches)} logical batches of "
        f"{ROWS} rows, {tokens} tokens, {1 - tokens / area:.0%} padding; budget {MICRO_ROWS} x {LONGEST} tokens"
    )
    record("tokens: padding of the long-tailed epoch", round(1 - tokens / area, 3), "fraction")
    print("| method | s / epoch | tokens/s | vs (1) | peak MiB | gradients vs full |")
    for name, spent, peak, difference in zip(NAMES, times, peaks, differences):
        epoch = statistics.median(spent)
        versus = statistics.median(b / t for t, b in zip(spent, times[0]))
        print(f"| {name} | {epoch:.3f} | {tokens / epoch:,.0f} | {versus:.2f}x | {peak / MiB:.0f} | {difference:.1e} |")
        record(f"tokens: {name}: tokens/s", round(tokens / epoch), "tokens/s")
        record(f"tokens: {name}: tokens/s vs fixed rows", round(versus, 3), "ratio")
        record(f"tokens: {name}: peak allocated", round(peak / MiB), "MiB")
        record(f"tokens: {name}: gradients vs the full batch", float(f"{difference:.2e}"), "relative")
    stats = getattr(runs[3], "stats")
    print(f"(4): budget {stats.micro_batch} tokens; one more micro-batch costs {stats.packing.fixed} padded positions")
    record("tokens: accumulate(lengths=) budget after the epochs", stats.micro_batch, "tokens")
    record("tokens: accumulate(lengths=) one more micro-batch costs (measured)", stats.packing.fixed, "positions")


def under_a_cap(quick: bool) -> None:
    workload = Workload("A: long-tailed", LONGEST, 4 if quick else 12, long_tailed(LONGEST))
    shape = QUICK_SHAPE if quick else SHAPE
    batches = [on(batch) for batch in logical_batches(workload, shape["vocab_size"], seed=1)]
    widest = max(range(len(batches)), key=lambda index: batches[index]["input_ids"].shape[1])
    batches.append(batches.pop(widest))  # the long tail comes late, as it may in a shuffled epoch
    model = make_model(shape).to(DEVICE)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    probe = {key: value[:MICRO_ROWS] for key, value in batches[-1].items()}
    probe = {key: torch.cat([value] * (MICRO_ROWS // value.shape[0] + 1))[:MICRO_ROWS] for key, value in probe.items()}
    probe = {key: torch.nn.functional.pad(value, (0, LONGEST - value.shape[1])) for key, value in probe.items()}
    model(**probe).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    resting = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model(**probe).loss.backward()
    micro = torch.cuda.max_memory_allocated() - resting
    optimizer.zero_grad(set_to_none=True)
    del probe
    torch.cuda.empty_cache()
    cap = resting + micro + 64 * MiB
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    print(
        f"cap {cap / MiB:.0f} MiB: model and Adam {resting / MiB:.0f} MiB, a micro-batch of 8 x 512 {micro / MiB:.0f}"
    )
    record("tokens under a cap: the cap", round(cap / MiB), "MiB")

    @toma.accumulate(model=model, weight=label_tokens, initial_micro_batch=ROWS, context="cap rows")
    def by_rows(batch: Batch) -> torch.Tensor:
        return model(**batch).loss

    @toma.accumulate(
        model=model, weight=label_tokens, lengths="attention_mask", initial_tokens=ROWS * LONGEST, context="cap tokens"
    )
    def by_tokens(batch: Batch) -> torch.Tensor:
        return model(**batch).loss

    for name, run in (("rows", by_rows), ("tokens", by_tokens)):
        retries: List[int] = []
        for batch in batches:
            before = getattr(run, "stats").oom_retries
            optimizer.zero_grad(set_to_none=True)
            run(batch)
            optimizer.step()
            retries.append(getattr(run, "stats").oom_retries - before)
        widths = [batch["input_ids"].shape[1] for batch in batches]
        print(f"{name}: OOM retries per logical batch {retries} (widths {widths}); final size {run.stats.micro_batch}")
        record(f"tokens under a cap: {name}: OOM retries in the first 2 logical batches", sum(retries[:2]), "OOMs")
        record(f"tokens under a cap: {name}: OOM retries after them", sum(retries[2:]), "OOMs")
    torch.cuda.set_per_process_memory_fraction(1.0, 0)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 4 logical batches, one round")
    parser.add_argument("--cpu", action="store_true", help="a dry run of the speed part on the CPU")
    args = parser.parse_args(argv)
    global DEVICE
    if args.cpu:
        DEVICE = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("CUDA is not available: nothing to measure")
        return 0
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.backends.cuda.matmul.allow_tf32 = True  # what GPU training runs with
    record("tokens: device", torch.cuda.get_device_name(0) if DEVICE.type == "cuda" else "cpu", "")
    failed = False
    for part in (speed,) if args.cpu else (speed, under_a_cap):
        started = time.perf_counter()
        try:
            part(args.quick)
        except Exception as error:  # one part failing still lets the other report
            import traceback

            traceback.print_exc()
            print(f"{part.__name__} failed: {error!r}")
            failed = True
        record(f"tokens: {part.__name__}: seconds", round(time.perf_counter() - started, 1), "s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
