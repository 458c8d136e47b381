"""toma.accumulate against the hand-written accumulation loop it replaces, one training step each.

Run: python -m pytest benchmarks/test_accumulation_step.py --benchmark-only
Both do the same work: zero_grad, the logical batch in micro-batches (forward, loss weighted by its share
of the logical batch, backward), the loss of the logical batch, one optimizer step. The micro-batch size
fits, so toma never retries: the ratio is what toma's bookkeeping costs. The tiny-model group measures
that cost alone, with next to no work around it.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toma import toma

MLP = "training step: logical batch 1024 in micro-batches of 128"
TINY = "training step of a 4 -> 1 linear model, 64 rows in micro-batches of 8: toma's own cost"


def mlp_setup():
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    return model, F.cross_entropy, torch.randn(1024, 64), torch.randint(0, 10, (1024,)), 128


def tiny_setup():
    return nn.Linear(4, 1), F.mse_loss, torch.randn(64, 4), torch.randn(64, 1), 8


@pytest.fixture(scope="module", params=[mlp_setup, tiny_setup], ids=["mlp", "tiny"])
def setup(request):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, loss_fn, inputs, targets, micro = request.param()
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), loss_fn, inputs, targets, micro


def native_step(model, optimizer, loss_fn, inputs, targets, micro):
    """The loop people write by hand."""
    optimizer.zero_grad()
    total = 0.0
    for start in range(0, len(inputs), micro):
        x, y = inputs[start : start + micro], targets[start : start + micro]
        loss = loss_fn(model(x), y) * (len(x) / len(inputs))
        loss.backward()
        total = total + loss.detach()
    optimizer.step()
    return total


def group(benchmark, setup):
    benchmark.group = MLP if isinstance(setup[0], nn.Sequential) else TINY


def test_native_accumulation_loop(benchmark, setup):
    group(benchmark, setup)
    benchmark(native_step, *setup)


def test_toma_accumulate(benchmark, setup):
    group(benchmark, setup)
    model, optimizer, loss_fn, inputs, targets, micro = setup

    @toma.accumulate(model=model, initial_micro_batch=micro)
    def compute_loss(x, y):
        return loss_fn(model(x), y)

    def step():
        optimizer.zero_grad()
        loss = compute_loss(inputs, targets)
        optimizer.step()
        return loss

    benchmark(step)
