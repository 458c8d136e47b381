"""Memory levers (issue 42): the longest sequence a long-context GPT-2 trains under a CPU memory cap, plain, with
`toma.accumulate` (which turns activation checkpointing on where one row does not fit) and with checkpointing set by
hand; and the time per token of each where all of them fit.

Run: python benchmarks/levers.py [--rounds 5] [--headroom 0.5] [--length 1024] [--clock cpu|wall] [--quick]

The model is a GPT-2 from a config (6 layers, width 256, 4 heads, vocabulary 1024, fp32, no dropout) with eager
attention, so that a step's memory grows with the square of the length as it does for a long-context user without
flash attention. A step is forward and backward of one row of random token ids, the loss Hugging Face's
(`model(ids, labels=ids).loss`). One thread.

Longest sequence: the process builds the model and runs a first small step (the allocator and heap settled, freed
memory leaving the address space at once: `predictable_heap()`), then forks one child per probe; the child caps its
address space at what it holds plus `--headroom` GiB (`set_cpu_memory_headroom`, a real allocator failure beyond it)
and tries one step at the probe's length. Lengths double from 2 x the resolution, then bisect to the resolution. The
three ways: (a) plain, (b) `toma.accumulate(loss, model=model)` with its defaults (levers on), (c) Hugging Face's
own activation checkpointing turned on by hand (non-reentrant, as toma turns it on), plain loop.

Time per token, uncapped, at `--length` tokens (where a plain step fits): (1) plain, (2) checkpointing by hand,
(3) `toma.accumulate` with the lever on, (4) `toma.accumulate` where no lever is needed (a call site of its own).
(3)'s lever is turned on as a user meets it: its first call runs under a soft address-space cap halfway (geometric
mean) between the checkpointed and the plain step's measured peak, so that one row fails plain with a real
allocator error and toma turns checkpointing on; the cap is then lifted, and every timed call starts with the lever
on, as toma starts a function's calls with the levers its last call needed (`stats.levers`); toma turns it off
when each call ends. The rounds take turns (the order rotating), one step each; times are medians over the rounds,
ratios the median of the rounds' ratios. Gradients of (2)-(4) are compared with (1)'s once: ||g - g_plain|| / ||g_plain||
over all parameters.
"""

import argparse
import json
import math
import os
import resource
import statistics
import time
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers import logging as hf_logging

from toma import toma
from toma.memory.cpu import is_out_of_cpu_memory, predictable_heap, set_cpu_memory_headroom, settled_address_space
from toma.memory.meters import CpuMeter

LEVER = "activation checkpointing"
MODEL = dict(n_layer=6, n_embd=256, n_head=4, vocab_size=1024, n_positions=8192)
QUICK_MODEL = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=2048)
WAYS = (
    "(a) plain",
    "(b) `toma.accumulate(model=model)`",
    "(c) checkpointing by hand",
    "(d) plain, on an out-of-memory error checkpointing by hand",
)
TIMED = (
    "(1) plain",
    "(2) checkpointing by hand",
    "(3) `toma.accumulate`, lever on",
    "(4) `toma.accumulate`, no lever needed",
)
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


class Settings(NamedTuple):
    shape: Dict[str, int]
    headroom: float  # GiB above the settled address space, for every probe
    resolution: int  # tokens: the search stops when the longest fitting and the shortest failing lengths are this close
    length: int  # tokens of the timed steps
    rounds: int


def make_model(shape: Dict[str, int]) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(**shape, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = GPT2LMHeadModel._from_config(config, attn_implementation="eager")
    return model.train()


def checkpointing(model: GPT2LMHeadModel, on: bool) -> None:
    """Hugging Face's own switch, by hand: `activation_checkpointing_*` (5.x) or `gradient_checkpointing_*`."""
    switch = (
        "activation_checkpointing" if hasattr(model, "activation_checkpointing_enable") else "gradient_checkpointing"
    )
    if on:
        getattr(model, f"{switch}_enable")(**{f"{switch}_kwargs": {"use_reentrant": False}})
    else:
        getattr(model, f"{switch}_disable")()


def row(vocab: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def plain_step(model: GPT2LMHeadModel, ids: torch.Tensor) -> None:
    model(ids, labels=ids).loss.backward()


def toma_step(model: GPT2LMHeadModel, context: str) -> Any:
    """A fresh call site: `toma.accumulate` with its defaults (levers on) over the loss of a batch of rows."""

    def loss(ids: torch.Tensor) -> torch.Tensor:
        return model(ids, labels=ids).loss

    return toma.accumulate(loss, model=model, context=context)


def attempt(model: GPT2LMHeadModel, way: int, ids: torch.Tensor) -> Dict[str, Any]:
    """One step of `way` (an index of WAYS): whether it fit, and the levers toma turned on."""
    try:
        if way == 0:
            plain_step(model, ids)
        elif way == 1:
            step = toma_step(model, "probe")
            step(ids)
            return {"fit": True, "levers": step.stats.levers}
        elif way == 2:
            checkpointing(model, True)
            plain_step(model, ids)
        else:
            return fallback(model, ids)
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_cpu_memory(error):
            raise
        return {"fit": False, "levers": []}
    return {"fit": True, "levers": []}


def fallback(model: GPT2LMHeadModel, ids: torch.Tensor) -> Dict[str, Any]:
    """(d): what toma's lever does, written by hand: a plain step, and after its out-of-memory error the step again
    with checkpointing on (what the failed attempt left mapped counts against the cap as it does for toma)."""
    try:
        plain_step(model, ids)
        return {"fit": True, "levers": []}
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_cpu_memory(error):
            raise
    model.zero_grad(set_to_none=True)
    checkpointing(model, True)
    plain_step(model, ids)
    return {"fit": True, "levers": [LEVER]}


def probe(model: GPT2LMHeadModel, way: int, length: int, headroom: float) -> Dict[str, Any]:
    """`attempt` in a forked child capped at its settled address space plus `headroom` GiB."""
    model.zero_grad(set_to_none=True)
    ids = row(model.config.vocab_size, length)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: cap, try, report, and leave without running the parent's exit handlers
        code = 0
        try:
            os.close(read)
            set_cpu_memory_headroom(headroom)
            os.write(write, json.dumps(attempt(model, way, ids)).encode())
        except BaseException as error:  # noqa: BLE001 - reported by the parent
            os.write(write, json.dumps({"error": repr(error)}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        report = pipe.read()
    os.waitpid(pid, 0)
    found = json.loads(report) if report else {"error": "the probe died without a word"}
    if "error" in found:
        raise RuntimeError(f"{WAYS[way]} at {length} tokens: {found['error']}")
    return found


def longest(model: GPT2LMHeadModel, way: int, settings: Settings) -> Tuple[int, List[str], int]:
    """The longest length (a multiple of the resolution) at which `way` fits, the levers toma needed there, and the
    number of probes: doubling from 2 x the resolution, then bisection."""
    step, ceiling = settings.resolution, settings.shape["n_positions"]
    fits, fails, levers, probes = 0, ceiling + step, [], 0
    length = 2 * step
    while length <= ceiling:
        probes += 1
        found = probe(model, way, length, settings.headroom)
        if not found["fit"]:
            fails = length
            break
        fits, levers, length = length, found["levers"], 2 * length
    while fails - fits > step:
        middle = (fits + fails) // 2 // step * step
        probes += 1
        found = probe(model, way, middle, settings.headroom)
        if found["fit"]:
            fits, levers = middle, found["levers"]
        else:
            fails = middle
    return fits, levers, probes


def peak(model: GPT2LMHeadModel, run: Callable[[], Any]) -> int:
    """The resident size's high-water mark during `run`, above where it was when it began (bytes)."""
    model.zero_grad(set_to_none=True)
    meter = CpuMeter()
    mark = meter.begin()
    run()
    used = None if mark is None else meter.used(mark)
    if used is None:
        raise RuntimeError("no /proc/self/clear_refs here: the lever's first call needs a measured peak")
    return used


def under_a_soft_cap(step: Any, ids: torch.Tensor, headroom: int) -> bool:
    """`step(ids)` under a soft address-space cap `headroom` bytes above the settled address space, lifted after;
    False where it ran out of memory even so."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (settled_address_space() + headroom, hard))
    try:
        step(ids)
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_cpu_memory(error):
            raise
        return False
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return True


def first_calls(model: GPT2LMHeadModel, step: Any, ids: torch.Tensor) -> Tuple[float, List[str]]:
    """(3)'s first call under a soft cap between the checkpointed and the plain step's measured peaks (their
    geometric mean); where the plain step fits under it even so (freed heap inside the address space), again under a
    cap 1.5x lower, up to 5 calls. The last cap's headroom (GiB) and the levers toma's stats keep for the next calls."""
    plain = peak(model, lambda: plain_step(model, ids))
    checkpointing(model, True)
    checkpointed = peak(model, lambda: plain_step(model, ids))
    checkpointing(model, False)
    model.zero_grad(set_to_none=True)
    headroom = math.sqrt(plain * checkpointed)
    for _ in range(5):
        if not under_a_soft_cap(step, ids, int(headroom)) or step.stats.levers:
            break  # not even checkpointed: (3) is then timed without the lever
        headroom /= 1.5
    return headroom / 2**30, list(step.stats.levers)


def gradients(model: GPT2LMHeadModel, run: Callable[[], Any]) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    run()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


class Timing(NamedTuple):
    times: List[List[float]]  # per way of TIMED, per round: seconds of one step
    differences: List[float]  # (2)-(4)'s gradients against (1)'s
    lever_headroom: float
    levers: List[str]


def timed_ways(model: GPT2LMHeadModel, lever: Any, plain_toma: Any) -> List[Callable[[torch.Tensor], Any]]:
    def by_hand(ids: torch.Tensor) -> None:
        checkpointing(model, True)
        try:
            plain_step(model, ids)
        finally:
            checkpointing(model, False)

    return [lambda ids: plain_step(model, ids), by_hand, lever, plain_toma]


def time_per_token(model: GPT2LMHeadModel, settings: Settings, clock: Callable[[], float]) -> Timing:
    ids = row(model.config.vocab_size, settings.length, seed=1)
    lever, plain_toma = toma_step(model, "lever"), toma_step(model, "no lever")
    headroom, levers = first_calls(model, lever, ids)
    ways = timed_ways(model, lever, plain_toma)
    reference = gradients(model, lambda: ways[0](ids))
    differences = [
        float((gradients(model, lambda: way(ids)) - reference).norm() / reference.norm()) for way in ways[1:]
    ]
    times: List[List[float]] = [[] for _ in ways]
    for number in range(settings.rounds):
        order = list(range(len(ways)))
        for index in order[number % len(ways) :] + order[: number % len(ways)]:
            model.zero_grad(set_to_none=True)
            start = clock()
            ways[index](ids)
            times[index].append(clock() - start)
    return Timing(times, differences, headroom, levers)


def ratio(times: List[float], baseline: List[float]) -> float:
    """The median of the rounds' time ratios (this way's time / the baseline's)."""
    return statistics.median(t / b for t, b in zip(times, baseline))


def longest_table(found: List[Tuple[int, List[str], int]], settings: Settings) -> List[str]:
    plain = found[0][0]
    lines = [
        f"Longest sequence that trains (one row) under a cap of {settings.headroom} GiB above the settled address "
        f"space, to {settings.resolution} tokens:",
        "",
        "| way | longest sequence | vs plain | lever on there | probes |",
        "|---|---|---|---|---|",
    ]
    for name, (length, levers, probes) in zip(WAYS, found):
        versus = f"{length / plain:.2f}x" if plain else "n/a"
        lines.append(f"| {name} | {length} | {versus} | {', '.join(levers) or '-'} | {probes} |")
    return lines


def timing_table(timing: Timing, settings: Settings) -> List[str]:
    baseline = timing.times[0]
    lines = [
        f"Time per token at {settings.length} tokens (one row), uncapped, {settings.rounds} round(s); (3)'s first call "
        f"under a soft cap of {timing.lever_headroom:.3f} GiB turned on: {', '.join(timing.levers) or 'nothing'}:",
        "",
        "| way | time / step | time / token | vs (1) plain | vs (2) by hand | gradients vs (1) |",
        "|---|---|---|---|---|---|",
    ]
    differences = ["-"] + [f"{difference:.1e}" for difference in timing.differences]
    for name, times, difference in zip(TIMED, timing.times, differences):
        step = statistics.median(times)
        lines.append(
            f"| {name} | {step:.3f} s | {step / settings.length * 1e6:.0f} us | {ratio(times, baseline):.3f}x | "
            f"{ratio(times, timing.times[1]):.3f}x | {difference} |"
        )
    return lines


def verdicts(found: List[Tuple[int, List[str], int]], timing: Timing) -> List[str]:
    times = timing.times
    lever_cost = ratio(times[2], times[1])
    lever = "on" if LEVER in timing.levers else "NOT on: (3) was timed without it"
    return [
        f"- longest sequence: toma {found[1][0]} tokens, {found[1][0] / max(found[0][0], 1):.2f}x plain's "
        f"{found[0][0]}; checkpointing by hand {found[2][0]}, by hand after a failed plain step {found[3][0]}",
        f"- (3)'s lever: {lever}",
        f"- toma with the lever / checkpointing by hand: {lever_cost:.3f}x ({'within' if lever_cost <= 1.05 else 'over'}"
        " the target of 1.05)",
        f"- the lever's cost, checkpointing by hand / plain: {ratio(times[1], times[0]):.3f}x",
        f"- toma where no lever is needed / plain: {ratio(times[3], times[0]):.3f}x",
        f"- gradients: largest relative difference from plain {max(timing.differences):.1e} (<= 1e-5)",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per way, interleaved")
    parser.add_argument("--headroom", type=float, default=0.5, help="GiB above the settled address space")
    parser.add_argument("--resolution", type=int, default=128, help="tokens")
    parser.add_argument("--length", type=int, default=1024, help="tokens of the timed steps")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="the process's CPU time, or wall time")
    parser.add_argument("--quick", action="store_true", help="a tiny model, a small cap, one round: seconds")
    args = parser.parse_args()
    predictable_heap()  # freed tensors leave the address space at once: the cap a probe sets holds
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    if args.quick:
        settings = Settings(QUICK_MODEL, 0.1, 256, 512, 1)
    else:
        settings = Settings(MODEL, args.headroom, args.resolution, args.length, args.rounds)
    shape = settings.shape
    print(
        f"GPT-2 from a config: {shape['n_layer']} layers, width {shape['n_embd']}, {shape['n_head']} heads, "
        f"vocabulary {shape['vocab_size']}, eager attention, fp32; torch {torch.__version__}, 1 thread, {args.clock} "
        "clock"
    )
    model = make_model(shape)
    plain_step(model, row(shape["vocab_size"], 64))  # the allocator and heap settled before any cap
    start = time.perf_counter()
    found = [longest(model, way, settings) for way in range(len(WAYS))]
    searched = time.perf_counter() - start
    timing = time_per_token(model, settings, CLOCKS[args.clock])
    print()
    print("\n".join(longest_table(found, settings)))
    print(f"(search: {searched:.0f} s)")
    print()
    print("\n".join(timing_table(timing, settings)))
    print()
    print("\n".join(verdicts(found, timing)))


if __name__ == "__main__":
    main()
