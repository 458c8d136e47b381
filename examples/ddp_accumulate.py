"""Gradient accumulation under DistributedDataParallel where one rank has less memory than the others.

    torchrun --nproc_per_node=2 examples/ddp_accumulate.py
    torchrun --nproc_per_node=2 examples/ddp_accumulate.py --memory-fraction 0.0012   # GPUs of 80 GiB: 98 MiB

Runs on the CPU with gloo (on GPUs with NCCL). Each rank trains on its share of a logical batch of 4096 rows
per rank. Rank 0 caps its own memory (on the CPU always; on a GPU with `--memory-fraction`, through
`torch.cuda.set_per_process_memory_fraction`) so that a micro-batch of 4096 cannot fit there, while the
other ranks could run it: the ranks agree on every out-of-memory error, so all of them move to the same
smaller micro-batch size and redo the logical batch together instead of hanging in mismatched collectives.
Every rank ends each step with the same, exact gradients; the script checks that the parameters agree.
"""

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from toma import toma
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom

PER_RANK, WIDTH, STEPS, HEADROOM_MIB = 4096, 4096, 4, 96


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-fraction", type=float, help="on GPUs: the share of its GPU's memory rank 0 may take")
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

    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    inputs = torch.randn(STEPS, PER_RANK, 64, generator=generator)
    targets = torch.randint(0, 10, (STEPS, PER_RANK), generator=generator)

    @toma.accumulate(model=ddp, initial_micro_batch=PER_RANK)
    def compute_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(ddp(x.to(device)), y.to(device))

    if rank == 0 and not cuda:
        set_cpu_memory_headroom(HEADROOM_MIB / 1024)  # a 4096 x 4096 activation alone is 64 MiB
        print(f"[rank 0] capped at {HEADROOM_MIB} MiB more than it holds", flush=True)
    if rank == 0 and cuda and options.memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(options.memory_fraction, device)
        mib = options.memory_fraction * torch.cuda.get_device_properties(device).total_memory / 2**20
        print(f"[rank 0] capped {device} at {mib:.0f} MiB", flush=True)

    for step in range(STEPS):
        optimizer.zero_grad()
        loss = compute_loss(inputs[step], targets[step])
        optimizer.step()
        print(f"[rank {rank}] step {step + 1}: loss {loss.item():.4f}, micro-batch {compute_loss.stats.micro_batch}")

    # Every rank must hold the same parameters: compare a checksum across ranks.
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    checksums = [torch.zeros_like(checksum) for _ in range(world)]
    dist.all_gather(checksums, checksum)
    sizes = torch.tensor([compute_loss.stats.micro_batch], device=device)
    all_sizes = [torch.zeros_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes)
    if rank == 0:
        print(f"micro-batch size on every rank: {[int(s) for s in all_sizes]}")
        print(f"out-of-memory retries on rank 0: {compute_loss.stats.oom_retries}")
        print(f"parameters identical on every rank: {len({float(c) for c in checksums}) == 1}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # gloo's background threads are sometimes torn down out of order at interpreter exit and abort the
    # process ("terminate called without an active exception") after all work is done: leave directly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
