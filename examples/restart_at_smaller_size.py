"""A job that dies is restarted by torchrun and starts at the micro-batch size it found, not at the one it asked for.

    TOMA_SIZES=sizes.db torchrun --nproc_per_node=2 --max-restarts=3 examples/restart_at_smaller_size.py

Runs on the CPU with gloo. Two DDP ranks train logical batches of 64 rows, asking for micro-batches of 64. Rank 1
has room for 16 rows (here an out-of-memory error it raises above 16, as a smaller GPU would): the ranks agree on 32,
then 16, and the size file (`TOMA_SIZES`) keeps 16 for this call site. Then, in the first run only, rank 1 dies
(as a process does that no agreement can save: killed, or a collective that timed out); rank 0 fails in the next
collective, and torchrun restarts both. The restarted ranks read 16 from the size file and train without an error.
Each rank prints, per run, the sizes its attempts ran at.
"""

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from toma import Halving, toma

ASKED, ROOM_ON_RANK_1, STEPS = 64, 16, 3


def main() -> None:
    dist.init_process_group("gloo")
    rank, restart = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes = []

    @toma.accumulate(model=model, initial_micro_batch=ASKED, policy=Halving())
    def compute_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            sizes.append(len(x))
            if rank == 1 and len(x) > ROOM_ON_RANK_1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (rank 1 has room for 16)")
        return F.cross_entropy(model(x), y)

    generator = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        x, y = torch.randn(ASKED, 8, generator=generator), torch.randint(0, 4, (ASKED,), generator=generator)
        optimizer.zero_grad()
        compute_loss(x, y)
        optimizer.step()
        if step == 0:
            print(json.dumps(dict(rank=rank, restart=restart, first_step=sorted(set(sizes), reverse=True))), flush=True)
            if restart == 0 and rank == 1:
                os._exit(17)  # dies: torchrun restarts every rank
    print(json.dumps(dict(rank=rank, restart=restart, oom_retries=compute_loss.stats.oom_retries)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
