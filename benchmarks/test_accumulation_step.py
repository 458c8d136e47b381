"""toma.accumulate against the hand-written accumulation loop it replaces, one training step each.

Run: python -m pytest benchmarks/test_accumulation_step.py --benchmark-only
Both do the same work: zero_grad, 8 micro-batches of 128 rows (forward, loss weighted by its share of the
logical batch, backward), the loss of the logical batch, one optimizer step. The micro-batch size fits,
so toma never retries: the ratio is what toma's bookkeeping costs.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toma import toma

LOGICAL, MICRO = 1024, 128
GROUP = f"training step: logical batch {LOGICAL} in micro-batches of {MICRO}"


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs, targets = torch.randn(LOGICAL, 64), torch.randint(0, 10, (LOGICAL,))
    return model, optimizer, inputs, targets


def native_step(model, optimizer, inputs, targets):
    """The loop people write by hand."""
    optimizer.zero_grad()
    total = 0.0
    for start in range(0, len(inputs), MICRO):
        x, y = inputs[start : start + MICRO], targets[start : start + MICRO]
        loss = F.cross_entropy(model(x), y) * (len(x) / len(inputs))
        loss.backward()
        total = total + loss.detach()
    optimizer.step()
    return total


@pytest.mark.benchmark(group=GROUP)
def test_native_accumulation_loop(benchmark, setup):
    benchmark(native_step, *setup)


@pytest.mark.benchmark(group=GROUP)
def test_toma_accumulate(benchmark, setup):
    model, optimizer, inputs, targets = setup

    @toma.accumulate(model=model, initial_micro_batch=MICRO)
    def compute_loss(x, y):
        return F.cross_entropy(model(x), y)

    def step():
        optimizer.zero_grad()
        loss = compute_loss(inputs, targets)
        optimizer.step()
        return loss

    benchmark(step)


# The same loops around a model so small that the work is next to nothing: what toma itself costs.
TINY_GROUP = "training step of a 4 -> 1 linear model, 64 rows in micro-batches of 8: toma's own cost"


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), torch.randn(64, 4), torch.randn(64, 1)


def tiny_native_step(model, optimizer, inputs, targets):
    optimizer.zero_grad()
    total = 0.0
    for start in range(0, len(inputs), 8):
        x, y = inputs[start : start + 8], targets[start : start + 8]
        loss = F.mse_loss(model(x), y) * (len(x) / len(inputs))
        loss.backward()
        total = total + loss.detach()
    optimizer.step()
    return total


@pytest.mark.benchmark(group=TINY_GROUP)
def test_native_accumulation_loop_tiny_model(benchmark, tiny):
    benchmark(tiny_native_step, *tiny)


@pytest.mark.benchmark(group=TINY_GROUP)
def test_toma_accumulate_tiny_model(benchmark, tiny):
    model, optimizer, inputs, targets = tiny
    compute_loss = toma.accumulate(model=model, initial_micro_batch=8)(lambda x, y: F.mse_loss(model(x), y))

    def step():
        optimizer.zero_grad()
        loss = compute_loss(inputs, targets)
        optimizer.step()
        return loss

    benchmark(step)
