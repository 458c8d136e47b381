"""`toma.accumulate` on an FSDP2 model against the hand-written FSDP2 accumulation loop, 2 gloo ranks (issues 32, 43).

    torchrun --standalone --nproc_per_node=2 benchmarks/fsdp2_steps.py [--rounds 7] [--quick]

One model (an embedding, 4 transformer blocks of width 128, each `fully_shard`ed, and the root), each rank a
logical batch of 64 sequences of 32 tokens in micro-batches of 16, SGD. The hand-written loop is the usual one:
`set_requires_gradient_sync(False)` on every micro-batch but the last, whose backward pass reduce-scatters;
FSDP2 all-gathers each block in every forward and backward pass. `toma.accumulate(model=..., initial_micro_batch=16)`
unshards every block once per logical batch, runs the micro-batches without collectives, agrees with the other
rank, then reduce-scatters the gradients once per unit, each rank keeping its shard.
`toma.accumulate(..., gradient_sync="micro_batch")` instead reduce-scatters after every micro-batch, after the
ranks agreed that all finished it: less memory held (the unsharded gradients do not stay beside the next
micro-batch's forward pass), more communication; its hand-written counterpart is FSDP2's default loop, which
reduce-scatters in every backward pass. `toma.accumulate(..., gradient_sync="sharded")` (issue 43) leaves the
parameters sharded and runs FSDP2's own schedule, as that loop does, with the ranks' agreement (one small all-reduce)
before each of FSDP2's all-gathers and reduce-scatters. The five alternate, a logical batch each, for `--rounds`
rounds of 8 logical batches; rank 0 prints the median time per logical batch of each and its ratio to the
hand-written loop, the collectives each issues per logical batch, by kind, the unsharded gradients each unsharded
toma mode holds when a micro-batch's forward pass starts (the memory "micro_batch" frees for activations), and each
method's peak memory per rank during a logical batch above where it began, without gradients (the resident size's
high-water mark, `VmHWM`, reset before each step; glibc told to return freed tensors of 64 KiB and more at once), the
largest over the run, with the sharded mode's ratios to FSDP2's default loop. `--blocks`/`--width` change the model.
"""

import argparse
import datetime
import os
import statistics
import sys
import time
from collections import Counter
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from toma import NoBatchsizeCache, toma
from toma.core.agreement import Agreement
from toma.core.host_min import HostMin, host_min_for
from toma.memory.cpu import predictable_heap
from toma.memory.meters import CpuMeter

LOGICAL, MICRO, LENGTH, VOCAB, WIDTH = 64, 16, 32, 256, 128
COUNTED = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
           "all_reduce", "broadcast", "all_gather")  # fmt: skip
calls: Counter = Counter()


def count_collectives() -> None:
    """Wrap torch.distributed's collectives so that each call is counted by name (FSDP2 looks them up on the
    module when it calls them)."""
    for name in COUNTED:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    shared_min = HostMin.min

    def counted_min(self: HostMin, value: int) -> int:  # the agreements FSDP2's syncs make through shared memory
        calls["agreement_in_shared_memory"] += 1
        return shared_min(self, value)

    HostMin.min = counted_min  # type: ignore[method-assign]


def agreement_latency(agreement: Agreement, count: int) -> float:
    """Milliseconds per agreement, `count` in a row, the ranks starting together."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(count):
        agreement.all_finished(MICRO)
    return (time.perf_counter() - start) / count * 1e3


def make(blocks: int, width: int = WIDTH) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True) for _ in range(blocks)]
    model = nn.Sequential(nn.Embedding(VOCAB, width), *layers, nn.Linear(width, VOCAB))
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.is_floating_point():  # the issue-43 shape's rows
        return model(x).square().mean()
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def make_residual(blocks: int, width: int) -> nn.Module:
    """Issue 43's shape: residual blocks of width x width, each `fully_shard`ed, and the root."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Residual(width) for _ in range(blocks)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="2 blocks, 2 rounds of 2 logical batches: seconds")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument(
        "--issue43", action="store_true", help="issue 43's shape: 96 residual blocks of 512 x 512, 196 rows per rank"
    )
    options = parser.parse_args()
    predictable_heap(64 * 1024)  # freed tensors leave the resident size: each step's peak counts what it allocates
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    blocks, rounds, per_round = (2, 2, 2) if options.quick else (options.blocks, options.rounds, 8)
    width = options.width
    generator = torch.Generator().manual_seed(1 + rank)
    global LOGICAL, MICRO  # the issue-43 shape has its own
    if options.issue43:
        blocks, width, LOGICAL, MICRO, per_round = 96, 512, 196, 49, 4
        batches = [torch.randn(LOGICAL, width, generator=generator) for _ in range(per_round)]
        build: Callable[[int, int], nn.Module] = make_residual
    else:
        batches = [torch.randint(0, VOCAB, (LOGICAL, LENGTH), generator=generator) for _ in range(per_round)]
        build = make
    hand_model, toma_model, reducing_model, every_model, sharded_model = (build(blocks, width) for _ in range(5))
    hand_optimizer = torch.optim.SGD(hand_model.parameters(), lr=1e-3)
    every_optimizer = torch.optim.SGD(every_model.parameters(), lr=1e-3)
    toma_optimizer = torch.optim.SGD(toma_model.parameters(), lr=1e-3)
    reducing_optimizer = torch.optim.SGD(reducing_model.parameters(), lr=1e-3)
    sharded_optimizer = torch.optim.SGD(sharded_model.parameters(), lr=1e-3)

    def hand(x: torch.Tensor) -> None:
        hand_optimizer.zero_grad()
        for start in range(0, LOGICAL, MICRO):
            hand_model.set_requires_gradient_sync(start + MICRO >= LOGICAL)
            (loss_of(hand_model, x[start : start + MICRO]) * (MICRO / LOGICAL)).backward()
        hand_optimizer.step()

    def hand_every(x: torch.Tensor) -> None:  # FSDP2's default: a reduce-scatter in every backward pass
        every_optimizer.zero_grad()
        for start in range(0, LOGICAL, MICRO):
            (loss_of(every_model, x[start : start + MICRO]) * (MICRO / LOGICAL)).backward()
        every_optimizer.step()

    compute_loss = toma.accumulate(model=toma_model, initial_micro_batch=MICRO, cache_type=NoBatchsizeCache)(
        lambda x: loss_of(toma_model, x)
    )

    def by_toma(x: torch.Tensor) -> None:
        toma_optimizer.zero_grad()
        compute_loss(x)
        toma_optimizer.step()

    reducing_loss = toma.accumulate(
        model=reducing_model, initial_micro_batch=MICRO, cache_type=NoBatchsizeCache, gradient_sync="micro_batch"
    )(lambda x: loss_of(reducing_model, x))

    def reducing(x: torch.Tensor) -> None:
        reducing_optimizer.zero_grad()
        reducing_loss(x)
        reducing_optimizer.step()

    sharded_loss = toma.accumulate(
        model=sharded_model, initial_micro_batch=MICRO, cache_type=NoBatchsizeCache, gradient_sync="sharded"
    )(lambda x: loss_of(sharded_model, x))

    def sharded(x: torch.Tensor) -> None:
        sharded_optimizer.zero_grad()
        sharded_loss(x)
        sharded_optimizer.step()

    methods: Dict[str, Callable[[torch.Tensor], None]] = {
        "hand-written FSDP2 loop": hand,
        "toma.accumulate": by_toma,
        "hand-written FSDP2 loop, reduce-scatter every micro-batch": hand_every,
        'toma.accumulate, gradient_sync="micro_batch"': reducing,
        'toma.accumulate, gradient_sync="sharded"': sharded,
    }
    models = dict(zip(methods, (hand_model, toma_model, every_model, reducing_model, sharded_model)))
    count_collectives()
    collectives: Dict[str, Counter] = {}
    held: Dict[str, int] = {}

    def holding(model: nn.Module, name: str) -> None:
        def hook(module: nn.Module, args: object) -> None:
            grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
            held[name] = max(held.get(name, 0), int(grads))

        model.register_forward_pre_hook(hook)

    holding(toma_model, "toma.accumulate")
    holding(reducing_model, 'toma.accumulate, gradient_sync="micro_batch"')
    for name, method in methods.items():  # warm up; count one logical batch's collectives
        method(batches[0])
        calls.clear()
        method(batches[1 % per_round])
        collectives[name] = Counter(calls)
    times: Dict[str, List[float]] = {name: [] for name in methods}
    peaks: Dict[str, int] = {name: 0 for name in methods}
    meter = CpuMeter()
    for round_ in range(rounds):
        for number, x in enumerate(batches):
            order = list(methods) if (round_ + number) % 2 == 0 else list(methods)[::-1]
            for name in order:
                for param in models[name].parameters():  # every step starts without gradients (peaks comparable)
                    param.grad = None
                dist.barrier()
                mark = meter.begin()
                start = time.perf_counter()
                methods[name](x)
                dist.barrier()
                times[name].append(time.perf_counter() - start)
                used = None if mark is None else meter.used(mark)
                peaks[name] = max(peaks[name], used or 0)
    agreement, count = Agreement(), 200  # one agreement's latency alone: what the sharded mode adds per collective
    agreement_ms = agreement_latency(agreement, count)  # through gloo's all-reduce
    agreement.exchange = host_min_for(None)
    shared_ms = agreement_latency(agreement, count)  # through shared memory, as FSDP2's syncs agree on one host
    peak_tensor = torch.tensor([peaks[name] for name in methods], dtype=torch.float64)
    dist.all_reduce(peak_tensor, op=dist.ReduceOp.MAX)  # the larger rank's

    def differs(model: nn.Module, norm: bool = False) -> float:
        pairs = [
            (a.detach().full_tensor(), b.detach().full_tensor())
            for a, b in zip(model.parameters(), hand_model.parameters())
        ]
        if norm:  # over all parameters: zero-initialised biases stay small, their own scale magnifies rounding
            apart = torch.cat([(a - b).flatten() for a, b in pairs]).norm()
            return float(apart / torch.cat([b.flatten() for _, b in pairs]).norm())
        return max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)

    difference, reducing_difference = differs(toma_model), differs(reducing_model, norm=True)
    sharded_difference = differs(sharded_model, norm=True)
    if rank == 0:
        print(
            f"FSDP2, 2 gloo ranks, {blocks} {'residual' if options.issue43 else 'transformer'} blocks of width {width}: "
            f"logical batch {LOGICAL} rows per rank in micro-batches of {MICRO}; {rounds} rounds of {per_round} "
            "logical batches"
        )
        hand_ms = statistics.median(times["hand-written FSDP2 loop"]) * 1e3
        for name in methods:
            ms = statistics.median(times[name]) * 1e3
            print(f"{name}: {ms:.1f} ms per logical batch, {ms / hand_ms:.3f} of the hand-written loop")
        toma_ms = statistics.median(times["toma.accumulate"]) * 1e3
        print(f"toma / hand-written: {toma_ms / hand_ms:.3f}")
        every_ms = statistics.median(times["hand-written FSDP2 loop, reduce-scatter every micro-batch"]) * 1e3
        reducing_ms = statistics.median(times['toma.accumulate, gradient_sync="micro_batch"']) * 1e3
        print(f"toma micro_batch / hand-written reduce-scatter every micro-batch: {reducing_ms / every_ms:.3f}")
        sharded_ms = statistics.median(times['toma.accumulate, gradient_sync="sharded"']) * 1e3
        print(f"toma sharded / hand-written reduce-scatter every micro-batch: {sharded_ms / every_ms:.3f}")
        agreements = collectives['toma.accumulate, gradient_sync="sharded"'].get("agreement_in_shared_memory", 0)
        print(
            f"one agreement alone: {shared_ms:.4f} ms in shared memory ({agreement_ms:.3f} ms as a gloo all-reduce); "
            f"the sharded mode's {agreements} per logical batch: {agreements * shared_ms:.1f} ms "
            f"({agreements * agreement_ms:.1f} ms as all-reduces) of its {sharded_ms - every_ms:+.1f} ms against "
            "FSDP2's default loop"
        )
        for name, peak in zip(methods, peak_tensor.tolist()):
            print(f"peak memory per rank during a logical batch, {name}: {peak / 2**20:.1f} MiB")
        every_peak = peak_tensor[list(methods).index("hand-written FSDP2 loop, reduce-scatter every micro-batch")]
        sharded_peak = peak_tensor[list(methods).index('toma.accumulate, gradient_sync="sharded"')]
        print(f"peak, toma sharded / hand-written reduce-scatter every micro-batch: {sharded_peak / every_peak:.3f}")
        for name, counted in collectives.items():
            print(f"collectives per logical batch, {name}: {dict(sorted(counted.items()))}")
        for name, grads in held.items():
            print(f"unsharded gradients held when a micro-batch's forward pass starts, {name}: {grads / 2**20:.2f} MiB")
        print(f"largest parameter difference between the two at the end: {difference:.1e}")
        print(f"parameter difference, micro_batch against the hand-written loop (norm-wise): {reducing_difference:.1e}")
        print(f"parameter difference, sharded against the hand-written loop (norm-wise): {sharded_difference:.1e}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
