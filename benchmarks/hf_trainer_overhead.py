"""TomaTrainer's step against the plain Hugging Face Trainer's, when nothing runs out of memory (target <= 1.03x).

Run: python benchmarks/hf_trainer_overhead.py [--rounds 7] [--steps 20] [--clock cpu|wall]

Both trainers hold the same small GPT-2 (from a config) and take the same padded batch of 16 rows: a step is
`training_step` (forward, loss, backward through the accelerator) and the optimizer step, the part of the
Trainer's loop that TomaTrainer changes. Each round interleaves the two step by step (plain, toma, plain, ...) so
that the machine's drift falls on both; a round's figure is each trainer's median step, and the ratio the median
of the rounds' ratios. A second workload, a model too small to do any work, shows toma's own cost per step in microseconds.
`test_hf_trainer_overhead.py` runs the same steps under pytest-benchmark (once each in CI).
"""

import argparse
import statistics
import tempfile
import time
from typing import Any, Dict, List, Tuple

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers import logging as hf_logging

from toma.integrations.transformers import TomaTrainer

WORKLOADS = {
    "GPT-2 (2 layers, width 64), 16 rows of up to 64 tokens": dict(n_embd=64, n_layer=2, n_head=4, length=64),
    "GPT-2 (1 layer, width 8), 16 rows of up to 8 tokens: toma's own cost": dict(
        n_embd=8, n_layer=1, n_head=1, length=8
    ),
}


def batch(length: int, rows: int = 16, vocab: int = 512) -> Dict[str, torch.Tensor]:
    """A causal LM's batch, padded: rows from a quarter of `length` tokens to all of them."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (rows, length), generator=generator)
    lengths = torch.linspace(length // 4, length, rows).long().unsqueeze(1)
    labels = ids.masked_fill(torch.arange(length) >= lengths, -100)
    return {"input_ids": ids, "attention_mask": (labels != -100).long(), "labels": labels}


def make_trainer(cls: type, n_embd: int, n_layer: int, n_head: int, length: int, output_dir: str) -> Any:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=512,
        n_positions=max(length, 8),
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=0,
        eos_token_id=0,
    )
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=16,
        learning_rate=1e-4,
        optim="sgd",
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    # The cost of the retry machinery on a step that fits, rows as the plain Trainer has them: packing by tokens
    # (TomaTrainer's default) changes the work itself, and benchmarks/hf_varlen.py measures that.
    options = {"toma_pack_tokens": False} if cls is not Trainer else {}
    trainer = cls(model=GPT2LMHeadModel(config), args=args, **options)
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # as the Trainer's loop sets it
    return trainer


def prepared(trainer: Any, inputs: Dict[str, torch.Tensor]) -> Tuple[Any, Any]:
    """The batch and its num_items_in_batch as the Trainer's loop hands them to training_step."""
    return inputs, trainer._get_num_items_in_batch([inputs], trainer.args.device)


def step(trainer: Any, inputs: Dict[str, torch.Tensor], num_items: Any) -> torch.Tensor:
    """One optimizer step of one batch, as the Trainer's loop runs it (without logging and callbacks)."""
    loss = trainer.training_step(trainer.model, inputs, num_items)
    trainer.optimizer.step()
    trainer.model.zero_grad()
    return loss


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
clock = time.process_time  # CPU time: on a shared machine the other processes' load stays out of it


def timed(trainer: Any, inputs: Any, num_items: Any) -> float:
    start = clock()
    step(trainer, inputs, num_items)
    return clock() - start


def interleaved(trainers: List[Any], data: List[Tuple[Any, Any]], steps: int) -> List[float]:
    """Each trainer's median step over `steps` steps, taken in turns."""
    times: List[List[float]] = [[] for _ in trainers]
    for _ in range(steps):
        for times_of, trainer, (inputs, num_items) in zip(times, trainers, data):
            times_of.append(timed(trainer, inputs, num_items))
    return [statistics.median(t) for t in times]


def measure(rounds: int, steps: int) -> List[Dict[str, Any]]:
    results = []
    with tempfile.TemporaryDirectory() as output_dir:
        for name, shape in WORKLOADS.items():
            length = shape["length"]
            plain, toma = (make_trainer(cls, output_dir=output_dir, **shape) for cls in (Trainer, TomaTrainer))
            data = [prepared(trainer, batch(length)) for trainer in (plain, toma)]
            interleaved([plain, toma], data, 3)  # warm up: the allocator, FitToMemory's first measurements
            plain_times, toma_times = [], []
            for _ in range(rounds):
                plain_time, toma_time = interleaved([plain, toma], data, steps)
                plain_times.append(plain_time)
                toma_times.append(toma_time)
            ratios = [t / p for t, p in zip(toma_times, plain_times)]
            results.append(
                dict(
                    workload=name,
                    plain_ms=statistics.median(plain_times) * 1e3,
                    toma_ms=statistics.median(toma_times) * 1e3,
                    ratio=statistics.median(ratios),
                    ratios=ratios,
                    micro_batch=toma.toma_stats.micro_batch,
                )
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="steps per round and trainer")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="the process's CPU time, or wall time")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    print("| workload | plain Trainer step | TomaTrainer step | ratio (median of rounds) | ratio per round |")
    print("|---|---|---|---|---|")
    for result in measure(args.rounds, args.steps):
        per_round = ", ".join(f"{r:.3f}" for r in result["ratios"])
        difference = (result["toma_ms"] - result["plain_ms"]) * 1e3
        print(
            f"| {result['workload']} | {result['plain_ms']:.2f} ms | {result['toma_ms']:.2f} ms "
            f"({difference:+.0f} µs) | {result['ratio']:.3f} | {per_round} |"
        )
        assert result["micro_batch"] == 16, "the batch must pass whole: this measures the step without OOMs"


if __name__ == "__main__":
    main()
