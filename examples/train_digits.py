"""Train a small CNN on scikit-learn's handwritten digits with logical batches that do not fit in memory.

The 8x8 digits are upsampled to 32x32 so that memory matters. On a machine without a GPU the script caps
its own memory (the address space it holds plus HEADROOM_MIB) so that a logical batch of 256 cannot pass
in one piece: toma.Trainer finds a micro-batch size that fits, for real, and trains with exact gradients of
the full logical batch. On CUDA it trains on the GPU, uncapped unless `--memory-fraction` caps the GPU
memory PyTorch may take (`torch.cuda.set_per_process_memory_fraction`): 96 MiB forces real CUDA out-of-memory
errors (not 48: on an H100 or H200 cuBLAS keeps a 32 MiB workspace, and a micro-batch of one row did not fit). It prints the micro-batch size found, the out-of-memory retries and the test accuracy, and writes the
training history as a PNG.

    python examples/train_digits.py            # 15 epochs
    python examples/train_digits.py --quick    # 10 epochs, for CI
    python examples/train_digits.py --memory-fraction 0.0012   # on an 80 GiB GPU: 96 MiB
"""

import argparse
import io
import logging
import sys

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import toma
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
from toma.training.trainer import accuracy

HEADROOM_MIB = 48
LOGICAL_BATCH = 256
SIDE = 32


def digits(generator: torch.Generator):
    """(train, test) TensorDatasets: 1437 and 360 images, 1 x SIDE x SIDE in [0, 1]."""
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(SIDE, SIDE), mode="bilinear", align_corners=False)
    images = (images - images.mean()) / images.std()
    labels = torch.tensor(data.target)
    order = torch.randperm(len(images), generator=generator)
    train, test = order[:1437], order[1437:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (SIDE // 4) ** 2, 10),
    )


class Schedule(toma.Callback):
    """Steps a learning-rate scheduler after every epoch."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def on_epoch_end(self, trainer: toma.Trainer) -> None:
        self.scheduler.step()


def load_plotting() -> None:
    """Draw a throwaway history once before the cap: matplotlib's libraries, fonts and BLAS buffers count as
    address space, and loading them later would eat the headroom meant for training."""
    try:
        toma.TrainingHistory(steps=[dict(step=1, loss=1.0, micro_batch=1)]).plot(io.BytesIO())
    except ImportError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 epochs instead of 15")
    parser.add_argument("--plot", default="train_digits_history.png", help="where to write the history PNG")
    parser.add_argument(
        "--memory-fraction", type=float, help="CUDA only: the share of the GPU's memory PyTorch may take"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)

    cuda = torch.cuda.is_available()
    if args.memory_fraction is not None:
        if not cuda:
            parser.error("--memory-fraction caps GPU memory and needs CUDA")
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
        mib = args.memory_fraction * torch.cuda.get_device_properties(0).total_memory / 2**20
        print(f"capped the GPU at {mib:.0f} MiB; logical batch {LOGICAL_BATCH}")
    if not cuda:
        torch.set_num_threads(1)  # thread stacks count against the cap too
        # oneDNN reports an allocation that fails under an address-space cap as "could not create a
        # primitive"; PyTorch's own convolution raises the allocator's out-of-memory error that toma knows.
        torch.backends.mkldnn.enabled = False
        predictable_heap()
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    train, test = digits(generator)
    model = small_cnn()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    epochs = 10 if args.quick else 15
    trainer = toma.Trainer(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        DataLoader(train, batch_size=LOGICAL_BATCH, shuffle=True, generator=generator),
        batch_size=LOGICAL_BATCH,
        device="cuda" if cuda else "cpu",
        verbose=1,
        callbacks=[Schedule(torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs))],
    )
    if not cuda:
        load_plotting()
        set_cpu_memory_headroom(HEADROOM_MIB / 1024)
        print(f"capped this process at {HEADROOM_MIB} MiB more than it uses; logical batch {LOGICAL_BATCH}")

    history = trainer.fit(epochs, eval_data=DataLoader(test, batch_size=360), metrics=[accuracy])

    print(f"micro-batch size found: {trainer.micro_batch}")
    print(f"out-of-memory retries: {trainer.oom_retries}")
    print(f"test accuracy: {history.epochs[-1]['eval_accuracy']:.4f}")
    try:
        history.plot(args.plot)
        print(f"history written to {args.plot}")
    except ImportError as error:
        print(error)


if __name__ == "__main__":
    main()
