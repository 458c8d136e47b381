"""The distributed training steps the DDP benchmark compares, shared by its two ranks (rank 0 is the pytest
process, rank 1 a worker started by it). Each step is announced by a broadcast from rank 0, so the worker
follows however many rounds pytest-benchmark chooses."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from toma import toma
from toma.accumulation.gradient_collectives import all_reduce_gradients

LOGICAL, MICRO = 1024, 128
STOP, NATIVE, NO_OVERLAP, TOMA = 0, 1, 2, 3


class Steps:
    """One rank's model, data and the three ways to train a logical batch."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        self.ddp = nn.parallel.DistributedDataParallel(self.model)
        self.optimizer = torch.optim.SGD(self.ddp.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(dist.get_rank())
        self.inputs = torch.randn(LOGICAL, 64, generator=generator)
        self.targets = torch.randint(0, 10, (LOGICAL,), generator=generator)
        self.compute_loss = toma.accumulate(model=self.ddp, initial_micro_batch=MICRO)(self.micro_loss)

    def micro_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.ddp(x), y)

    def native(self, overlap: bool) -> None:
        """The hand-written DDP loop: no_sync on all micro-batches but the last (overlap=True), whose backward
        pass all-reduces as it goes; or no_sync on all and one all-reduce at the end (overlap=False)."""
        self.optimizer.zero_grad()
        for start in range(0, LOGICAL, MICRO):
            last = start + MICRO >= LOGICAL
            x, y = self.inputs[start : start + MICRO], self.targets[start : start + MICRO]
            if last and overlap:
                (self.micro_loss(x, y) * (MICRO / LOGICAL)).backward()
            else:
                with self.ddp.no_sync():
                    (self.micro_loss(x, y) * (MICRO / LOGICAL)).backward()
        if not overlap:
            all_reduce_gradients(list(self.model.parameters()))
        self.optimizer.step()

    def toma(self) -> None:
        self.optimizer.zero_grad()
        self.compute_loss(self.inputs, self.targets)
        self.optimizer.step()

    def run(self, command: int) -> None:
        """Rank 0: announce `command`, then do it (as the worker does)."""
        announced = torch.tensor([command])
        dist.broadcast(announced, 0)
        self.do(command)

    def do(self, command: int) -> None:
        if command == NATIVE:
            self.native(overlap=True)
        elif command == NO_OVERLAP:
            self.native(overlap=False)
        elif command == TOMA:
            self.toma()


def worker() -> None:
    """Rank 1: follow rank 0's announcements until STOP."""
    dist.init_process_group("gloo")
    steps = Steps()
    while True:
        command = torch.tensor([STOP])
        dist.broadcast(command, 0)
        if int(command) == STOP:
            break
        steps.do(int(command))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker()
