"""toma.Trainer with rows that belong together (`groups=`): loader batches are never cut or stacked row by row,
evaluation chunks keep groups whole, and `fit`'s evaluation data is checked before anything trains."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toma import Halving, Trainer

from helpers import raise_fake_oom


def policy_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def dpo(model, batch):
    """A DPO-like loss over a batch laid out as DPO's: its chosen rows first, then their rejected rows."""
    scores = model(batch).squeeze(-1)
    chosen, rejected = scores.chunk(2)
    return -F.logsigmoid(chosen - rejected).mean()


def preference_batches(count=4, pairs=4):
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(2 * pairs, 6, generator=generator) for _ in range(count)]


def test_loader_batches_of_pairs_are_joined_as_pieces_keeping_each_chosen_row_with_its_rejected_row():
    """Two loader batches of 4 pairs make a logical batch of 16 rows: joined row by row, chosen rows would be paired
    with the other batch's chosen rows. Each step equals the mean of its loader batches' DPO losses, also when the
    micro-batch holds one pair (out of memory above 2 rows)."""
    batches = preference_batches()
    model = policy_model()

    def loss(batch):
        if torch.is_grad_enabled() and len(batch) > 2:
            raise_fake_oom()
        return dpo(model, batch)

    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.5), None, batches, batch_size=16, verbose=0,
        forward=loss, groups="pairs", policy=Halving(),
    )  # fmt: skip
    trainer.fit(1)
    assert [s["rows"] for s in trainer.history.steps] == [16, 16] and trainer.micro_batch == 2

    reference = policy_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for logical in (batches[0:2], batches[2:4]):
        optimizer.zero_grad()
        (sum(dpo(reference, b) for b in logical) / len(logical)).backward()
        optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_a_loader_batch_larger_than_the_logical_batch_is_cut_by_pairs_or_refused():
    """Under "pairs" a loader batch of 8 pairs with batch_size=8 trains as two logical batches of 4 whole pairs
    (each chosen row with its own rejected row); under "batch" (in-batch negatives) it is refused, not cut."""
    batches = preference_batches(count=1, pairs=8)
    model = policy_model()
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.5), None, batches, batch_size=8, verbose=0,
        forward=lambda b: dpo(model, b), groups="pairs",
    )  # fmt: skip
    assert trainer._total_steps() == 2
    trainer.fit(1)
    reference = policy_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    chosen, rejected = batches[0].chunk(2)
    for part in (slice(0, 4), slice(4, 8)):
        optimizer.zero_grad()
        dpo(reference, torch.cat([chosen[part], rejected[part]])).backward()
        optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)

    model = policy_model()
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.5), None, batches, batch_size=8, verbose=0,
        forward=lambda b: dpo(model, b), groups="batch",
    )  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="16 rows, more than batch_size=8, and groups='batch'"):
        trainer.fit(1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_the_progress_total_counts_logical_batches_of_whole_loader_batches():
    model = policy_model()
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.5), None, preference_batches(count=5, pairs=3),
        batch_size=16, verbose=0, forward=lambda b: dpo(model, b), groups="pairs",
    )  # fmt: skip
    assert trainer._total_steps() == 3  # 6 + 6 rows, 6 + 6, 6
    trainer.fit(1)
    assert len(trainer.history.steps) == 3


@pytest.mark.parametrize("groups", ["pairs", "batch"])
def test_evaluation_chunks_keep_rows_that_belong_together(groups):
    """After an out-of-memory error evaluation is chunked by groups: pairs whole, an in-batch grouping never (its
    error is raised)."""
    batch = preference_batches(count=1, pairs=8)[0]
    model = policy_model()

    def loss(b):
        if len(b) > 8:
            raise_fake_oom()
        return dpo(model, b)

    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.5), None, [batch], batch_size=16, verbose=0,
        forward=loss, groups=groups, policy=Halving(),
    )  # fmt: skip
    if groups == "batch":
        with pytest.raises(torch.OutOfMemoryError):
            trainer.evaluate([batch])
        return
    with torch.no_grad():
        expected = dpo(model, batch).item()
    assert trainer.evaluate([batch])["loss"] == pytest.approx(expected, rel=1e-6)


def test_fit_checks_its_evaluation_data_before_training():
    model = policy_model()
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.5), None, preference_batches(), batch_size=8, verbose=0,
        forward=lambda b: dpo(model, b),
    )  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="eval_data is empty"):
        trainer.fit(1, eval_data=[])
    with pytest.raises(TypeError, match="eval_data is an iterator that can be read only once"):
        trainer.fit(2, eval_data=iter(preference_batches()))
    with pytest.raises(TypeError, match="eval_data must be an iterable"):
        trainer.fit(1, eval_data=3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert trainer.history.epochs == [] and trainer.current_epoch == 0
    trainer.fit(1, eval_data=iter(preference_batches()))  # one epoch reads an iterator once: fine
    assert "eval_loss" in trainer.history.epochs[-1]
