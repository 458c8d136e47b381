"""MicroBatching against plain Lightning, per training step, when nothing runs out of memory.

Run: python benchmarks/lightning_overhead.py [--rounds 6] [--steps 200] [--width 256] [--clock cpu|wall]

The same LightningModule (an MLP, logical batches of 1024 rows, SGD) is fitted in turns with and without
`toma.integrations.lightning.MicroBatching`; a callback times every step from `on_train_batch_start` to
`on_train_batch_end` (the training step, backward, optimizer step, logging). No out-of-memory error happens, so
each batch runs whole as one micro-batch: the ratio of the median step times is what the callback costs (target:
at most 1.03x). The fits alternate, so the machine's drift reaches both alike. `benchmarks/test_lightning_overhead.py`
runs the same fits under pytest-benchmark.
"""

import argparse
import logging
import statistics
import time
from typing import Any, Dict, List

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from toma.integrations.lightning import MicroBatching

ROWS, LOGICAL, WARMUP = 8192, 1024, 5


class MLP(pl.LightningModule):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = F.cross_entropy(self.net(inputs), targets)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
clock = time.process_time  # CPU time: on a shared machine the other processes' load stays out of it


class StepTimes(pl.Callback):
    """The seconds of every training step, from the batch's start to its end."""

    def __init__(self) -> None:
        self.seconds: List[float] = []
        self._started = 0.0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._started = clock()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.seconds.append(clock() - self._started)


def loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(ROWS, 64, generator=generator), torch.randint(0, 10, (ROWS,), generator=generator)
    )
    return torch.utils.data.DataLoader(data, batch_size=LOGICAL)


def fit(micro_batching: bool, steps: int, width: int = 256) -> "tuple[List[float], MLP]":
    """One fit of `steps` steps; the step times after the warm-up, and the trained module."""
    times = StepTimes()
    callbacks: List[pl.Callback] = [times] + ([MicroBatching()] if micro_batching else [])
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    module = MLP(width)
    trainer.fit(module, loader())
    return times.seconds[WARMUP:], module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="fits of each kind, alternating")
    parser.add_argument("--steps", type=int, default=200, help="steps per fit")
    parser.add_argument("--width", type=int, default=256, help="the MLP's hidden width (the step's work)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="the process's CPU time, or wall time")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    medians: Dict[bool, List[float]] = {False: [], True: []}
    fastest: Dict[bool, List[float]] = {False: [], True: []}  # each round's fastest decile, less the machine's noise
    for _ in range(args.rounds):
        for micro_batching in (False, True):
            seconds, _ = fit(micro_batching, args.steps, args.width)
            medians[micro_batching].append(statistics.median(seconds))
            fastest[micro_batching].append(statistics.quantiles(seconds, n=10)[0])
    print(
        f"| training step (MLP of width {args.width}, logical batch {LOGICAL}, CPU, 1 thread, {args.clock} time) | median step | ratio | fastest decile | ratio |"
    )
    print("|---|---|---|---|---|")
    for micro_batching, name in ((False, "plain Lightning"), (True, "MicroBatching, no out-of-memory error")):
        median_ratios = [m / p for p, m in zip(medians[False], medians[micro_batching])]
        fastest_ratios = [m / p for p, m in zip(fastest[False], fastest[micro_batching])]
        print(
            f"| {name} | {statistics.median(medians[micro_batching]) * 1e3:.3f} ms "
            f"| {statistics.median(median_ratios):.3f} | {statistics.median(fastest[micro_batching]) * 1e3:.3f} ms "
            f"| {statistics.median(fastest_ratios):.3f} |"
        )
    ratios = [m / p for p, m in zip(medians[False], medians[True])]
    print(
        f"median ratio per round: {', '.join(f'{r:.3f}' for r in ratios)} (ratios are medians of rounds; target 1.03)"
    )


if __name__ == "__main__":
    main()
