"""`TomaTrainer(toma_pack_tokens=True)` against the plain Hugging Face Trainer on long-tailed lengths (issue 31).

Run: python benchmarks/hf_varlen.py [--steps 16] [--quick]

The GPT-2 of benchmarks/varlen.py (built from a config, SDPA, no dropout) trains with the same loader batches of 32
rows, right-padded to their longest row (workload A of varlen.py: log-normal lengths, median ~48, a few at 512),
SGD, no clipping: the plain Trainer runs each batch whole at its padded width; TomaTrainer packs its rows by tokens
(a budget of the first batch's padded area, kept for the others), each micro-batch trimmed to its longest row. Reported: the time
of `train()` for each (CPU time of one thread on this shared machine, the two runs alternating over 3 rounds), the
ratio (target >= 1.8x), and the largest parameter difference at the end (relative to the largest parameter).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

import torch
from transformers import Trainer, TrainingArguments
from transformers import logging as hf_logging

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from varlen import MODEL, QUICK_MODEL, ROWS, logical_batches, make_model, workloads  # noqa: E402

from toma.integrations.transformers import TomaTrainer  # noqa: E402


class Rows(torch.utils.data.Dataset):
    """The rows of the logical batches, each unpadded (the collator pads per loader batch)."""

    def __init__(self, batches: List[Any]) -> None:
        self.rows: List[torch.Tensor] = []
        for batch in batches:
            ids, mask = batch["input_ids"], batch["attention_mask"]
            self.rows += [row[: int(m.sum())] for row, m in zip(ids, mask)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]


def pad(rows: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r) for r in rows], batch_first=True)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def train(cls: Any, shape: Dict[str, int], rows: Rows, steps: int, **options: Any) -> Tuple[float, List[torch.Tensor]]:
    model = make_model(shape)
    with tempfile.TemporaryDirectory() as output:
        args = TrainingArguments(
            output_dir=output, per_device_train_batch_size=32, max_steps=steps, learning_rate=0.1, optim="sgd",
            max_grad_norm=0.0, report_to="none", use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
            logging_strategy="no", train_sampling_strategy="sequential", dataloader_drop_last=True,
        )  # fmt: skip
        trainer = cls(model=model, args=args, train_dataset=rows, data_collator=pad, **options)
        started = time.process_time()
        trainer.train()
        seconds = time.process_time() - started
    return seconds, [p.detach().clone() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="training steps (loader batches of 32 rows)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny model and 4 steps")
    options = parser.parse_args()
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    workload = workloads(options.quick)[0]
    shape = QUICK_MODEL if options.quick else MODEL
    steps = 4 if options.quick else options.steps
    rows = Rows(logical_batches(workload, shape["vocab_size"])[:steps])
    toma_options = dict(toma_pack_tokens=True, toma_initial_micro_batch=ROWS)  # the budget: the first batch whole
    plain_times, toma_times = [], []
    for turn in range(options.rounds):
        runs = [("plain", Trainer, {}), ("toma", TomaTrainer, toma_options)]
        for name, cls, extra in runs if turn % 2 == 0 else reversed(runs):
            seconds, params = train(cls, shape, rows, steps, **extra)
            (plain_times if name == "plain" else toma_times).append(seconds)
            if name == "plain":
                plain_params = params
            else:
                toma_params = params
    scale = max(float(p.abs().max()) for p in plain_params)
    difference = max(float((a - b).abs().max()) for a, b in zip(plain_params, toma_params)) / scale
    plain, packed = statistics.median(plain_times), statistics.median(toma_times)
    areas = [ROWS * max(len(r) for r in rows.rows[i : i + ROWS]) for i in range(0, len(rows), ROWS)]
    padding = 1 - sum(len(r) for r in rows.rows) / sum(areas)
    print(f"workload {workload.name}: {steps} steps of 32 rows, {padding:.0%} padding")
    print("| Trainer | train() (median of rounds) | per round | / plain |")
    print("|---|---|---|---|")
    print(f"| plain | {plain:.2f} s | {', '.join(f'{t:.2f}' for t in plain_times)} | 1.00x |")
    print(f"| TomaTrainer(toma_pack_tokens=True) | {packed:.2f} s | {', '.join(f'{t:.2f}' for t in toma_times)} | "
          f"**{plain / packed:.2f}x** faster |")  # fmt: skip
    print(f"largest parameter difference at the end, relative to the largest parameter: {difference:.1e}")


if __name__ == "__main__":
    main()
