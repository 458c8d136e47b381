"""MicroBatching under Lightning's DDP: two CPU ranks over gloo, only rank 0 short of memory.

Run: python examples/lightning_ddp.py   (Lightning starts the second rank itself; about a minute on 2 cores)

Rank 0 runs out of memory above 8 rows (an injected error standing in for a smaller GPU); rank 1 never does. The
ranks agree on every attempt, so both train at micro-batch size 8, and DDP all-reduces the logical batches'
gradients in the backward pass Lightning runs. Each rank then compares its parameters with a plain DDP run on
the same batches (rtol 1e-5) and prints what it found.
"""

import json
import logging

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from toma.integrations.lightning import MicroBatching


class Classifier(pl.LightningModule):
    def __init__(self, oom_above=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.oom_above = oom_above

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        if self.oom_above is not None and len(inputs) > self.oom_above:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return F.cross_entropy(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def fit(module, callbacks):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=3,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(128, 8, generator=generator), torch.randint(0, 3, (128,), generator=generator)
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=32))  # 32 rows per rank and step
    return trainer.global_rank


def main():
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    plain = Classifier()
    rank = fit(plain, [])
    micro_batching = MicroBatching()
    module = Classifier(oom_above=8 if rank == 0 else None)
    fit(module, [micro_batching])
    same = all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(module.parameters(), plain.parameters(), strict=True)
    )
    result = dict(rank=rank, micro_batch=micro_batching.stats.micro_batch, oom_retries=micro_batching.stats.oom_retries)
    print(json.dumps(dict(result, same_parameters_as_plain_ddp=same)), flush=True)


if __name__ == "__main__":
    main()
