"""Stepping, zeroing or clipping inside an accumulated function is caught, with advice, and undone."""

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toma import explicit, toma
from toma.accumulation.misuse import AccumulationMisuse
from toma.core import engine
from toma.core.oom import release_memory

from helpers import raise_fake_oom

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

    model, start, compute_loss, inputs, targets = inside(step)
    with pytest.raises(AccumulationMisuse, match=r"optimizer.step\(\).*after the accumulated call") as info:
        explicit.accumulate(compute_loss, model, 8, inputs, targets)
    assert "0.weight" in str(info.value)
    assert all(p.grad is None for p in model.parameters())
    for p, before in zip(model.parameters(), start, strict=True):
        assert torch.equal(p, before), "the step is refused before it changes a weight"


def test_an_optimizer_of_other_parameters_or_another_thread_may_step():
    """A second model's optimizer (a GAN's discriminator, an EMA teacher) is not the watched model's."""
    model, optimizer, inputs, targets = case()
    other = nn.Linear(3, 1)
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)

    @toma.accumulate(model=model, initial_micro_batch=8)
    def compute_loss(inputs, targets):
        logits = model(inputs)
        other(logits.detach()).sum().backward()
        other_optimizer.step()
        return F.cross_entropy(logits, targets)

    compute_loss(inputs, targets)
    assert all(p.grad is not None for p in model.parameters())


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
        if not torch.is_grad_enabled():  # toma's one check, without gradients, that the loss adds up
            return F.cross_entropy(model(inputs), targets)
        if not calls:
            optimizer.zero_grad()
        calls.append(len(inputs))
        return F.cross_entropy(model(inputs), targets)

    toma.accumulate(model=model, initial_micro_batch=8)(compute_loss)(inputs, targets)
    assert calls == [8] * 4


def test_modules_that_change_weights_or_gradients_legitimately_are_not_flagged():
    """Embedding(max_norm=...) renormalises its weight in place in every forward pass; reentrant
    checkpointing adds to a gradient several times per backward pass. Neither is misuse."""
    torch.manual_seed(0)
    embedding, head = nn.Embedding(50, 8, max_norm=1.0), nn.Linear(8, 3)
    model = nn.ModuleDict(dict(embedding=embedding, head=head))
    tokens, targets = torch.randint(0, 50, (N,)), torch.randint(0, 3, (N,))

    def body(x):
        return torch.relu(head(x)) + torch.relu(head(x))  # `head` used twice: two additions per backward

    @toma.accumulate(model=model, initial_micro_batch=8)
    def compute_loss(tokens, targets):
        hidden = embedding(tokens * 1)
        out = torch.utils.checkpoint.checkpoint(body, hidden, use_reentrant=True)
        return F.cross_entropy(out, targets)

    compute_loss(tokens, targets)
    assert compute_loss.stats.micro_batch == 8
    assert all(p.grad is not None for p in model.parameters())


def test_a_failed_attempts_gradients_are_gone_when_memory_is_released_for_the_retry(monkeypatch):
    """The watcher must not keep the failed attempt's gradients alive through the release between attempts:
    on a GPU they are the memory the retry needs."""
    model, _, inputs, targets = case()
    made, alive_after_release, sizes = [], [], []

    def release_and_look():
        release_memory()
        alive_after_release.extend(ref() is not None for ref in made)

    monkeypatch.setattr(engine, "release_memory", release_and_look)

    @toma.accumulate(model=model, initial_micro_batch=16)
    def compute_loss(inputs, targets):
        if not torch.is_grad_enabled():  # toma's one check, without gradients, that the loss adds up
            return F.cross_entropy(model(inputs), targets)
        sizes.append(len(inputs))
        if len(sizes) == 2:  # the second micro-batch: the gradients exist, made by this attempt's first one
            made.extend(weakref.ref(p.grad) for p in model.parameters())
            raise_fake_oom()
        return F.cross_entropy(model(inputs), targets)

    compute_loss(inputs, targets)
    assert sizes[:2] == [16, 16] and sizes[2] < 16 and compute_loss.stats.oom_retries == 1
    assert len(made) == 4 and alive_after_release == [False] * 4
