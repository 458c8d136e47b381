"""`Trainer.evaluate` (toma.training.evaluation): the criterion and the metrics run per chunk, inside the retry, so
that whatever runs out of memory is redone smaller and the results are those of the whole data, whatever the
loader's batches, the chunks, or what the model returns."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toma import Callback, Trainer
from toma.training.trainer import accuracy

from helpers import raise_fake_oom

ROWS, FEATURES, CLASSES = 32, 6, 3


@pytest.fixture
def data():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, FEATURES, generator=generator), torch.randint(0, CLASSES, (ROWS,), generator=generator)


def batches(inputs, targets, size):
    return [(inputs[i : i + size], targets[i : i + size]) for i in range(0, len(targets), size)]


def linear():
    torch.manual_seed(0)
    return nn.Linear(FEATURES, CLASSES)


def trainer_for(model, loss_fn, train, **options):
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, train, verbose=0, **options)


def test_a_criterion_out_of_memory_in_evaluation_is_retried_smaller_and_fit_goes_on(data):
    """Only the criterion runs out of memory (above 5 rows): training and evaluation both retry it, and the
    evaluation loss is the whole data's."""
    inputs, targets = data
    seen = []

    def criterion(outputs, targets_):
        seen.append((torch.is_grad_enabled(), len(targets_)))
        if len(targets_) > 5:
            raise_fake_oom()
        return F.cross_entropy(outputs, targets_)

    model = linear()
    history = trainer_for(model, criterion, batches(inputs, targets, 8), batch_size=16).fit(
        1, eval_data=batches(inputs, targets, 8)
    )
    with torch.no_grad():
        expected = F.cross_entropy(model(inputs), targets).item()
    assert history.epochs[0]["eval_loss"] == pytest.approx(expected, rel=1e-6)
    assert max(rows for grad, rows in seen if not grad) <= 8 and any(not grad and rows <= 5 for grad, rows in seen)


@pytest.mark.parametrize("output", ["dict", "tuple"])
def test_a_model_returning_a_dict_or_tuple_is_evaluated_in_chunks_after_an_out_of_memory_error(data, output):
    """Outputs are never joined: a chunked batch of a model that returns a dict or a tuple gives the whole loss."""
    inputs, targets = data

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = linear()

        def forward(self, x):
            if not torch.is_grad_enabled() and len(x) > 8:
                raise_fake_oom()
            logits = self.inner(x)
            return {"logits": logits} if output == "dict" else (logits, x)

    def criterion(outputs, targets_):
        return F.cross_entropy(outputs["logits"] if output == "dict" else outputs[0], targets_)

    def hits(outputs, targets_):
        return accuracy(outputs["logits"] if output == "dict" else outputs[0], targets_)

    model = Wrapped()
    results = trainer_for(model, criterion, batches(inputs, targets, 8), batch_size=16).evaluate(
        [(inputs, targets)], metrics=[hits]
    )
    with torch.no_grad():
        logits = model.inner(inputs)
    assert results["loss"] == pytest.approx(F.cross_entropy(logits, targets).item(), rel=1e-6)
    assert results["hits"] == pytest.approx(accuracy(logits, targets).item(), rel=1e-6)


@pytest.mark.parametrize("size", [32, 8, 4, 5])
def test_class_weights_weight_the_loss_and_not_the_accuracy_whatever_the_loaders_batches(data, size):
    """The loss is the class-weighted criterion's over all the data; accuracy counts each target once (the ignored
    ones not at all), so neither depends on how the evaluation data is batched."""
    inputs, targets = data
    targets = targets.clone()
    targets[::7] = -100
    criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 5.0, 0.2]))
    model = linear()
    trainer = trainer_for(model, criterion, [(inputs, targets)], batch_size=16)
    results = trainer.evaluate(batches(inputs, targets, size), metrics=["accuracy"])
    with torch.no_grad():
        logits = model(inputs)
    kept = targets != -100
    assert results["loss"] == pytest.approx(criterion(logits, targets).item(), rel=1e-6)
    assert results["accuracy"] == pytest.approx((logits.argmax(-1) == targets)[kept].float().mean().item(), rel=1e-6)


def test_a_summed_loss_is_per_row_in_training_and_in_evaluation(data):
    """With reduction="sum" the epoch's loss and the evaluation loss are on one scale: the summed loss per row
    (a short last step included), so with a learning rate of 0 they are equal."""
    inputs, targets = data
    model = linear()
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.0), nn.CrossEntropyLoss(reduction="sum"),
        batches(inputs, targets, 8)[:3] + [(inputs[24:30], targets[24:30])], batch_size=16, verbose=0,
        reduction="sum",
    )  # fmt: skip
    history = trainer.fit(1, eval_data=[(inputs[:30], targets[:30])])
    with torch.no_grad():
        expected = F.cross_entropy(model(inputs[:30]), targets[:30]).item()
    assert history.epochs[0]["loss"] == pytest.approx(expected, rel=1e-6)
    assert history.epochs[0]["eval_loss"] == pytest.approx(expected, rel=1e-6)


def test_metrics_are_checked_where_given(data):
    inputs, targets = data
    trainer = trainer_for(linear(), nn.CrossEntropyLoss(), [(inputs, targets)], batch_size=16)
    single = trainer.evaluate([(inputs, targets)], metrics=accuracy)  # one function, as one name is
    assert set(single) == {"loss", "accuracy"}
    with pytest.raises(ValueError, match="two metrics named '<lambda>'"):
        trainer.evaluate([(inputs, targets)], metrics=[lambda o, t: 0.0, lambda o, t: 1.0])
    with pytest.raises(ValueError, match="'loss' is the name of evaluate's own loss"):
        trainer.evaluate([(inputs, targets)], metrics={"loss": accuracy})
    with pytest.raises(TypeError, match="metrics must be a list"):
        trainer.fit(1, eval_data=[(inputs, targets)], metrics=3)


class Hook(Callback):
    def on_epoch_end(self, trainer):
        pass


@pytest.mark.parametrize(
    "callbacks, message",
    [([Hook], "not classes"), (Hook(), "must be a list"), ("on_epoch_end", "must be a list")],
)
def test_callbacks_that_are_not_a_list_of_objects_are_refused_when_the_trainer_is_made(data, callbacks, message):
    inputs, targets = data
    with pytest.raises(TypeError, match=message):
        trainer_for(linear(), nn.CrossEntropyLoss(), [(inputs, targets)], batch_size=16, callbacks=callbacks)


@pytest.mark.parametrize("verbose", [1.0, "1", None])
def test_a_verbosity_that_is_not_0_1_or_2_is_refused(data, verbose):
    inputs, targets = data
    with pytest.raises(ValueError, match="verbose must be 0"):
        Trainer(
            linear(), torch.optim.SGD(linear().parameters(), lr=0.1), nn.CrossEntropyLoss(), [(inputs, targets)],
            batch_size=16, verbose=verbose,
        )  # fmt: skip


def test_metrics_that_forward_cannot_feed_are_refused_at_the_first_step_not_after_an_epoch(data):
    """With `forward=` returning a bare loss, `fit(metrics=...)` has no logits to compute them from: it says so
    before the first optimizer step instead of after a whole epoch trained."""
    inputs, targets = data
    model = linear()
    passes = []

    def forward(batch):
        passes.append(len(batch[0]))
        return F.cross_entropy(model(batch[0]), batch[1])

    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), None, batches(inputs, targets, 8), batch_size=8,
        verbose=0, forward=forward,
    )  # fmt: skip
    with pytest.raises(TypeError, match="metrics with forward= need forward"):
        trainer.fit(1, eval_data=[(inputs, targets)], metrics=["accuracy"])
    assert passes == [8] and trainer.global_step == 0
    trainer.fit(1)  # without metrics, the same forward= trains
    assert trainer.global_step == 4


@pytest.mark.parametrize("with_forward", [False, True])
def test_a_float64_models_evaluation_loss_keeps_its_precision(data, with_forward):
    inputs, targets = data
    model = linear().double()
    inputs = inputs.double()
    options = dict(forward=lambda batch: F.cross_entropy(model(batch[0]), batch[1])) if with_forward else {}
    trainer = trainer_for(
        model, None if with_forward else nn.CrossEntropyLoss(), [(inputs, targets)], batch_size=16, **options
    )
    results = trainer.evaluate(batches(inputs, targets, 8))
    with torch.no_grad():
        expected = F.cross_entropy(model(inputs), targets).item()
    assert results["loss"] == pytest.approx(expected, rel=1e-13)


class LimitedEncoder(nn.Module):
    """An encoder whose forward runs out of memory (a stand-in) above `limit` rows."""

    def __init__(self, limit):
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 8))
        self.limit = limit

    def forward(self, x):
        if len(x) > self.limit:
            raise_fake_oom()
        return self.inner(x)


def scores_against_every_row(outputs, targets):
    """A criterion that couples rows: each row's embedding against every other row's, those of its class positive."""
    embedded = F.normalize(outputs, dim=-1)
    scores = embedded @ embedded.T * 5
    same = (targets[:, None] == targets[None, :]).float()
    return -(F.log_softmax(scores, dim=-1) * same / same.sum(-1, keepdim=True)).sum(-1).mean()


@pytest.mark.parametrize("trained_first", [True, False])
def test_a_criterion_that_couples_rows_trains_and_evaluates_the_whole_batch(data, trained_first):
    """Training: found coupled, gradient caching trains the full batch's parameters. Evaluation: the whole batch's
    loss with the model's calls cut, known from training or found by checking the first batch that ran in chunks;
    never the chunks' average."""
    inputs, targets = data
    reference = LimitedEncoder(1 << 30)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in batches(inputs, targets, 16):
        optimizer.zero_grad()
        scores_against_every_row(reference(x), y).backward()
        optimizer.step()
    model = LimitedEncoder(5)
    trainer = trainer_for(model, scores_against_every_row, batches(inputs, targets, 16), batch_size=16)
    if trained_first:
        trainer.fit(1)
        assert trainer.stats.split_check.coupled
        for p, r in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    else:
        model.load_state_dict(reference.state_dict())
    with torch.no_grad():
        expected = [scores_against_every_row(reference(x), y).item() for x, y in batches(inputs, targets, 16)]
        chunked = [scores_against_every_row(reference(x[:4]), y[:4]).item() for x, y in batches(inputs, targets, 16)]
    got = trainer.evaluate(batches(inputs, targets, 16))["loss"]
    assert got == pytest.approx(sum(expected) / len(expected), rel=1e-5)
    assert abs(sum(chunked) / len(chunked) - got) > 0.05, "an average of chunks would be another number"
    assert trainer._evaluation_coupling.coupled != trained_first, "found by the evaluation where training did not"
