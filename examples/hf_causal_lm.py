"""Fine-tune a small GPT-2 with the Hugging Face Trainer under a memory cap: the batch size you set is the batch you
get.

The model is built from a config (no download) and learns sums written out in words ("17 plus 25 is 42 ."), a
few per row, rows of different lengths padded per batch. On a machine without a GPU the script caps its own
memory (the address space it holds plus HEADROOM_MIB) so that a batch of 64 rows cannot pass in one piece:

- the plain Trainer runs out of memory in its first step;
- `TomaTrainer` (one import changed) trains every batch of 64 rows in micro-batches it finds, for real, through
  the allocator's out-of-memory errors, with the plain Trainer's gradients: same steps, same schedule;
- the plain Trainer with `auto_find_batch_size=True` shrinks the batch and starts training over until it fits: a
  smaller batch, more optimizer steps, another run.

It prints the micro-batch size found (a token budget: TomaTrainer packs rows by length), the loss, and the same figures for auto_find_batch_size. On CUDA it
trains on the GPU, uncapped unless `--memory-fraction` caps the memory PyTorch may take.

    pip install 'toma[transformers]'
    python examples/hf_causal_lm.py
"""

import argparse
import gc
import logging
import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainingArguments
from transformers import logging as hf_logging

from toma.integrations.transformers import TomaTrainer
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom

HEADROOM_MIB = 24
BATCH = 64
ROWS = 1536  # 24 optimizer steps of 64 rows

WORDS = [str(n) for n in range(99)] + ["plus", "is", "."]
PAD = len(WORDS)
VOCAB = len(WORDS) + 1


def sums(rows: int, generator: torch.Generator) -> list:
    """Rows of 2 to 4 sentences "a plus b is c .", as token ids."""
    ids = {word: index for index, word in enumerate(WORDS)}
    data = []
    for count in torch.randint(2, 5, (rows,), generator=generator).tolist():
        words = []
        for a, b in torch.randint(0, 50, (count, 2), generator=generator).tolist():
            words += [str(a), "plus", str(b), "is", str(a + b), "."]
        data.append(torch.tensor([ids[word] for word in words]))
    return data


def pad(rows: list) -> dict:
    """The collate function: each batch padded to its longest row; padding is no target (-100)."""
    input_ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=PAD)
    labels = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-100)
    return {"input_ids": input_ids, "attention_mask": (labels != -100).long(), "labels": labels}


def small_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=256, n_layer=2, n_head=4, bos_token_id=PAD, eos_token_id=PAD
    )
    return GPT2LMHeadModel(config)


def run(trainer_class: type, output_dir: str, data: list, cuda: bool, **settings) -> dict:
    """Train one epoch; what happened: the error, or the steps, the batch and the losses."""
    settings = {"per_device_train_batch_size": BATCH, "num_train_epochs": 1, **settings}
    args = TrainingArguments(
        output_dir=output_dir,
        learning_rate=3e-3,
        warmup_steps=2,
        report_to="none",
        use_cpu=not cuda,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        **settings,
    )
    options = {"toma_log_micro_batch": True} if issubclass(trainer_class, TomaTrainer) else {}
    trainer = trainer_class(model=small_gpt2(), args=args, train_dataset=data, data_collator=pad, **options)
    trainer.remove_callback(PrinterCallback)
    batch_sizes = []  # each (re)start of the training loop, with its batch size
    inner = trainer._inner_training_loop

    def counted(*args, **kwargs):  # auto_find_batch_size passes the batch size first
        batch_sizes.append(args[0] if args else kwargs.get("batch_size", BATCH))
        return inner(*args, **kwargs)

    trainer._inner_training_loop = counted
    try:
        trainer.train()
    except RuntimeError as error:
        return {"error": str(error).strip().splitlines()[0]}
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    micro = [entry.get("micro_batch") for entry in trainer.state.log_history if "loss" in entry]
    result = {"steps": trainer.state.global_step, "batch": trainer._train_batch_size, "starts": batch_sizes}
    result.update(first_loss=losses[0], last_loss=losses[-1], micro=micro)
    if isinstance(trainer, TomaTrainer):
        result.update(micro_batch=trainer.toma_stats.micro_batch, retries=trainer.toma_stats.oom_retries)
        result.update(unit="padded tokens" if trainer.toma_pack_tokens else "rows")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", help="the Trainer's output directory (a temporary one by default)")
    parser.add_argument("--rows", type=int, default=ROWS, help=f"rows of training data (default {ROWS})")
    parser.add_argument(
        "--memory-fraction", type=float, help="CUDA only: the share of the GPU's memory PyTorch may take"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    logging.getLogger("toma").setLevel(logging.INFO)  # each out-of-memory error and the size that follows
    hf_logging.set_verbosity_error()
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="hf_causal_lm-")

    cuda = torch.cuda.is_available()
    if args.memory_fraction is not None:
        if not cuda:
            parser.error("--memory-fraction caps GPU memory and needs CUDA")
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
    if not cuda:
        torch.set_num_threads(1)  # thread stacks count against the cap too
        predictable_heap()
    if args.rows < BATCH:
        parser.error(f"--rows must be at least one batch ({BATCH}), got {args.rows}")
    data = sums(args.rows, torch.Generator().manual_seed(0))
    if not cuda:
        # One small plain step first, uncapped: what the Trainer loads and keeps on its first step (modules, thread
        # pools, the allocator's arenas) is not what a batch of 64 rows needs, and must not count against the cap.
        run(Trainer, output_dir, data[:4], cuda, max_steps=1, per_device_train_batch_size=4)
        gc.collect()
        set_cpu_memory_headroom(HEADROOM_MIB / 1024)
        print(f"capped this process at {HEADROOM_MIB} MiB more than it uses; batches of {BATCH} rows")

    plain = run(Trainer, output_dir, data, cuda)
    print(f"plain Trainer: {plain.get('error', 'trained without running out of memory')}")
    gc.collect()

    toma = run(TomaTrainer, output_dir, data, cuda)
    print("TomaTrainer:")
    print(f"micro-batch size found: {toma['micro_batch']} {toma['unit']}")
    print(f"out-of-memory retries: {toma['retries']}")
    print(f"micro-batch size per logged step: {toma['micro']}")
    print(
        f"optimizer steps: {toma['steps']} of {toma['batch']} rows; "
        f"loss {toma['first_loss']:.3f} -> {toma['last_loss']:.3f}"
    )
    gc.collect()

    auto = run(Trainer, output_dir, data, cuda, auto_find_batch_size=True)
    print("plain Trainer, auto_find_batch_size=True:")
    if "error" in auto:
        print(f"failed: {auto['error']}")
        return
    print(f"batch sizes tried: {' -> '.join(map(str, auto['starts']))} ({len(auto['starts']) - 1} restarts)")
    print(
        f"optimizer steps: {auto['steps']} of {auto['batch']} rows; "
        f"loss {auto['first_loss']:.3f} -> {auto['last_loss']:.3f}"
    )


if __name__ == "__main__":
    main()
