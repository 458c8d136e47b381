"""Where toma's accumulation spends its time beside a hand-written loop on a launch-bound model (issue 44): one
`torch.profiler` capture of a logical batch per method, saved as Chrome traces, and the counts that tell a host
cost from a synchronisation.

Run: python benchmarks/profile_gpu.py [--quick] [--cpu] [--out DIR]
Without CUDA (and without --cpu) it prints a note and exits 0; --cpu is a dry run on the CPU (CPU activity only).
With TOMA_FIGURES=<path> set, each figure is appended to that file as a JSON line, for benchmarks/gpu_check.py,
and the traces go beside it (else to --out, ./profiles by default): profile_<n>.json.gz, one per method.

The model and logical batches are benchmarks/varlen_gpu.py's (GPT-2, 6 layers, width 512, SDPA, TF32; micro-batches
of 8 rows are bound by their kernel launches there). Methods: (1) fixed micro-batches of 8 rows, hand-written; (2)
`toma.accumulate` by rows; (3) sorted and packed by hand; (4) `accumulate(lengths=)`; (5) (4) never splitting
early. Each method first runs 3 logical batches (the allocator grows, kernels are chosen, (4) measures its cost),
then one profiled step (zero_grad, the method, an SGD step) on the median-width logical batch, then `--repeats`
synchronised timings of that step without the profiler, interleaved between methods.

Per method: the step's median time; from the capture, the host's span of the step, CUDA kernel launches, device
synchronisations (`cudaDeviceSynchronize`, `cudaStreamSynchronize`, `cudaEventSynchronize`), reads of a device
scalar by the host (`aten::_local_scalar_dense`: `.item()`, `float()`, `bool()` of a CUDA tensor, each one a
synchronisation), events recorded, copies, and the share of the step's span in which the device ran a kernel.
Then the operators that (2) calls and (1) does not, and (4) and (5) likewise, by name and count.
"""

import argparse
import gzip
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benchmarks folder, however run
import varlen_gpu  # noqa: E402
from figure_lines import record  # noqa: E402
from varlen import MICRO_ROWS, Batch, Workload, label_tokens, logical_batches, long_tailed, methods  # noqa: E402

from toma import toma  # noqa: E402
from toma.batching.micro_batch_cost import NEVER, MicroBatchCost  # noqa: E402

NAMES = ("(1) fixed rows, by hand", "(2) accumulate by rows", "(3) packed by hand", "(4) lengths=", "(5) never split")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
SYNCHRONISATIONS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
STEP = "logical batch"


class Capture(NamedTuple):
    """What one profiled step shows."""

    host_ms: float
    counts: Counter
    device_busy: Optional[float]  # the share of the step's span with a kernel running (None: no device)


def counted(counts: Counter, names: Tuple[str, ...]) -> int:
    return sum(counts[name] for name in names)


def busy_share(kernels: List[Tuple[float, float]], span: Tuple[float, float]) -> float:
    """The share of `span` covered by the union of the kernels' (start, end) intervals."""
    covered, reach = 0.0, span[0]
    for start, end in sorted(kernels):
        start, end = max(start, reach), min(end, span[1])
        if end > start:
            covered += end - start
            reach = end
    return covered / max(span[1] - span[0], 1e-9)


def capture(step: Callable[[], None], trace: str) -> Capture:
    """Profile one call of `step` (the device synchronised before and after); its Chrome trace gzipped to `trace`."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if varlen_gpu.DEVICE.type == "cuda" else [])
    varlen_gpu.synchronise()
    with profile(activities=activities) as profiler:
        with record_function(STEP):
            step()
        varlen_gpu.synchronise()
    events = profiler.events()
    counts = Counter(event.name for event in events)
    span_event = next(event for event in events if event.name == STEP)
    span = (span_event.time_range.start, span_event.time_range.end)
    kernels = [
        (e.time_range.start, e.time_range.end) for e in events if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    with tempfile.TemporaryDirectory() as folder:
        plain = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(plain)
        with open(plain, "rb") as source, gzip.open(trace, "wb") as target:
            shutil.copyfileobj(source, target)
    busy = busy_share(kernels, span) if kernels else None
    return Capture((span[1] - span[0]) / 1000, counts, busy)


def extra_operators(mine: Counter, theirs: Counter, limit: int = 15) -> List[Tuple[str, int]]:
    """Operators (aten::) that `mine` calls more often than `theirs`, most first."""
    more = {name: mine[name] - theirs.get(name, 0) for name in mine if name.startswith("aten::")}
    return sorted(((n, c) for n, c in more.items() if c > 0), key=lambda item: -item[1])[:limit]


def build(quick: bool) -> Tuple[List[Callable[[Batch], Any]], List[Batch], torch.nn.Module]:
    """varlen_gpu's model, batches and five methods, on its device."""
    workload = Workload("A: long-tailed", varlen_gpu.LONGEST, 4 if quick else 8, long_tailed(varlen_gpu.LONGEST))
    shape = varlen_gpu.QUICK_SHAPE if quick else varlen_gpu.SHAPE
    batches = [varlen_gpu.on(batch) for batch in logical_batches(workload, shape["vocab_size"])]
    model = varlen_gpu.make_model(shape).to(varlen_gpu.DEVICE)
    budget = MICRO_ROWS * varlen_gpu.LONGEST
    runs = [run for run in methods(model, budget, context="profile_gpu")]

    @toma.accumulate(model=model, lengths="attention_mask", initial_tokens=budget, weight=label_tokens, context="p5")
    def filled(batch: Batch) -> torch.Tensor:
        return model(**batch).loss

    filled.stats.packing = MicroBatchCost(NEVER)
    runs.append(filled)
    assert all(run is not None for run in runs), "this toma has no lengths="
    return runs, batches, model  # type: ignore[return-value]


def report(name: str, seconds: List[float], found: Capture) -> Dict[str, Any]:
    """One method's line and figures."""
    counts = found.counts
    line = {
        "step ms (median)": round(statistics.median(seconds) * 1000, 3),
        "host span ms": round(found.host_ms, 3),
        "kernel launches": counted(counts, LAUNCHES),
        "synchronisations": counted(counts, SYNCHRONISATIONS),
        "device scalars read": counts["aten::_local_scalar_dense"],
        "events recorded": counts["cudaEventRecord"],
        "copies": counts["aten::copy_"],
        "device busy": None if found.device_busy is None else round(found.device_busy, 3),
    }
    for figure, value in line.items():
        record(f"profile: {name}: {figure}", value, "")
    return line


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 4 logical batches, 1 to warm up")
    parser.add_argument("--cpu", action="store_true", help="a dry run on the CPU")
    parser.add_argument("--out", default="profiles", help="where the traces go (without TOMA_FIGURES)")
    parser.add_argument("--repeats", type=int, default=5, help="synchronised timings of each step")
    args = parser.parse_args(argv)
    if args.cpu:
        varlen_gpu.DEVICE = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("CUDA is not available: nothing to profile")
        return 0
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.backends.cuda.matmul.allow_tf32 = True
    figures = os.environ.get("TOMA_FIGURES")
    out = os.path.dirname(os.path.abspath(figures)) if figures else args.out
    os.makedirs(out, exist_ok=True)
    runs, batches, model = build(args.quick)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    target = sorted(batches, key=lambda batch: batch["input_ids"].shape[1])[len(batches) // 2]

    def step(run: Callable[[Batch], Any], batch: Batch) -> Callable[[], None]:
        def one() -> None:
            optimizer.zero_grad(set_to_none=True)
            run(batch)
            optimizer.step()

        return one

    for batch in batches[: 1 if args.quick else 3]:
        for run in runs:
            step(run, batch)()
    captures = [capture(step(run, target), os.path.join(out, f"profile_{n + 1}.json.gz")) for n, run in enumerate(runs)]
    seconds: List[List[float]] = [[] for _ in runs]
    for repeat in range(args.repeats):
        order = list(range(len(runs)))
        for index in order[repeat % len(runs) :] + order[: repeat % len(runs)]:
            seconds[index].append(varlen_gpu.synchronised(step(runs[index], target)))
    device = torch.cuda.get_device_name(0) if varlen_gpu.DEVICE.type == "cuda" else "cpu"
    print(f"device: {device}, torch {torch.__version__}, CUDA {torch.version.cuda}; traces in {out}")
    print(f"logical batch: {target['input_ids'].shape[0]} rows x {target['input_ids'].shape[1]} positions")
    lines = [report(name, spent, found) for name, spent, found in zip(NAMES, seconds, captures)]
    print("| method | " + " | ".join(lines[0]) + " |")
    for name, line in zip(NAMES, lines):
        print(f"| {name} | " + " | ".join(str(value) for value in line.values()) + " |")
    for mine, theirs in ((1, 0), (3, 4)):
        extra = extra_operators(captures[mine].counts, captures[theirs].counts)
        print(f"operators {NAMES[mine]} calls more often than {NAMES[theirs]}: {extra}")
        record(f"profile: operators {NAMES[mine]} calls beyond {NAMES[theirs]}", str(extra), "")
    record("profile: device", device, "")
    return 0


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"{time.perf_counter() - started:.1f} s")
    sys.exit(code)
