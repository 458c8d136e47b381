"""Stepping, zeroing or clipping inside an accumulated function is caught, with advice, and undone."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toma import explicit, toma
from toma.misuse import AccumulationMisuse

N = 32


def case():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    inputs, targets = torch.randn(N, 6), torch.randint(0, 3, (N,))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), inputs, targets


def inside(action):
    """A loss function that does `action(model, optimizer)` after its own backward-free forward."""
    model, optimizer, inputs, targets = case()
    start = [p.detach().clone() for p in model.parameters()]

    def compute_loss(inputs, targets):
        action(model, optimizer)
        return F.cross_entropy(model(inputs), targets)

    return model, start, compute_loss, inputs, targets


@pytest.mark.parametrize(
    "action, advice",
    [
        (lambda model, optimizer: optimizer.zero_grad(), "zero_grad"),
        (lambda model, optimizer: optimizer.zero_grad(set_to_none=False), "zero_grad"),
        (lambda model, optimizer: model.zero_grad(), "zero_grad"),
        (lambda model, optimizer: nn.utils.clip_grad_norm_(model.parameters(), 1e-3), "clip"),
    ],
    ids=["optimizer.zero_grad", "zero_grad(set_to_none=False)", "model.zero_grad", "clip_grad_norm_"],
)
def test_changing_gradients_inside_is_an_error_and_the_gradients_are_restored(action, advice):
    model, _, compute_loss, inputs, targets = inside(action)
    with pytest.raises(AccumulationMisuse, match=advice):
        toma.accumulate(model=model, initial_micro_batch=8)(compute_loss)(inputs, targets)
    assert all(p.grad is None for p in model.parameters())


def test_stepping_inside_is_an_error_that_says_where_the_step_goes():
    def step(model, optimizer):
        if any(p.grad is not None for p in model.parameters()):
            optimizer.step()

    model, _, compute_loss, inputs, targets = inside(step)
    with pytest.raises(AccumulationMisuse, match=r"optimizer.step\(\).*after the accumulated call") as info:
        explicit.accumulate(compute_loss, model, 8, inputs, targets)
    assert "0.weight" in str(info.value)
    assert all(p.grad is None for p in model.parameters())


def test_a_model_used_the_intended_way_is_not_flagged():
    model, optimizer, inputs, targets = case()
    compute_loss = toma.accumulate(model=model, initial_micro_batch=8)(
        lambda inputs, targets: F.cross_entropy(model(inputs), targets)
    )
    for _ in range(3):  # gradients accumulated across calls, and across steps
        compute_loss(inputs, targets)
        compute_loss(inputs, targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    frozen = nn.Linear(6, 3)
    frozen.weight.requires_grad_(False)
    toma.accumulate(model=frozen, initial_micro_batch=8)(lambda x, y: F.cross_entropy(frozen(x), y))(inputs, targets)


def test_zero_grad_before_the_first_backward_changes_nothing_and_is_allowed():
    """Zeroing inside the first micro-batch, before any gradient exists, cannot lose anything."""
    model, optimizer, inputs, targets = case()
    calls = []

    def compute_loss(inputs, targets):
        if not calls:
            optimizer.zero_grad()
        calls.append(len(inputs))
        return F.cross_entropy(model(inputs), targets)

    toma.accumulate(model=model, initial_micro_batch=8)(compute_loss)(inputs, targets)
    assert calls == [8] * 4
