"""toma.Trainer in micro-batches against one full-batch SGD step on the same model: each micro-batch weighted by what
the loss is normalised by, a term added once per batch (an L2 penalty, an auxiliary loss) counted once, and a
batch with nothing to average over an error instead of a step that trains nothing."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toma import Trainer

from helpers import raise_fake_oom, run_ranks

ROWS, FEATURES, CLASSES, LR = 12, 5, 3, 0.5
CLASS_WEIGHTS = torch.tensor([1.0, 3.0, 0.5])


def make_model(log_softmax=False):
    torch.manual_seed(0)
    layers = [nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES)]
    return nn.Sequential(*layers, *([nn.LogSoftmax(dim=1)] if log_softmax else []))


def data(ignored=(1, 2, 5, 6, 7)):
    """Rows 4 to 7 hold a micro-batch of 4 with one target counted, rows 1 and 2 a micro-batch of 1 with none."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(ROWS, FEATURES, generator=generator)
    targets = torch.randint(0, CLASSES, (ROWS,), generator=generator)
    targets[list(ignored)] = -100
    return inputs, targets


def full_batch_step(model, loss_of, inputs, targets):
    """The reference: one SGD step (no momentum, no clipping) on the whole batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss = loss_of(model, inputs, targets)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


class SmallDevice(nn.Module):
    """`model` on a device that holds `fits` rows at a time: a larger forward pass runs out of memory."""

    def __init__(self, model, fits=4):
        super().__init__()
        self.model, self.fits = model, fits

    def forward(self, inputs):
        if len(inputs) > self.fits:
            raise_fake_oom()
        return self.model(inputs)


def sgd_trainer(model, loss_fn, batch, **options):
    """A Trainer with SGD (no momentum, no clipping) over `batch` as one logical batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return Trainer(model, optimizer, loss_fn, [batch], batch_size=ROWS, verbose=0, **options)


def train_one_step(model, loss_fn, batch, **options):
    """The Trainer's step over `batch`, on a device that holds 4 rows at a time."""
    trainer = sgd_trainer(SmallDevice(model), loss_fn, batch, **options)
    trainer.fit(1)
    assert trainer.micro_batch is not None and trainer.micro_batch <= 4, "the batch ran in micro-batches"
    return trainer


def assert_same_parameters(model, reference):
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# --- (1) what a micro-batch is weighted by is what the loss is normalised by ----------------------------------

CRITERIA = {
    "ignore_index": (lambda: nn.CrossEntropyLoss(), False),
    "class weights": (lambda: nn.CrossEntropyLoss(weight=CLASS_WEIGHTS), False),
    "class weights, label smoothing": (lambda: nn.CrossEntropyLoss(weight=CLASS_WEIGHTS, label_smoothing=0.1), False),
    "NLLLoss": (lambda: nn.NLLLoss(weight=CLASS_WEIGHTS), True),
}


@pytest.mark.parametrize("criterion", list(CRITERIA))
def test_a_cross_entropy_criterion_weighs_micro_batches_by_the_targets_its_mean_divides_by(criterion):
    """CrossEntropyLoss's mean is over the targets it does not ignore, each counted by its class weight; weighted
    by rows instead, micro-batches gave other gradients (3e-2 off here), a NaN step loss for a micro-batch with
    no target, and an evaluation loss averaged over rows."""
    make, log_softmax = CRITERIA[criterion]
    inputs, targets = data()
    reference = make_model(log_softmax)
    expected = full_batch_step(reference, lambda m, x, y: make()(m(x), y), inputs, targets)
    model = make_model(log_softmax)
    trainer = train_one_step(model, make(), (inputs, targets))
    assert_same_parameters(model, reference)
    assert trainer.history.steps[0]["loss"] == pytest.approx(expected, rel=1e-5)
    assert trainer.history.epochs[0]["loss"] == pytest.approx(expected, rel=1e-5)
    halves = [(inputs[:6], targets[:6]), (inputs[6:], targets[6:])]
    with torch.no_grad():
        assert trainer.evaluate(halves)["loss"] == pytest.approx(float(make()(model(inputs), targets)), rel=1e-5)


@pytest.mark.parametrize("own", ["sum", "none"])
def test_a_criterion_that_reduces_otherwise_than_the_trainer_is_refused_naming_reduction(own):
    """A summed loss weighted as a mean (micro-batch rows over the batch's) gives neither gradient."""
    model = make_model()
    with pytest.raises(ValueError if own == "sum" else TypeError, match="reduction"):
        sgd_trainer(model, nn.CrossEntropyLoss(reduction=own), data())
    if own == "sum":  # said so, it trains as the plain sum
        inputs, targets = data()
        reference = make_model()
        full_batch_step(reference, lambda m, x, y: F.cross_entropy(m(x), y, reduction="sum"), inputs, targets)
        train_one_step(model, nn.CrossEntropyLoss(reduction="sum"), (inputs, targets), reduction="sum")
        assert_same_parameters(model, reference)


def test_kl_divergence_with_batchmean_is_a_mean_over_rows_and_trains_as_the_full_batch():
    """`nn.KLDivLoss(reduction="batchmean")`, PyTorch's advice for it, divides the sum by the rows: a mean."""
    inputs, targets = data(ignored=())
    reference, model = make_model(), make_model()

    def kl(m, x, y):
        return F.kl_div(F.log_softmax(m(x), -1), F.one_hot(y, 3).float() * 0.9 + 0.1 / 3, reduction="batchmean")

    full_batch_step(reference, kl, inputs, targets)
    criterion = nn.KLDivLoss(reduction="batchmean")
    train_one_step(
        model,
        lambda out, y: criterion(F.log_softmax(out, -1), F.one_hot(y, 3).float() * 0.9 + 0.1 / 3),
        (inputs, targets),
    )
    assert_same_parameters(model, reference)
    sgd_trainer(make_model(), criterion, data())  # accepted as it is
    with pytest.raises(ValueError, match="reduction='mean'"):
        sgd_trainer(make_model(), criterion, data(), reduction="sum")


# --- (2) a term added once per batch is counted once -----------------------------------------------------------


def l2(model):
    return 0.05 * sum(p.pow(2).sum() for p in model.parameters())


def test_an_l2_penalty_in_the_loss_is_counted_once_per_batch_not_once_per_micro_batch():
    """Each micro-loss is weighted by its share of the batch and the shares add up to 1, so the penalty (the same
    in every micro-batch) adds up to itself, also where a micro-batch counts nothing and is skipped."""
    inputs, targets = data()
    reference = make_model()

    def loss_of(model, inputs, targets):
        return F.cross_entropy(model(inputs), targets) + l2(model)

    expected = full_batch_step(reference, loss_of, inputs, targets)
    model = make_model()
    trainer = train_one_step(
        model,
        lambda outputs, targets: F.cross_entropy(outputs, targets) + l2(model),
        (inputs, targets),
        weight=lambda inputs, targets: (targets != -100).sum(),
    )
    assert_same_parameters(model, reference)
    assert trainer.history.steps[0]["loss"] == pytest.approx(expected, rel=1e-5)


def test_an_auxiliary_loss_averaged_over_the_rows_with_forward_is_counted_once():
    """forward= returning the loss with an auxiliary term (a mean over the batch's rows, as the main loss): the
    micro-batches' shares give the batch's value, not k auxiliary terms."""
    inputs, targets = data(ignored=())

    def loss_with_aux(model, inputs, targets):
        hidden = model[:2](inputs)
        logits = model[2:](hidden)
        return F.cross_entropy(logits, targets) + 0.5 * hidden.pow(2).mean() + l2(model)

    reference = make_model()
    expected = full_batch_step(reference, loss_with_aux, inputs, targets)
    model = make_model()

    def forward(batch):
        if len(batch[0]) > 4:  # a device that holds 4 rows at a time
            raise_fake_oom()
        return {"loss": loss_with_aux(model, *batch)}

    trainer = sgd_trainer(model, None, (inputs, targets), forward=forward)
    trainer.fit(1)
    assert trainer.micro_batch <= 4
    assert_same_parameters(model, reference)
    assert trainer.history.steps[0]["loss"] == pytest.approx(expected, rel=1e-5)


def test_with_reduction_sum_a_per_batch_term_is_added_once_scaled_by_its_rows_or_found_and_cached():
    """A summed loss's micro-losses add up unweighted, so a term added once per call would be added once per
    micro-batch (3 here). Scaled by the micro-batch's rows over the batch's it adds up and trains in micro-batches;
    unscaled, the split check finds that the halves do not add up to the whole and gradient caching trains the
    full batch's loss, the term once."""
    inputs, targets = data(ignored=())

    def summed(model, inputs, targets, penalties=1.0):
        return F.cross_entropy(model(inputs), targets, reduction="sum") + penalties * l2(model)

    for scaled in (False, True):
        reference = make_model()
        full_batch_step(reference, lambda m, x, y: summed(m, x, y, 1.0), inputs, targets)
        model = make_model()

        def loss_fn(outputs, targets):
            share = len(targets) / ROWS if scaled else 1.0
            return F.cross_entropy(outputs, targets, reduction="sum") + share * l2(model)

        trainer = sgd_trainer(model, loss_fn, (inputs, targets), initial_micro_batch=4, reduction="sum")
        trainer.fit(1)
        assert trainer.micro_batch == 4 and trainer.stats.split_check.coupled != scaled
        assert_same_parameters(model, reference)


# --- (3) a batch with nothing to average over -------------------------------------------------------------------


@pytest.mark.parametrize("case", ["every target ignored", "a weight that counts the wrong thing"])
def test_an_epoch_whose_batches_count_nothing_is_an_error_and_nothing_steps(case):
    """In one full-batch pass the mean over nothing is NaN; each such batch is a step that changes nothing, and an
    epoch of nothing else is an error: a weight= that counts nothing where the loss has items would never train."""
    inputs, targets = data(ignored=range(ROWS) if case == "every target ignored" else ())
    options = {} if case == "every target ignored" else {"weight": lambda inputs, targets: (targets == -100).sum()}
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(
        model, optimizer, nn.CrossEntropyLoss(), [(inputs, targets)], batch_size=ROWS, verbose=0, **options
    )
    with pytest.raises(ValueError, match="counted 0 items in the logical batch of 12 rows"):
        trainer.fit(1)  # the epoch's one batch had nothing to learn from: an error at its end
    assert not optimizer.state
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)


# --- several ranks: each rank's batch is part of one mean over all of them ---------------------------------------

TWO_RANKS = """
import datetime, json, os
import torch, torch.distributed as dist, torch.nn as nn
from toma import Trainer
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
generator = torch.Generator().manual_seed(0)
inputs = torch.randn(2, 12, 5, generator=generator)
targets = torch.randint(0, 3, (2, 12), generator=generator)
targets[1] = -100  # rank 1's batch has no target to count; rank 0's has
results = []
for every_rank_empty in (False, True):
    if every_rank_empty:
        targets[0] = -100
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    ddp = nn.parallel.DistributedDataParallel(model)
    trainer = Trainer(ddp, torch.optim.SGD(ddp.parameters(), lr=0.5), nn.CrossEntropyLoss(),
                      [(inputs[rank], targets[rank])], batch_size=12, initial_micro_batch=4, verbose=0,
                      weight=lambda inputs, targets: (targets != -100).sum())
    try:
        trainer.fit(1)
        results.append([p.tolist() for p in model.parameters()])
    except ValueError as error:
        results.append(str(error))
print(json.dumps(results), flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)
"""


@pytest.mark.multiprocess
def test_on_two_ranks_a_rank_that_counts_nothing_steps_with_the_others_and_all_counting_nothing_is_an_error():
    """DDP: the mean is over every rank's targets, so a rank whose batch counts nothing holds the others' gradients
    after the all-reduce and must step as they do (it skipped its step, and its parameters left the others'); when
    no rank counts anything, every rank raises the same error."""
    outputs = run_ranks(TWO_RANKS, 2, timeout=120)
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(2, 12, FEATURES, generator=generator)
    targets = torch.randint(0, CLASSES, (2, 12), generator=generator)
    reference = make_model()
    full_batch_step(reference, lambda m, x, y: F.cross_entropy(m(x), y), inputs[0], targets[0])  # rank 1 adds none
    for trained, refused in results:
        for got, expected in zip(trained, reference.parameters(), strict=True):
            torch.testing.assert_close(torch.tensor(got), expected.detach(), rtol=1e-5, atol=1e-6)
        assert "weight counted 0 items in the logical batch on every one of the 2 ranks" in refused
