"""Micro-batches by tokens against micro-batches of rows (issue 31): a GPT-2's training step on variable-length rows.

Run: python benchmarks/varlen.py [--rounds 3] [--threads 1] [--clock cpu|wall] [--workloads ABC] [--quick]

One model (GPT-2 from a config, SDPA attention, no dropout) takes logical batches of 32 rows, each right-padded to
its longest row: `input_ids` (pad 0), `attention_mask`, `labels` (`input_ids` with -100 at the padding). The loss is
Hugging Face's token mean (`model(**batch).loss`), so every method weights a micro-batch by its label tokens. Four
methods, one memory bound (a micro-batch of 8 rows, or a token budget of 8 x the workload's longest possible row):

1. a hand-written loop: micro-batches of 8 rows in order, each at the logical batch's padded width;
2. `toma.accumulate(model=..., weight=label tokens, initial_micro_batch=8)`, as toma is without issue 31;
3. a hand-written loop: rows sorted by length (longest first), packed greedily while rows x the micro-batch's
   longest row stays within the budget, each micro-batch trimmed to its own longest row;
4. `toma.accumulate(model=..., lengths="attention_mask", initial_tokens=budget, weight=label tokens)`
   ("not available yet" where this toma has no `lengths=`).

A training step is zero_grad, the method's forward and backward over the logical batch, an SGD step. Each round is
one epoch in which every logical batch is stepped by every method in turn, the order rotating from batch to batch,
so that the machine's drift falls on all of them; a method's time per epoch is the median of the rounds' sums, its
ratio to (1) the median of the rounds' ratios. Tokens are the real ones (the attention mask's ones), the same for
every method. The gradients of each method after one logical batch (the widest) are compared with one pass over
the whole batch: the largest, over the parameters, of max|g - g_full| / max|g_full|.

Workloads: A, the issue's (lengths long-tailed: log-normal, median ~48, clipped to 8..512, a few at 512); B, a
bimodal one (three rows in four of 16..64 tokens, one in four of 192..256); C, equal lengths (every row 128 tokens),
where (4) must cost no more than (2) (<= 1.02x). The default clock is the process's CPU time on one thread (the
machine is shared: other processes' load stays out of it).
"""

import argparse
import inspect
import math
import statistics
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers import logging as hf_logging

from toma import toma

Batch = Dict[str, torch.Tensor]
ROWS = 32  # rows per logical batch
MICRO_ROWS = 8  # the fixed micro-batch, and the budget's rows of the longest possible length
PAD = 0

MODEL = dict(vocab_size=2048, n_positions=512, n_embd=128, n_layer=2, n_head=4)
QUICK_MODEL = dict(vocab_size=256, n_positions=64, n_embd=32, n_layer=1, n_head=2)

METHODS = (
    "(1) fixed micro-batches of 8 rows, hand-written",
    "(2) `toma.accumulate(weight=label tokens, initial_micro_batch=8)`",
    "(3) sorted, packed under the token budget, trimmed, hand-written",
    '(4) `toma.accumulate(lengths="attention_mask", initial_tokens=budget, weight=label tokens)`',
)


class Workload(NamedTuple):
    name: str
    longest: int  # the longest possible row: the token budget is MICRO_ROWS x this
    batches: int  # logical batches per epoch
    lengths: Callable[[int, torch.Generator], torch.Tensor]  # n rows' lengths


def long_tailed(longest: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    """Log-normal lengths, median longest * 48 / 512, sigma 0.9, clipped to longest / 64 .. longest."""

    def lengths(n: int, generator: torch.Generator) -> torch.Tensor:
        normal = torch.randn(n, generator=generator) * 0.9 + math.log(longest * 48 / 512)
        return normal.exp().round().clamp(max(2, longest // 64), longest).long()

    return lengths


def bimodal(longest: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    """Three rows in four of longest/16 .. longest/4 tokens, one in four of 3/4 longest .. longest."""

    def lengths(n: int, generator: torch.Generator) -> torch.Tensor:
        short = torch.randint(longest // 16, longest // 4 + 1, (n,), generator=generator)
        long = torch.randint(3 * longest // 4, longest + 1, (n,), generator=generator)
        return torch.where(torch.rand(n, generator=generator) < 0.25, long, short)

    return lengths


def equal(longest: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    def lengths(n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.full((n,), longest, dtype=torch.long)

    return lengths


def workloads(quick: bool) -> List[Workload]:
    if quick:
        return [
            Workload("A: long-tailed", 64, 2, long_tailed(64)),
            Workload("B: bimodal", 32, 2, bimodal(32)),
            Workload("C: equal lengths", 16, 2, equal(16)),
        ]
    return [
        Workload("A: long-tailed (the issue's)", 512, 16, long_tailed(512)),
        Workload("B: bimodal", 256, 16, bimodal(256)),
        Workload("C: equal lengths", 128, 24, equal(128)),
    ]


def logical_batches(workload: Workload, vocab: int, seed: int = 0) -> List[Batch]:
    """The epoch's logical batches of ROWS rows, each right-padded to its own longest row."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(workload.batches):
        lengths = workload.lengths(ROWS, generator)
        width = int(lengths.max())
        mask = (torch.arange(width) < lengths.unsqueeze(1)).long()
        ids = torch.randint(1, vocab, (ROWS, width), generator=generator).masked_fill(mask == 0, PAD)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return batches


def make_model(shape: Dict[str, int]) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        **shape,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        loss_type="ForCausalLM",
    )
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


def label_tokens(batch: Batch) -> torch.Tensor:
    """What the causal LM's mean loss averages over: the labels after the shift that are not -100."""
    return (batch["labels"][:, 1:] != -100).sum()


def rows_of(batch: Batch, index: Any, width: Optional[int] = None) -> Batch:
    return {key: value[index, :width] for key, value in batch.items()}


def fixed_rows(model: torch.nn.Module, batch: Batch) -> None:
    """(1): micro-batches of MICRO_ROWS rows in order, at the logical batch's width, weighted by label tokens."""
    total = label_tokens(batch)
    for start in range(0, ROWS, MICRO_ROWS):
        micro = rows_of(batch, slice(start, start + MICRO_ROWS))
        count = label_tokens(micro)
        if count > 0:
            (model(**micro).loss * (count / total)).backward()


def packed(lengths: Sequence[int], budget: int) -> List[List[int]]:
    """Rows sorted longest first, packed greedily: a micro-batch takes rows while rows x its longest (its first)
    row stays within the budget; a row longer than the budget goes alone."""
    order = sorted(range(len(lengths)), key=lambda row: -lengths[row])
    groups: List[List[int]] = []
    for row in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def sorted_trimmed(model: torch.nn.Module, batch: Batch, budget: int) -> None:
    """(3): packed under the token budget, each micro-batch trimmed to its own longest row."""
    total = label_tokens(batch)
    lengths = batch["attention_mask"].sum(1).tolist()
    for group in packed(lengths, budget):
        micro = rows_of(batch, torch.tensor(group), lengths[group[0]])
        count = label_tokens(micro)
        if count > 0:
            (model(**micro).loss * (count / total)).backward()


def has_lengths() -> bool:
    return "lengths" in inspect.signature(toma.accumulate).parameters


def methods(model: torch.nn.Module, budget: int, context: str) -> List[Optional[Callable[[Batch], Any]]]:
    """The four methods as functions of a logical batch (None: not in this toma)."""

    @toma.accumulate(model=model, weight=label_tokens, initial_micro_batch=MICRO_ROWS, context=context)
    def rows_today(batch: Batch) -> torch.Tensor:
        return model(**batch).loss

    by_tokens = None
    if has_lengths():

        @toma.accumulate(
            model=model, lengths="attention_mask", initial_tokens=budget, weight=label_tokens, context=context
        )
        def by_tokens(batch: Batch) -> torch.Tensor:
            return model(**batch).loss

    return [
        lambda batch: fixed_rows(model, batch),
        rows_today,
        lambda batch: sorted_trimmed(model, batch, budget),
        by_tokens,
    ]


def gradients(model: torch.nn.Module, run: Callable[[Batch], Any], batch: Batch) -> List[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    run(batch)
    return [p.grad.detach().clone() for p in model.parameters()]


def relative_difference(got: List[torch.Tensor], full: List[torch.Tensor]) -> float:
    return max(float((g - f).abs().max() / f.abs().max().clamp_min(1e-30)) for g, f in zip(got, full))


def stepped(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, run: Callable[[Batch], Any], batch: Batch
) -> None:
    optimizer.zero_grad(set_to_none=True)
    run(batch)
    optimizer.step()


class Result(NamedTuple):
    workload: Workload
    batches: List[Batch]
    epoch_times: List[Optional[List[float]]]  # per method, per round
    differences: List[Optional[float]]
    toma_sizes: List[Optional[Tuple[int, int]]]  # (2)'s micro-batch, (4)'s budget after the epochs; OOM retries


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def measure(workload: Workload, shape: Dict[str, int], rounds: int, clock: Callable[[], float]) -> Result:
    batches = logical_batches(workload, shape["vocab_size"])
    model = make_model(shape)
    budget = MICRO_ROWS * workload.longest
    runs = methods(model, budget, context=f"varlen {workload.name}")

    widest = max(batches, key=lambda batch: batch["input_ids"].shape[1])
    full = gradients(model, lambda batch: model(**batch).loss.backward(), widest)
    differences = [None if run is None else relative_difference(gradients(model, run, widest), full) for run in runs]

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    present = {index: run for index, run in enumerate(runs) if run is not None}
    for batch in batches[:2]:  # warm up: the allocator, toma's first measurements
        for run in present.values():
            stepped(model, optimizer, run, batch)
    times: Dict[int, List[float]] = {index: [] for index in present}
    for _ in range(rounds):
        sums = dict.fromkeys(present, 0.0)
        for number, batch in enumerate(batches):
            turn = number % len(present)
            order = list(present)
            for index in order[turn:] + order[:turn]:
                start = clock()
                stepped(model, optimizer, present[index], batch)
                sums[index] += clock() - start
        for index, total in sums.items():
            times[index].append(total)
    epoch_times = [times.get(index) for index in range(len(runs))]
    stats = [None if index not in (1, 3) or run is None else getattr(run, "stats") for index, run in enumerate(runs)]
    sizes = [None if found is None else (found.micro_batch, found.oom_retries) for found in stats]
    return Result(workload, batches, epoch_times, differences, sizes)


def described(result: Result) -> str:
    tokens = sum(int(batch["attention_mask"].sum()) for batch in result.batches)
    area = sum(batch["attention_mask"].numel() for batch in result.batches)
    lengths = torch.cat([batch["attention_mask"].sum(1) for batch in result.batches]).float()
    groups = sum(
        len(packed(batch["attention_mask"].sum(1).tolist(), MICRO_ROWS * result.workload.longest))
        for batch in result.batches
    )
    return (
        f"{result.workload.batches} logical batches of {ROWS} rows, {tokens} tokens; lengths median "
        f"{lengths.median():.0f}, mean {lengths.mean():.0f}, max {lengths.max():.0f}; padding "
        f"{1 - tokens / area:.0%} of the padded positions; token budget {MICRO_ROWS} x {result.workload.longest} = "
        f"{MICRO_ROWS * result.workload.longest}; micro-batches per epoch: (1) {result.workload.batches * ROWS // MICRO_ROWS}, "
        f"(3) {groups}"
    )


def ratio(times: List[float], baseline: List[float]) -> float:
    """The median of the rounds' tokens/s ratios (baseline time / this time)."""
    return statistics.median(b / t for t, b in zip(times, baseline))


def table(result: Result) -> List[str]:
    tokens = sum(int(batch["attention_mask"].sum()) for batch in result.batches)
    baseline = result.epoch_times[0]
    assert baseline is not None
    lines = [
        f"**{result.workload.name}**: {described(result)}.",
        "",
        "| method | time / epoch | tokens/s | tokens/s vs (1) | per round | gradients vs the full batch |",
        "|---|---|---|---|---|---|",
    ]
    for name, times, difference in zip(METHODS, result.epoch_times, result.differences):
        if times is None:
            lines.append(f"| {name} | not available yet | | | | |")
            continue
        epoch = statistics.median(times)
        rounds = ", ".join(f"{b / t:.2f}" for t, b in zip(times, baseline))
        lines.append(
            f"| {name} | {epoch:.2f} s | {tokens / epoch:,.0f} | {ratio(times, baseline):.2f}x | {rounds} | "
            f"{difference:.1e} |"
        )
    rows, budget = result.toma_sizes[1], result.toma_sizes[3]
    assert rows is not None
    after = f"toma's sizes after the epochs: (2) {rows[0]} rows ({rows[1]} OOM retries)"
    if budget is not None:
        after += f", (4) a budget of {budget[0]} tokens ({budget[1]} OOM retries)"
    lines += ["", after + "."]
    return lines


def verdicts(results: List[Result]) -> List[str]:
    lines = []
    worst = max(d for result in results for d in result.differences if d is not None)
    lines.append(f"- gradients: largest relative difference from the full batch {worst:.1e} (target <= 1e-5)")
    if results[0].epoch_times[3] is None:
        lines.append("- (4) `lengths=`: not available yet in this toma; targets not measured")
        return lines
    for result in results:
        times = result.epoch_times
        if result.workload.name.startswith("C"):
            cost = statistics.median(t4 / t2 for t4, t2 in zip(times[3], times[1]))
            lines.append(f"- {result.workload.name}: (4) takes {cost:.3f}x the time of (2) (target <= 1.02x)")
        else:
            tokens, by_hand = ratio(times[3], times[0]), ratio(times[2], times[0])
            target = " (target >= 2.0x)" if result.workload.name.startswith("A") else ""
            lines.append(
                f"- {result.workload.name}: (4) {tokens:.2f}x the tokens/s of (1){target}; the hand-written (3) "
                f"{by_hand:.2f}x"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="epochs per method, interleaved")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="the process's CPU time, or wall time")
    parser.add_argument("--quick", action="store_true", help="a tiny model and two logical batches: seconds")
    parser.add_argument("--workloads", default="ABC", help="which workloads to run, by letter (default ABC)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    shape = QUICK_MODEL if args.quick else MODEL
    rounds = 1 if args.quick else args.rounds
    print(
        f"GPT-2 from a config: {shape['n_layer']} layers, width {shape['n_embd']}, {shape['n_head']} heads, "
        f"vocabulary {shape['vocab_size']}, SDPA attention; torch {torch.__version__}, {args.threads} thread(s), "
        f"{args.clock} clock, {rounds} round(s); toma `lengths=`: {'yes' if has_lengths() else 'not available yet'}"
    )
    results = []
    for workload in [w for w in workloads(args.quick) if w.name[0] in args.workloads.upper()]:
        result = measure(workload, shape, rounds, CLOCKS[args.clock])
        results.append(result)
        print()
        print("\n".join(table(result)), flush=True)
    print()
    print("\n".join(verdicts(results)))


if __name__ == "__main__":
    main()
