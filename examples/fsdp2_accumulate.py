"""Gradient accumulation on an FSDP2 model (`fully_shard`) where one rank has less memory than the others.

    torchrun --nproc_per_node=2 examples/fsdp2_accumulate.py

Runs on the CPU with gloo (on GPUs with NCCL). Each rank holds a shard of every block and trains on its own
logical batch of 4096 rows. First the unsplit FSDP2 step runs, uncapped, as the reference. Then rank 1 caps its
own memory (on the CPU, an address-space limit; on a GPU with `--memory-fraction`) so that 4096 rows cannot pass
there in one piece: `toma.accumulate` runs into a real out-of-memory error on rank 1, both ranks leave the
attempt (no collective runs inside it, so nobody waits in an all-gather), agree on a smaller micro-batch and redo
the logical batch. The script prints each step's micro-batch size on every rank and checks the parameters
against the unsplit steps'.
"""

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from toma import toma
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom

PER_RANK, WIDTH, STEPS, HEADROOM_MIB = 4096, 4096, 3, 96


def sharded_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(
        nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU()),
        nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU()),
        nn.Linear(64, 10),
    ).to(device)
    for block in model[:2]:
        fully_shard(block)
    fully_shard(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-fraction", type=float, help="on GPUs: the share of its GPU's memory rank 1 may take")
    options = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s", stream=sys.stdout)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
        predictable_heap()
    generator = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    inputs = torch.randn(STEPS, PER_RANK, 64, generator=generator)
    targets = torch.randint(0, 10, (STEPS, PER_RANK), generator=generator)

    reference = sharded_model(device)  # the unsplit FSDP2 steps, before any cap
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(reference(inputs[step].to(device)), targets[step].to(device)).backward()
        optimizer.step()
    expected = [p.detach().full_tensor().cpu() for p in reference.parameters()]
    del reference, optimizer

    model = sharded_model(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    @toma.accumulate(model=model, initial_micro_batch=PER_RANK)
    def compute_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x.to(device)), y.to(device))

    if rank == 1 and not cuda:
        set_cpu_memory_headroom(HEADROOM_MIB / 1024)  # a 4096 x 4096 activation alone is 64 MiB
        print(f"[rank 1] capped at {HEADROOM_MIB} MiB more than it holds", flush=True)
    if rank == 1 and cuda and options.memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(options.memory_fraction, device)
        print(f"[rank 1] capped {device} at a fraction {options.memory_fraction} of its memory", flush=True)

    sizes = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = compute_loss(inputs[step], targets[step])
        optimizer.step()
        sizes.append(compute_loss.stats.micro_batch)
        print(f"[rank {rank}] step {step + 1}: loss {loss.item():.4f}, micro-batch {sizes[-1]}", flush=True)

    got = [p.detach().full_tensor().cpu() for p in model.parameters()]  # collectives: every rank
    largest = max(float((g - e).abs().max() / e.abs().max()) for g, e in zip(got, expected))
    all_sizes = [None] * world
    dist.all_gather_object(all_sizes, sizes)
    if rank == 0:
        print(f"micro-batch sizes on every rank: {all_sizes}")
        print(f"largest difference from the unsplit FSDP2 steps: {largest:.1e}")
    if rank == 1:
        print(f"out-of-memory retries on rank 1: {compute_loss.stats.oom_retries}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # gloo's background threads are sometimes torn down out of order at interpreter exit and abort the
    # process ("terminate called without an active exception") after all work is done: leave directly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
