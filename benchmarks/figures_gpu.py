"""GPU figures of issue 33 (item 4): toma's own cost and FitToMemory's sizes on a CUDA device.

Run: python benchmarks/figures_gpu.py [--quick] [--precision fp32|bf16] [--device cuda|cpu]
Without CUDA (and --device cuda, the default) it prints a note and exits 0. `--device cpu` is a dry run of every
line but the CUDA-only calls (initialising CUDA, synchronising, memory fractions): part 3 then runs out of a
fake memory budget (each workload raises `torch.cuda.OutOfMemoryError` when its estimated need exceeds the
budget), so its figures say nothing about a GPU. `--quick` makes every model, size and repeat tiny.
With TOMA_FIGURES=<path> set, each figure is also appended to that file as a JSON line,
{"figure": ..., "value": ..., "unit": ...}, for benchmarks/gpu_check.py.

Every timing has `torch.cuda.synchronize()` at its start and end (inside the timed window), comes after a
warm-up, and is the best (part 1) or the median (part 2) of several repeats; each ratio is against a baseline
measured in the same run.

1. A no-op call with CUDA initialised (`torch.cuda.init()` and a tensor on the GPU first): a plain function
   call against `toma.batch` (the default cache), `toma.batch(cache_type=NoBatchsizeCache)` and
   `toma.batch(policy=FitToMemory())` once settled (300 calls first), each a function that returns its
   batch size at once. Calls in turns, 20000 a timing, the fastest timing of each (the CPU versions:
   benchmarks/test_overhead.py's "no-op call" group and benchmarks/noop_policy.py).
2. Accumulation on a small transformer (a 4-layer `nn.TransformerEncoder`, d_model 512, 8 heads, batch_first,
   then a linear head to 1000 classes per token; logical batch 256 x 128 tokens in micro-batches of 32,
   AdamW), fp32 with TF32 off by default (`--precision bf16`: the forward passes under bf16 autocast):
   `toma.accumulate` (its default policy, FitToMemory) against the hand-written loop with the same
   micro-batches (zero_grad, forward, loss * share, backward, step), timed in alternating turns (A B, B A,
   ...) to cancel drift; the median time per logical batch of each and their ratio (target <= 1.02). Once,
   on two copies of the model from the same seed, both take one step on the same batch: the figure "same
   parameters after one step" is 1 when every parameter is allclose (fp32: rtol 1e-5, atol 1e-6).
3. FitToMemory under a real cap: for each workload (an MLP's activations, pairwise distances, a transformer
   block's forward and backward), `torch.cuda.set_per_process_memory_fraction` caps the process at what it
   reserves once the workload's data exist plus 3 GiB. M, the largest size that fits, is found by bisection
   (to 0.2%) with probes in this same process, `gc.collect()` and `torch.cuda.empty_cache()` after each
   (a probe that does not fit leaves nothing behind that way; the figure "M fits again after the runs"
   checks, at the end, that the allocator was not disturbed). Then a fresh `toma.batch` function with
   `initial_batchsize` far above M makes 8 calls, with the default policy (Halving) and with
   `FitToMemory()`, the allocator's cache emptied and its peak reset before each: the final size / M
   (target >= 0.93 for FitToMemory) and the OOMs per call (target <= 1). benchmarks/sizing.py is the CPU
   version, under a CPU cap, with more rules.

Not measured: accumulation to a token budget (issue 31) is not built yet.

Each part runs on its own: an exception in one is printed with its traceback and recorded as the figure
"<part> failed" = 1, and the other parts still run; the script exits 1 if any part failed. The whole run
takes about a minute on an H100 or H200 (each part records its seconds).
"""

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import time
import timeit
import traceback
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import toma as toma_package
from toma import FitToMemory, NoBatchsizeCache
from toma import toma as tm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benchmarks folder, however run
from figure_lines import record  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20


def table(header: List[str], rows: List[List[Any]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")
    print()


class Device:
    """The device the figures are measured on, and what only CUDA does (a no-op on the CPU dry run)."""

    def __init__(self, name: str) -> None:
        self.cuda = name == "cuda"
        # with its index: set_per_process_memory_fraction refuses a CUDA device without one
        self.torch = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device(name)
        self.budget: Optional[int] = None  # the CPU dry run's fake budget (bytes), while part 3 caps memory

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.torch)

    def clock(self) -> float:
        """perf_counter after the device finished its queued work: a timer for timeit."""
        self.sync()
        return time.perf_counter()

    def timed(self, func: Callable[[], Any]) -> float:
        """Seconds `func` takes, the device synchronised at both ends of the window."""
        start = self.clock()
        func()
        return self.clock() - start

    def release(self, collect: bool = True) -> None:
        """Free what the last work left: `gc.collect()` (100 ms and more with torch loaded: skipped where
        nothing can be left in a reference cycle), then the CUDA allocator's cache."""
        if collect:
            gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def cap(self, headroom: int) -> str:
        """Cap the memory this process may hold at what it reserves now plus `headroom` bytes; how, in words."""
        self.release()
        if not self.cuda:
            self.budget = headroom
            return f"a fake budget of {headroom / MiB:.0f} MiB (CPU dry run)"
        total = torch.cuda.get_device_properties(self.torch).total_memory
        reserved = torch.cuda.memory_reserved(self.torch)
        fraction = min(1.0, (reserved + headroom) / total)
        torch.cuda.set_per_process_memory_fraction(fraction, self.torch)
        return (
            f"memory fraction {fraction:.5f} of {total / GiB:.1f} GiB = {fraction * total / GiB:.2f} GiB "
            f"({reserved / MiB:.0f} MiB reserved + {headroom / GiB:.2f} GiB)"
        )

    def uncap(self) -> None:
        self.budget = None
        if self.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, self.torch)
        self.release()

    def need(self, estimate: float) -> None:
        """The CPU dry run's out-of-memory error: raised when a workload's estimated bytes exceed the fake budget.
        On CUDA the allocator raises the real one."""
        if self.budget is not None and not self.cuda and estimate > self.budget:
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory (fake, CPU dry run). Tried to allocate {estimate / MiB:.2f} MiB; "
                f"budget {self.budget / MiB:.2f} MiB"
            )


# ---- 1. a no-op call ------------------------------------------------------------------------------------


def noop(batchsize: int) -> int:
    return batchsize


def noop_overhead(device: Device, quick: bool) -> None:
    if device.cuda:
        torch.cuda.init()
        on_gpu = torch.ones(1, device=device.torch)  # noqa: F841 (a tensor on the GPU while the calls run)
        device.sync()
    calls, rounds = (500, 2) if quick else (20000, 5)
    functions: Dict[str, Tuple[Callable[..., int], str]] = {
        "plain call": (noop, "f(64)"),
        "toma.batch": (tm.batch(initial_batchsize=64)(noop), "f()"),
        "toma.batch, NoBatchsizeCache": (tm.batch(initial_batchsize=64, cache_type=NoBatchsizeCache)(noop), "f()"),
        "toma.batch(policy=FitToMemory()), settled": (
            tm.batch(initial_batchsize=64, policy=FitToMemory())(noop),
            "f()",
        ),
    }
    for name, (function, statement) in functions.items():  # warm up, and settle FitToMemory's call site
        for _ in range(300):
            result = function(64) if statement == "f(64)" else function()
        if result != 64:
            raise AssertionError(f"{name} returned {result}, not 64")
    best = {name: math.inf for name in functions}
    for _ in range(rounds):
        for name, (function, statement) in functions.items():
            timer = timeit.Timer(statement, timer=device.clock, globals=dict(f=function))
            best[name] = min(best[name], min(timer.repeat(repeat=3, number=calls)) / calls)
    plain = best["plain call"]
    rows = []
    for name, seconds in best.items():
        rows.append([name, f"{seconds * 1e6:.3f} µs", f"{seconds / plain:.1f}x"])
        record(f"no-op call: {name}", seconds * 1e6, "µs")
        if name != "plain call":
            record(f"no-op call: {name} / plain call", seconds / plain, "ratio")
    print(f"No-op call, {'CUDA initialised' if device.cuda else 'CPU'}: the fastest of {rounds} x 3 timings of {calls}")
    table(["function", "per call", "/ plain call"], rows)


# ---- 2. accumulation on a small transformer -------------------------------------------------------------


class Shape(NamedTuple):
    layers: int
    width: int
    heads: int
    classes: int
    rows: int  # the logical batch
    tokens: int
    micro: int


def transformer(shape: Shape, device: Device) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        shape.width, shape.heads, dim_feedforward=4 * shape.width, dropout=0.0, batch_first=True
    )
    encoder = nn.TransformerEncoder(layer, shape.layers, enable_nested_tensor=False)
    return nn.Sequential(encoder, nn.Linear(shape.width, shape.classes)).to(device.torch)


def token_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every token: a mean over rows too (every row has as many tokens)."""
    return F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())


def hand_step(model, optimizer, inputs, targets, micro, autocast) -> torch.Tensor:
    """The loop people write by hand."""
    optimizer.zero_grad()
    total = torch.zeros((), device=inputs.device)
    for start in range(0, len(inputs), micro):
        x, y = inputs[start : start + micro], targets[start : start + micro]
        with autocast():
            loss = token_loss(model, x, y)
        loss = loss * (len(x) / len(inputs))
        loss.backward()
        total = total + loss.detach()
    optimizer.step()
    return total


@contextlib.contextmanager
def tf32_off():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def accumulation(device: Device, quick: bool, precision: str) -> None:
    with tf32_off():
        _accumulation(device, quick, precision)


def _accumulation(device: Device, quick: bool, precision: str) -> None:
    shape = Shape(1, 32, 2, 50, 16, 8, 4) if quick else Shape(4, 512, 8, 1000, 256, 128, 32)
    warmup, rounds = (1, 2) if quick else (3, 20)
    bf16 = precision == "bf16"

    def autocast():
        return torch.autocast(device.torch.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(shape.rows, shape.tokens, shape.width, generator=generator).to(device.torch)
    targets = torch.randint(0, shape.classes, (shape.rows, shape.tokens), generator=generator).to(device.torch)
    hand_model, toma_model = transformer(shape, device), transformer(shape, device)
    hand_optimizer = torch.optim.AdamW(hand_model.parameters(), lr=1e-4)
    toma_optimizer = torch.optim.AdamW(toma_model.parameters(), lr=1e-4)
    sizes: List[int] = []  # the micro-batch sizes toma ran

    @tm.accumulate(model=toma_model, initial_micro_batch=shape.micro)
    def compute_loss(x, y):
        if torch.is_grad_enabled():  # not toma's one check, without gradients, that the loss adds up
            sizes.append(len(x))
        return token_loss(toma_model, x, y)

    def toma_step() -> torch.Tensor:
        toma_optimizer.zero_grad()
        with autocast():
            loss = compute_loss(inputs, targets)
        toma_optimizer.step()
        return loss

    def hand() -> torch.Tensor:
        return hand_step(hand_model, hand_optimizer, inputs, targets, shape.micro, autocast)

    # once: the same step from the same parameters
    hand_loss, toma_loss = hand(), toma_step()
    device.sync()
    rtol, atol = (1e-5, 1e-6) if not bf16 else (1e-3, 1e-4)
    pairs = list(zip(hand_model.parameters(), toma_model.parameters()))
    same = all(torch.allclose(a, b, rtol=rtol, atol=atol) for a, b in pairs)
    same = same and torch.allclose(hand_loss, toma_loss, rtol=rtol, atol=atol)
    largest = max(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)
    equal = all(torch.equal(a, b) for a, b in pairs)
    expected = [shape.micro] * (shape.rows // shape.micro) + (
        [shape.rows % shape.micro] if shape.rows % shape.micro else []
    )
    first_sizes = list(sizes)

    for _ in range(warmup):
        hand()
        toma_step()
    times: Dict[str, List[float]] = {"hand-written loop": [], "toma.accumulate": []}
    steps = {"hand-written loop": hand, "toma.accumulate": toma_step}
    kept = True  # every timed toma step ran the hand loop's micro-batches
    for turn in range(rounds):
        order = list(steps) if turn % 2 == 0 else list(reversed(steps))
        for name in order:
            sizes.clear()
            times[name].append(device.timed(steps[name]))
            if name == "toma.accumulate":
                kept = kept and sizes == expected
    hand_ms, toma_ms = (statistics.median(times[name]) * 1e3 for name in steps)
    paired = statistics.median(b / a for a, b in zip(times["hand-written loop"], times["toma.accumulate"]))
    what = (
        f"{shape.layers}-layer TransformerEncoder, d_model {shape.width}, {shape.heads} heads, logical batch "
        f"{shape.rows} x {shape.tokens} tokens in micro-batches of {shape.micro}, AdamW, "
        f"{'bf16 autocast' if bf16 else 'fp32, TF32 off'}, on {device.torch.type}"
    )
    print(f"Accumulation: {what}; median of {rounds} steps each, in alternating turns")
    table(
        ["step", "per logical batch (median)", "fastest", "/ hand-written loop"],
        [
            ["hand-written loop", f"{hand_ms:.2f} ms", f"{min(times['hand-written loop']) * 1e3:.2f} ms", "1.000"],
            [
                "toma.accumulate",
                f"{toma_ms:.2f} ms",
                f"{min(times['toma.accumulate']) * 1e3:.2f} ms",
                f"{toma_ms / hand_ms:.3f} (median of the turns' ratios {paired:.3f}; target <= 1.02)",
            ],
        ],
    )
    kept_text = "the hand loop's" if kept else "NOT always the hand loop's"
    print(
        f"after one step from the same parameters: allclose {same} (rtol {rtol}, atol {atol}), identical {equal}, "
        f"largest difference {largest:.3g}; toma's micro-batches {first_sizes} on the first call, "
        f"{kept_text} in every timed step\n"
    )
    record("accumulation: precision", precision, "")
    record("accumulation: hand-written loop per logical batch", hand_ms, "ms")
    record("accumulation: toma.accumulate per logical batch", toma_ms, "ms")
    record("accumulation: toma.accumulate / hand-written loop", toma_ms / hand_ms, "ratio")
    record("accumulation: toma.accumulate / hand-written loop, median of the turns' ratios", paired, "ratio")
    record("accumulation: same parameters after one step (allclose)", int(same), "1 yes, 0 no")
    record("accumulation: largest parameter difference after one step", largest, "")
    record(
        "accumulation: toma ran the hand loop's micro-batches in every step",
        int(kept and first_sizes == expected),
        "1 yes, 0 no",
    )


# ---- 3. FitToMemory under a real cap --------------------------------------------------------------------


class Workload(NamedTuple):
    name: str
    start: int  # far above M
    work: Callable[[int], torch.Tensor]  # runs `size` rows, returns a 0-dim tensor


def workloads(device: Device, quick: bool) -> List[Callable[[], Workload]]:
    """Each workload's maker (its data are made when it runs, under no cap yet). Each work calls `device.need`
    with its estimated bytes first: on the CPU dry run, the fake out-of-memory error; on CUDA, nothing."""
    where = device.torch

    def mlp() -> Workload:
        width, hidden, start = (32, 128, 1 << 14) if quick else (1024, 4096, 1 << 19)
        torch.manual_seed(0)
        w1 = torch.randn(width, hidden, device=where) / width**0.5
        w2 = torch.randn(hidden, hidden, device=where) / hidden**0.5
        w3 = torch.randn(hidden, 10, device=where) / hidden**0.5

        def work(size: int) -> torch.Tensor:
            device.need(size * (width + 3 * hidden) * 4)
            x = torch.randn(size, width, device=where)
            return (torch.relu(torch.relu(x @ w1) @ w2) @ w3).sum()

        return Workload("MLP activations", start, work)

    def pairwise() -> Workload:
        rows, width = (1 << 12, 16) if quick else (1 << 17, 64)
        points = torch.randn(rows, width, generator=torch.Generator().manual_seed(0)).to(where)

        def work(size: int) -> torch.Tensor:
            device.need(size * size * 8)
            x = points[:size]
            return torch.cdist(x, x).sum()

        return Workload("pairwise distances", rows, work)

    def block() -> Workload:
        width, heads, tokens, start = (32, 2, 16, 1 << 9) if quick else (512, 8, 128, 1 << 13)
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True).to(where)

        def work(size: int) -> torch.Tensor:
            device.need(size * tokens * (24 * width + 4 * heads * tokens) * 4)
            try:
                out = layer(torch.randn(size, tokens, width, device=where))
                loss = out.float().pow(2).mean()
                loss.backward()
                return loss.detach()
            finally:
                layer.zero_grad(set_to_none=True)

        return Workload("transformer block forward+backward", start, work)

    return [mlp, pairwise, block]


def fits(device: Device, work: Callable[[int], torch.Tensor], size: int) -> bool:
    """Whether `size` runs under the cap (in this process), the cache emptied after (and, after an error, what
    its traceback may have kept collected)."""
    try:
        float(work(size))
    except torch.cuda.OutOfMemoryError:
        device.release()
        return False
    device.release(collect=False)
    return True


def largest_fitting(device: Device, workload: Workload, precision: int = 500) -> Tuple[int, int]:
    """M (to 1 / `precision` of it) by bisection, geometric while the bracket is wide; and the number of probes."""
    if fits(device, workload.work, workload.start):
        raise RuntimeError(f"{workload.name}: the start {workload.start} fits under the cap; M is not below it")
    if not fits(device, workload.work, 1):
        raise RuntimeError(f"{workload.name}: not even 1 fits under the cap")
    low, high, probes = 1, workload.start, 2
    while high - low > max(1, low // precision):
        middle = int(math.sqrt(low * high)) if high > 4 * low else (low + high) // 2
        middle = min(max(middle, low + 1), high - 1)
        probes += 1
        if fits(device, workload.work, middle):
            low = middle
        else:
            high = middle
    return low, probes


def eight_calls(device: Device, workload: Workload, policy: Any) -> Tuple[List[List[int]], float]:
    """8 calls of a fresh `toma.batch` function from `workload.start`: the sizes each call tried, and seconds."""
    tried: List[int] = []

    def body(batchsize: int) -> float:
        tried.append(batchsize)
        return float(workload.work(batchsize))

    options = {} if policy is None else dict(policy=policy)
    function = tm.batch(initial_batchsize=workload.start, **options)(body)
    device.release()
    if device.cuda:
        torch.cuda.reset_peak_memory_stats(device.torch)  # as in a fresh process: no earlier probe's peak
    calls = []
    start = device.clock()
    for _ in range(8):
        tried.clear()
        function()
        calls.append(list(tried))
    seconds = device.clock() - start
    device.release()
    return calls, seconds


RULES = {"Halving (the default)": lambda: None, "FitToMemory()": FitToMemory}


def fit_to_memory(device: Device, quick: bool) -> None:
    headroom = 8 * MiB if quick else 3 * GiB
    if device.cuda:
        torch.cuda.init()
        # cuBLAS takes its workspace at the first matmul: before the cap is computed, so that it is inside
        torch.ones(8, 8, device=device.torch) @ torch.ones(8, 8, device=device.torch)
        device.sync()
    rows, results = [], {rule: [] for rule in RULES}
    for make in workloads(device, quick):
        workload = make()
        try:
            how = device.cap(headroom)
            started = device.clock()
            best, probes = largest_fitting(device, workload, 20 if quick else 500)
            bisection = device.clock() - started
            print(f"{workload.name}: {how}; M = {best} by {probes} probes in {bisection:.1f} s")
            record(f"fit: {workload.name}: M", best, "rows")
            for rule, policy in RULES.items():
                calls, seconds = eight_calls(device, workload, policy())
                final, ooms = calls[-1][-1], sum(len(tried) - 1 for tried in calls) / len(calls)
                results[rule].append((final / best, ooms))
                shown = ", ".join("/".join(map(str, tried)) if len(tried) > 1 else str(tried[0]) for tried in calls)
                rows.append([workload.name, best, rule, shown, f"{final / best:.3f}", f"{ooms:.2f}", f"{seconds:.2f}"])
                record(f"fit: {workload.name}: {rule}: final / M", final / best, "ratio")
                record(f"fit: {workload.name}: {rule}: OOMs per call", ooms, "OOMs")
                record(f"fit: {workload.name}: {rule}: seconds for 8 calls", seconds, "s")
            again = fits(device, workload.work, best)
            record(f"fit: {workload.name}: M fits again after the runs", int(again), "1 yes, 0 no")
            if not again:
                print(f"{workload.name}: M = {best} no longer fits after the runs: the allocator's state moved")
        finally:
            del workload
            device.uncap()
    print(f"\nFitToMemory under a cap of the reserved memory + {headroom / GiB:.2f} GiB, 8 calls from far above M")
    print("(each call's sizes: the sizes tried, the last the one that fit)\n")
    table(["workload", "M", "rule", "sizes of the 8 calls", "final / M", "OOMs per call", "seconds"], rows)
    summary = []
    for rule, values in results.items():
        ratios, ooms = [v[0] for v in values], [v[1] for v in values]
        summary.append([rule, f"{statistics.mean(ratios):.3f}", f"{min(ratios):.3f}", f"{statistics.mean(ooms):.2f}"])
        record(f"fit: {rule}: mean final / M", statistics.mean(ratios), "ratio")
        record(f"fit: {rule}: lowest final / M", min(ratios), "ratio")
        record(f"fit: {rule}: mean OOMs per call", statistics.mean(ooms), "OOMs")
    table(["rule", "mean final / M", "lowest final / M (target >= 0.93)", "mean OOMs per call (target <= 1)"], summary)


# ---- the run ----------------------------------------------------------------------------------------------


def run_part(name: str, part: Callable[[], None], device: Device) -> bool:
    """Run one part; an exception is printed and recorded as "<name> failed" = 1. Whether it passed."""
    print(f"== {name}\n", flush=True)
    gc.collect()
    gc.freeze()  # what is alive now (modules torch imported on first use) stays: a gc.collect() takes microseconds
    started = time.perf_counter()
    try:
        part()
        passed = True
    except Exception:
        traceback.print_exc()
        record(f"{name} failed", 1, "")
        print(f"{name}: FAILED (the other parts still run)\n")
        passed = False
    finally:
        with contextlib.suppress(Exception):  # a part that failed half-way leaves no cap behind
            device.uncap()
    seconds = time.perf_counter() - started
    record(f"{name}: seconds", seconds, "s")
    print(f"({name}: {seconds:.1f} s)\n", flush=True)
    return passed


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run (see above)")
    parser.add_argument("--quick", action="store_true", help="tiny models, sizes and repeats")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="part 2's precision")
    options = parser.parse_args(argv)
    if options.device == "cuda" and not torch.cuda.is_available():
        print("figures_gpu.py needs a CUDA GPU (or --device cpu for a dry run); nothing measured")
        return 0
    toma_package.remember_sizes(None)  # no size file (TOMA_SIZES): every call site starts from nothing
    device = Device(options.device)
    what = torch.cuda.get_device_name(device.torch) if device.cuda else "CPU (dry run)"
    print(f"{what}, torch {torch.__version__}{', quick' if options.quick else ''}\n")
    record("device", what, "")
    parts = {
        "no-op call overhead": lambda: noop_overhead(device, options.quick),
        "accumulation on a transformer": lambda: accumulation(device, options.quick, options.precision),
        "FitToMemory under a cap": lambda: fit_to_memory(device, options.quick),
    }
    failed = [name for name, part in parts.items() if not run_part(name, part, device)]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
