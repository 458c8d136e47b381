"""MicroBatching under Lightning's FSDP2 strategy (`ModelParallelStrategy`): two CPU ranks over gloo, rank 1 short
of memory for real.

Run: python examples/lightning_fsdp2.py [--gradient-sync micro_batch|sharded]   (Lightning starts the second rank itself)

The LightningModule shards its blocks and its model with `fully_shard` in `configure_model`, as Lightning's FSDP2
strategy expects. A plain run trains 3 steps on batches of 4096 rows per rank as the reference. Then rank 1 caps
its own address space (96 MiB above what it holds: one 4096 x 4096 activation is 64 MiB) and the same run goes
through `MicroBatching`: rank 1 runs out of memory for real in its first batch, both ranks leave the attempt (no
collective runs inside it), agree on a smaller micro-batch and redo the batch. Each rank prints its micro-batch
size, its retries and whether its parameters equal the plain run's (rtol 1e-5).
"""

import argparse
import json
import logging
import os
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

from toma.integrations.lightning import MicroBatching
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom

ROWS, WIDTH, STEPS, HEADROOM_MIB = 4096, 4096, 3, 96


class Sharded(pl.LightningModule):
    def __init__(self, cap_rank_1: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial model on every rank
        self.net = nn.Sequential(
            nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU()),
            nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU()),
            nn.Linear(64, 10),
        )
        self.cap_rank_1 = cap_rank_1

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.net[:2]:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def on_train_start(self) -> None:
        if self.cap_rank_1 and self.global_rank == 1:
            set_cpu_memory_headroom(HEADROOM_MIB / 1024)
            print(f"[rank 1] capped at {HEADROOM_MIB} MiB more than it holds", flush=True)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return F.cross_entropy(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(module: Sharded, callbacks: list) -> int:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=STEPS,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(2 * STEPS * ROWS, 64, generator=generator),
        torch.randint(0, 10, (2 * STEPS * ROWS,), generator=generator),
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=ROWS))  # each rank its own batches
    return trainer.global_rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gradient-sync", default="auto", choices=["auto", "logical_batch", "micro_batch", "sharded"])
    options = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    predictable_heap()
    plain = Sharded()
    rank = fit(plain, [])
    expected = [p.detach().full_tensor() for p in plain.parameters()]
    micro_batching = MicroBatching(gradient_sync=options.gradient_sync)
    module = Sharded(cap_rank_1=True)
    fit(module, [micro_batching])
    got = [p.detach().full_tensor() for p in module.parameters()]
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(got, expected, strict=True))
    result = dict(rank=rank, micro_batch=micro_batching.stats.micro_batch, oom_retries=micro_batching.stats.oom_retries)
    print(json.dumps(dict(result, same_parameters_as_plain_fsdp2=same)), flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads may abort the interpreter's exit after the work is done
