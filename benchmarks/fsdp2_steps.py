"""`toma.accumulate` on an FSDP2 model against the hand-written FSDP2 accumulation loop, 2 gloo ranks (issue 32).

    torchrun --standalone --nproc_per_node=2 benchmarks/fsdp2_steps.py [--rounds 7] [--quick]

One model (an embedding, 4 transformer blocks of width 128, each `fully_shard`ed, and the root), each rank a
logical batch of 64 sequences of 32 tokens in micro-batches of 16, SGD. The hand-written loop is the usual one:
`set_requires_gradient_sync(False)` on every micro-batch but the last, whose backward pass reduce-scatters;
FSDP2 all-gathers each block in every forward and backward pass. `toma.accumulate(model=..., initial_micro_batch=16)`
unshards every block once per logical batch, runs the micro-batches without collectives, agrees with the other
rank, then averages the gradients once (an all-reduce: gloo has no reduce-scatter of its own) and keeps its shard.
The two alternate, a logical batch each, for `--rounds` rounds of 8 logical batches; rank 0 prints the median
time per logical batch of each and their ratio, and the collectives each issues per logical batch, by kind.
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


def make(blocks: int) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True) for _ in range(blocks)]
    model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), *layers, nn.Linear(WIDTH, VOCAB))
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="2 blocks, 2 rounds of 2 logical batches: seconds")
    options = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    blocks, rounds, per_round = (2, 2, 2) if options.quick else (4, options.rounds, 8)
    generator = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, VOCAB, (LOGICAL, LENGTH), generator=generator) for _ in range(per_round)]

    hand_model, toma_model = make(blocks), make(blocks)
    hand_optimizer = torch.optim.SGD(hand_model.parameters(), lr=1e-3)
    toma_optimizer = torch.optim.SGD(toma_model.parameters(), lr=1e-3)

    def hand(x: torch.Tensor) -> None:
        hand_optimizer.zero_grad()
        for start in range(0, LOGICAL, MICRO):
            hand_model.set_requires_gradient_sync(start + MICRO >= LOGICAL)
            (loss_of(hand_model, x[start : start + MICRO]) * (MICRO / LOGICAL)).backward()
        hand_optimizer.step()

    compute_loss = toma.accumulate(model=toma_model, initial_micro_batch=MICRO, cache_type=NoBatchsizeCache)(
        lambda x: loss_of(toma_model, x)
    )

    def by_toma(x: torch.Tensor) -> None:
        toma_optimizer.zero_grad()
        compute_loss(x)
        toma_optimizer.step()

    methods: Dict[str, Callable[[torch.Tensor], None]] = {"hand-written FSDP2 loop": hand, "toma.accumulate": by_toma}
    count_collectives()
    collectives: Dict[str, Counter] = {}
    for name, method in methods.items():  # warm up; count one logical batch's collectives
        method(batches[0])
        calls.clear()
        method(batches[1 % per_round])
        collectives[name] = Counter(calls)
    times: Dict[str, List[float]] = {name: [] for name in methods}
    for round_ in range(rounds):
        for number, x in enumerate(batches):
            order = list(methods) if (round_ + number) % 2 == 0 else list(methods)[::-1]
            for name in order:
                dist.barrier()
                start = time.perf_counter()
                methods[name](x)
                dist.barrier()
                times[name].append(time.perf_counter() - start)
    difference = max(
        float((a.detach().full_tensor() - b.detach().full_tensor()).abs().max() / b.detach().full_tensor().abs().max())
        for a, b in zip(toma_model.parameters(), hand_model.parameters())
    )
    if rank == 0:
        hand_ms = statistics.median(times["hand-written FSDP2 loop"]) * 1e3
        toma_ms = statistics.median(times["toma.accumulate"]) * 1e3
        print(
            f"FSDP2, 2 gloo ranks, {blocks} blocks of width {WIDTH}: logical batch {LOGICAL} x {LENGTH} tokens per "
            f"rank in micro-batches of {MICRO}; {rounds} rounds of {per_round} logical batches"
        )
        print(f"hand-written FSDP2 loop: {hand_ms:.1f} ms per logical batch")
        print(f"toma.accumulate: {toma_ms:.1f} ms per logical batch")
        print(f"toma / hand-written: {toma_ms / hand_ms:.3f}")
        for name, counted in collectives.items():
            print(f"collectives per logical batch, {name}: {dict(sorted(counted.items()))}")
        print(f"largest parameter difference between the two at the end: {difference:.1e}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
