"""Padding-free micro-batches against padded token packing and fixed rows (issue 40): a causal LM's training step on
the long-tailed lengths of `benchmarks/varlen.py`.

Run: python benchmarks/padding_free.py [--rounds 3] [--threads 1] [--clock cpu|wall] [--quick]

One model (a Llama from a config, SDPA attention) takes logical batches of 32 rows with long-tailed lengths (the
workload A of `benchmarks/varlen.py`: log-normal, median ~48 tokens, up to 512). Every method works under the same
memory bound, a token budget of 8 x 512 positions (or micro-batches of 8 rows), and weights each micro-batch by its
label tokens (the loss is Hugging Face's token mean):

1. a hand-written loop over micro-batches of 8 padded rows, at the logical batch's padded width (the baseline);
2. `toma.accumulate(lengths="attention_mask", initial_tokens=budget, weight=label tokens)`: the padded rows sorted
   by length, packed under the budget, each micro-batch trimmed to its longest row;
3. a hand-written loop over the batch flattened as `DataCollatorWithFlattening` and TRL's `padding_free` flatten
   it (one row, `position_ids` restarting at 0, labels -100 at each sequence's start): consecutive sequences
   taken greedily while they fit the budget, each chunk a padding-free row;
4. `toma.accumulate(lengths="position_ids", initial_tokens=budget, weight=label tokens)` on that flattened batch.

A training step is zero_grad, the method's forward and backward over the logical batch, an SGD step. Each round is
one epoch in which every logical batch is stepped by every method in turn, the order rotating from batch to batch;
a method's time per epoch is the median of the rounds' sums, its ratio to (1) the median of the rounds' ratios.
Tokens are the real ones, the same for every method. Peak memory is the process's resident size at its highest
during a step above where it was when the step began (`VmHWM`, reset before each step; glibc told to return freed
tensors of 1 MiB and more at once, so that one method's freed memory does not hide the next one's), the largest
over the epoch's steps. Gradients after one logical batch (the widest) are compared with one pass over the whole padded
batch: the largest, over the parameters, of max|g - g_full| / max|g_full|.
"""

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers import logging as hf_logging

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from varlen import MICRO_ROWS, ROWS, Batch, label_tokens, long_tailed  # noqa: E402

from toma import toma  # noqa: E402
from toma.memory.cpu import predictable_heap  # noqa: E402
from toma.memory.meters import CpuMeter  # noqa: E402

MODEL = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
QUICK_MODEL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)

METHODS = (
    "(1) fixed micro-batches of 8 padded rows, hand-written",
    '(2) `toma.accumulate(lengths="attention_mask")`: padded rows packed by tokens',
    "(3) padding-free, sequences packed greedily, hand-written",
    '(4) `toma.accumulate(lengths="position_ids")`: padding-free micro-batches',
)


class Workload(NamedTuple):
    longest: int
    batches: int


def padded_batches(workload: Workload, vocab: int, seed: int = 0) -> List[Batch]:
    """The epoch's logical batches of ROWS rows, each right-padded to its own longest row (varlen's workload A)."""
    generator = torch.Generator().manual_seed(seed)
    lengths_of = long_tailed(workload.longest)
    found = []
    for _ in range(workload.batches):
        lengths = lengths_of(ROWS, generator)
        mask = (torch.arange(int(lengths.max())) < lengths.unsqueeze(1)).long()
        ids = torch.randint(1, vocab, mask.shape, generator=generator).masked_fill(mask == 0, 0)
        found.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return found


def flattened(batch: Batch) -> Dict[str, Any]:
    """The padded batch as a padding-free collator flattens it: its rows' tokens in one row, `position_ids`
    restarting at 0, each sequence's first label -100, and the varlen kernels' boundaries."""
    lengths = batch["attention_mask"].sum(1)
    keep = batch["attention_mask"].bool()
    ids = batch["input_ids"][keep][None]
    positions = torch.cat([torch.arange(int(n)) for n in lengths])[None]
    labels = ids.masked_fill(positions == 0, -100)
    edges = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    return {
        "input_ids": ids,
        "position_ids": positions,
        "labels": labels,
        "cu_seq_lens_q": edges,
        "cu_seq_lens_k": edges,
        "max_length_q": int(lengths.max()),
        "max_length_k": int(lengths.max()),
    }


def make_model(shape: Dict[str, int], longest: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        **shape, num_key_value_heads=shape["num_attention_heads"], max_position_embeddings=longest, use_cache=False
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def fixed_rows(model: torch.nn.Module, batch: Batch) -> None:
    """(1): micro-batches of MICRO_ROWS padded rows in order, weighted by label tokens."""
    total = label_tokens(batch)
    for start in range(0, ROWS, MICRO_ROWS):
        micro = {key: value[start : start + MICRO_ROWS] for key, value in batch.items()}
        count = label_tokens(micro)
        if count > 0:
            (model(**micro, use_cache=False).loss * (count / total)).backward()


def greedy_padding_free(model: torch.nn.Module, packed: Dict[str, Any], budget: int) -> None:
    """(3): consecutive sequences while they fit the budget, each chunk a padding-free row of its own."""
    edges = packed["cu_seq_lens_q"].tolist()
    total = label_tokens(packed)
    start = 0
    while start < len(edges) - 1:
        stop = start + 1
        while stop < len(edges) - 1 and edges[stop + 1] - edges[start] <= budget:
            stop += 1
        begin, end = edges[start], edges[stop]
        chunk_edges = torch.tensor([e - begin for e in edges[start : stop + 1]], dtype=torch.int32)
        longest = int(chunk_edges.diff().max())
        micro = {
            "input_ids": packed["input_ids"][:, begin:end],
            "position_ids": packed["position_ids"][:, begin:end],
            "labels": packed["labels"][:, begin:end],
            "cu_seq_lens_q": chunk_edges,
            "cu_seq_lens_k": chunk_edges,
            "max_length_q": longest,
            "max_length_k": longest,
        }
        count = label_tokens(micro)
        if count > 0:
            (model(**micro, use_cache=False).loss * (count / total)).backward()
        start = stop


def methods(model: torch.nn.Module, budget: int) -> List[Callable[[Batch, Dict[str, Any]], Any]]:
    """The four methods, each a function of the padded batch and its flattened form."""

    @toma.accumulate(
        model=model,
        lengths="attention_mask",
        initial_tokens=budget,
        weight=label_tokens,
        context="padded",
        groups="rows",
    )
    def padded(batch: Batch) -> torch.Tensor:
        return model(**batch, use_cache=False).loss

    @toma.accumulate(
        model=model, lengths="position_ids", initial_tokens=budget, weight=label_tokens, context="packed", groups="rows"
    )
    def padding_free(batch: Dict[str, Any]) -> torch.Tensor:
        return model(**batch, use_cache=False).loss

    return [
        lambda batch, packed: fixed_rows(model, batch),
        lambda batch, packed: padded(batch),
        lambda batch, packed: greedy_padding_free(model, packed, budget),
        lambda batch, packed: padding_free(packed),
    ]


def gradients(model: torch.nn.Module, run: Callable[[], Any]) -> List[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    run()
    return [p.grad.detach().clone() for p in model.parameters()]


def relative_difference(got: List[torch.Tensor], full: List[torch.Tensor]) -> float:
    return max(float((g - f).abs().max() / f.abs().max().clamp_min(1e-30)) for g, f in zip(got, full))


class Result(NamedTuple):
    tokens: int
    padded_positions: int
    epoch_times: List[List[float]]
    peaks: List[Optional[int]]
    differences: List[float]


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def measure(workload: Workload, shape: Dict[str, int], rounds: int, clock: Callable[[], float]) -> Result:
    batches = padded_batches(workload, shape["vocab_size"])
    packed = [flattened(batch) for batch in batches]
    model = make_model(shape, workload.longest)
    budget = MICRO_ROWS * workload.longest
    runs = methods(model, budget)

    widest = max(range(len(batches)), key=lambda i: batches[i]["input_ids"].shape[1])
    full = gradients(model, lambda: model(**batches[widest], use_cache=False).loss.backward())
    differences = [
        relative_difference(gradients(model, lambda: run(batches[widest], packed[widest])), full) for run in runs
    ]

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    meter = CpuMeter()
    peaks: List[Optional[int]] = [None] * len(runs)

    def step(index: int, number: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        mark = meter.begin()
        runs[index](batches[number], packed[number])
        optimizer.step()
        used = None if mark is None else meter.used(mark)
        if used is not None:
            peaks[index] = max(peaks[index] or 0, used)

    for number in range(min(2, len(batches))):  # warm up: the allocator, toma's first measurements
        for index in range(len(runs)):
            step(index, number)
    times: List[List[float]] = [[] for _ in runs]
    for _ in range(rounds):
        sums = [0.0] * len(runs)
        for number in range(len(batches)):
            turn = number % len(runs)
            order = list(range(len(runs)))
            for index in order[turn:] + order[:turn]:
                start = clock()
                step(index, number)
                sums[index] += clock() - start
        for index, total in enumerate(sums):
            times[index].append(total)
    tokens = sum(int(batch["attention_mask"].sum()) for batch in batches)
    area = sum(batch["attention_mask"].numel() for batch in batches)
    return Result(tokens, area, times, peaks, differences)


def ratio(times: List[float], baseline: List[float]) -> float:
    """The median of the rounds' tokens/s ratios (baseline time / this time)."""
    return statistics.median(b / t for t, b in zip(times, baseline))


def table(result: Result, workload: Workload) -> List[str]:
    baseline = result.epoch_times[0]
    lines = [
        f"{workload.batches} logical batches of {ROWS} rows, {result.tokens} tokens, padding "
        f"{1 - result.tokens / result.padded_positions:.0%} of the padded positions; token budget {MICRO_ROWS} x "
        f"{workload.longest} = {MICRO_ROWS * workload.longest}.",
        "",
        "| method | time / epoch | tokens/s | tokens/s vs (1) | per round | peak memory above the step's start | "
        "gradients vs the full batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, times, peak, difference in zip(METHODS, result.epoch_times, result.peaks, result.differences):
        epoch = statistics.median(times)
        rounds = ", ".join(f"{b / t:.2f}" for t, b in zip(times, baseline))
        memory = "not measured" if peak is None else f"{peak / 2**20:.1f} MiB"
        lines.append(
            f"| {name} | {epoch:.2f} s | {result.tokens / epoch:,.0f} | {ratio(times, baseline):.2f}x | {rounds} | "
            f"{memory} | {difference:.1e} |"
        )
    return lines


def verdicts(result: Result) -> List[str]:
    times, peaks = result.epoch_times, result.peaks
    lines = [f"- gradients: largest relative difference from the full batch {max(result.differences):.1e} (<= 1e-5)"]
    lines.append(
        f"- padding-free micro-batches (4): {ratio(times[3], times[0]):.2f}x the tokens/s of fixed rows (1), "
        f"{ratio(times[3], times[1]):.2f}x padded packing (2), {ratio(times[3], times[2]):.2f}x the hand-written "
        "padding-free loop (3)"
    )
    if peaks[3] is not None and peaks[1] is not None and peaks[0] is not None:
        lines.append(
            f"- peak memory: (4) {peaks[3] / peaks[1]:.2f}x of padded packing (2), {peaks[3] / peaks[0]:.2f}x of fixed "
            "rows (1)"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="epochs per method, interleaved")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="the process's CPU time, or wall time")
    parser.add_argument("--quick", action="store_true", help="a tiny model and two logical batches: seconds")
    args = parser.parse_args()
    predictable_heap()  # freed tensors leave the resident size at once: a step's peak above its start is its own
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    shape = QUICK_MODEL if args.quick else MODEL
    workload = Workload(64, 2) if args.quick else Workload(512, 16)
    rounds = 1 if args.quick else args.rounds
    print(
        f"Llama from a config: {shape['num_hidden_layers']} layers, width {shape['hidden_size']}, vocabulary "
        f"{shape['vocab_size']}, SDPA attention; torch {torch.__version__}, {args.threads} thread(s), {args.clock} "
        f"clock, {rounds} round(s)"
    )
    result = measure(workload, shape, rounds, CLOCKS[args.clock])
    print()
    print("\n".join(table(result, workload)))
    print()
    print("\n".join(verdicts(result)))


if __name__ == "__main__":
    main()
