"""toma.Trainer: the same training as a hand-written loop, micro-batched to fit, with callbacks and history."""

import io
import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import toma
from toma import Callback, StopTraining, Trainer
from toma.training.trainer import accuracy

from helpers import COLLECT_TOMA_LOG, WIDE_MLP_UNDER_A_CAP, raise_fake_oom, run_python

N, FEATURES, CLASSES = 96, 6, 3


def dataset():
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(N, FEATURES, generator=generator)
    return TensorDataset(inputs, (inputs[:, 0] > 0).long() + (inputs[:, 1] > 0).long())


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES))
    return model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def loader(batch_size, shuffle=True):
    return DataLoader(dataset(), batch_size=batch_size, shuffle=shuffle, generator=torch.Generator().manual_seed(2))


def hand_written(epochs, batch_size=32, shuffle=True):
    """The loop Trainer.fit replaces."""
    model, optimizer = model_and_optimizer()
    data = loader(batch_size, shuffle)
    for _ in range(epochs):
        for inputs, targets in data:
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
    return model


def make_trainer(data=None, batch_size=32, **options):
    model, optimizer = model_and_optimizer()
    options.setdefault("verbose", 0)
    trainer = Trainer(model, optimizer, nn.CrossEntropyLoss(), data or loader(32), batch_size=batch_size, **options)
    return trainer, model


def assert_same_parameters(a, b, exact=True):
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        if exact:
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# --- the same training as the hand-written loop ----------------------------------------------------------


def test_fit_equals_the_hand_written_loop():
    trainer, model = make_trainer()
    history = trainer.fit(2)
    assert_same_parameters(model, hand_written(2))
    assert [e["epoch"] for e in history.epochs] == [1, 2] and len(history.steps) == 6


def test_fit_in_micro_batches_equals_the_hand_written_loop():
    trainer, model = make_trainer(initial_micro_batch=10)  # 10, 10, 10, 2 rows per logical batch
    trainer.fit(2)
    assert trainer.micro_batch == 10
    assert_same_parameters(model, hand_written(2), exact=False)


def test_small_loader_batches_are_joined_into_logical_batches():
    trainer, model = make_trainer(loader(8, shuffle=False), batch_size=32)
    trainer.fit(2)
    assert [s["rows"] for s in trainer.history.steps] == [32] * 6
    assert_same_parameters(model, hand_written(2, 32, shuffle=False), exact=False)


def test_epoch_and_step_compose_to_the_same_result():
    by_fit, fit_model = make_trainer()
    by_fit.fit(2)
    by_epoch, epoch_model = make_trainer()
    records = [by_epoch.epoch(), by_epoch.epoch()]
    by_step, step_model = make_trainer()
    data = loader(32)
    for _ in range(2):
        for inputs, targets in data:
            by_step.step(inputs, targets)
    assert_same_parameters(fit_model, epoch_model)
    assert_same_parameters(fit_model, step_model)
    assert [r["epoch"] for r in records] == [1, 2] and by_epoch.current_epoch == 2
    assert by_step.global_step == by_fit.global_step == 6


def test_forward_takes_batches_of_another_shape():
    model, optimizer = model_and_optimizer()
    reference = hand_written(1, shuffle=False)
    data = [{"x": x, "y": y} for x, y in loader(32, shuffle=False)]
    trainer = Trainer(
        model,
        optimizer,
        None,
        data,
        batch_size=32,
        initial_micro_batch=12,
        forward=lambda batch: F.cross_entropy(model(batch["x"]), batch["y"]),
        verbose=0,
    )
    trainer.fit(1)
    assert_same_parameters(model, reference, exact=False)
    assert trainer.evaluate(data)["loss"] == pytest.approx(trainer.history.steps[-1]["loss"], rel=0.5)


def test_after_the_search_settles_later_steps_run_without_oom():
    trainer, model = make_trainer(initial_micro_batch=32)
    real_forward = model.forward

    def forward(inputs):
        if len(inputs) > 8:
            raise_fake_oom()
        return real_forward(inputs)

    model.forward = forward
    trainer.fit(3)
    assert [s["oom_retries"] for s in trainer.history.steps] == [2] + [0] * 8
    assert [e["micro_batch"] for e in trainer.history.epochs] == [8, 8, 8]
    assert [e["oom_retries"] for e in trainer.history.epochs] == [2, 0, 0]
    assert trainer.oom_retries == 2


# --- evaluation ------------------------------------------------------------------------------------------


def test_evaluate_returns_loss_and_metrics_over_rows_and_restores_train_mode():
    trainer, model = make_trainer()
    data = loader(40, shuffle=False)  # 40, 40, 16 rows
    results = trainer.evaluate(data, metrics={"accuracy": accuracy})
    inputs, targets = dataset().tensors
    with torch.no_grad():
        outputs = model(inputs)
    assert results["loss"] == pytest.approx(F.cross_entropy(outputs, targets).item(), rel=1e-5)
    assert results["accuracy"] == pytest.approx(accuracy(outputs, targets).item(), rel=1e-6)
    assert model.training and all(p.grad is None for p in model.parameters())


@pytest.mark.slow
def test_evaluate_under_a_real_cpu_memory_cap_chunks_the_batch():
    out = run_python(
        WIDE_MLP_UNDER_A_CAP
        + """
from toma import Trainer
from toma.training.trainer import accuracy
model = make_model()
with torch.no_grad():   # the reference, outside the cap, in known-small pieces
    outputs = torch.cat([model(inputs[s:s + 512]) for s in range(0, N, 512)])
reference = dict(loss=nn.functional.cross_entropy(outputs, targets).item(), accuracy=accuracy(outputs, targets).item())
del outputs
trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), [(inputs, targets)],
                  batch_size=N, verbose=0)
set_cpu_memory_headroom(192 / 1024)
results = trainer.evaluate([(inputs, targets)], metrics=[accuracy])
print(json.dumps(dict(results=results, reference=reference, messages=messages)))
""",
        timeout=240,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    ooms = [m for m in result["messages"] if "ran out of memory" in m]  # others: FitToMemory's size changes
    assert ooms and all("can't allocate memory" in m for m in ooms)
    assert all(m.startswith("Trainer.evaluate ran out of memory at evaluation chunk size") for m in ooms)
    assert result["results"]["loss"] == pytest.approx(result["reference"]["loss"], rel=1e-5)
    assert result["results"]["accuracy"] == pytest.approx(result["reference"]["accuracy"], rel=1e-6)


# --- callbacks and StopTraining --------------------------------------------------------------------------


class Recorder(Callback):
    def __init__(self, stop_at_step=None, stop_at_epoch=None):
        self.steps, self.epochs = [], []
        self.stop_at_step, self.stop_at_epoch = stop_at_step, stop_at_epoch

    def on_step_end(self, trainer):
        self.steps.append((trainer.current_epoch, trainer.global_step, float(trainer.last_loss)))
        if trainer.global_step == self.stop_at_step:
            raise StopTraining

    def on_epoch_end(self, trainer):
        self.epochs.append((trainer.current_epoch, trainer.history.epochs[-1]["loss"]))
        if trainer.current_epoch == self.stop_at_epoch:
            raise StopTraining


def test_callbacks_see_the_trainer_state():
    recorder = Recorder()
    trainer, _ = make_trainer(callbacks=[recorder])
    history = trainer.fit(2)
    assert [(epoch, step) for epoch, step, _ in recorder.steps] == [(0, 1), (0, 2), (0, 3), (1, 4), (1, 5), (1, 6)]
    assert [loss for _, _, loss in recorder.steps] == [s["loss"] for s in history.steps]
    # on_epoch_end sees the epochs finished, the one just ended included
    assert recorder.epochs == [(1, history.epochs[0]["loss"]), (2, history.epochs[1]["loss"])]


def test_stop_training_in_a_step_ends_fit_after_that_step():
    recorder = Recorder(stop_at_step=4)
    trainer, model = make_trainer(callbacks=[recorder])
    history = trainer.fit(5)
    assert trainer.global_step == 4 and len(history.steps) == 4
    assert [e["step"] for e in history.epochs] == [3, 4], "the partial epoch is recorded"
    assert len(recorder.epochs) == 1, "no epoch callback after a stop"
    reference, optimizer = model_and_optimizer()
    data = loader(32)
    steps = [batch for _ in range(2) for batch in data][:4]
    for inputs, targets in steps:
        optimizer.zero_grad()
        F.cross_entropy(reference(inputs), targets).backward()
        optimizer.step()
    assert_same_parameters(model, reference)


def test_stop_training_at_an_epoch_end():
    trainer, _ = make_trainer(callbacks=[Recorder(stop_at_epoch=2)])
    history = trainer.fit(10)
    assert len(history.epochs) == 2 and trainer.current_epoch == 2
    with pytest.raises(StopTraining):
        make_trainer(callbacks=[Recorder(stop_at_step=1)])[0].epoch()


# --- history, progress, bad input ------------------------------------------------------------------------


def test_history_records_every_epoch_field():
    trainer, _ = make_trainer()
    history = trainer.fit(2, eval_data=loader(96), metrics=[accuracy])
    record = history.epochs[-1]
    for key in ("epoch", "step", "loss", "time", "samples_per_s", "micro_batch", "oom_retries", "peak_rss"):
        assert record[key] is not None, key
    assert record["peak_rss"] > 2**20 and record["eval_accuracy"] <= 1 and record["eval_loss"] > 0
    assert record["peak_cuda_allocated"] is None  # a CPU run
    assert history.steps[0].keys() >= {"step", "epoch", "loss", "micro_batch", "rows", "oom_retries"}
    assert all(isinstance(s["loss"], float) for s in history.steps)
    assert 0 < len(trainer.memory) <= 3, "memory snapshots of the last epoch's steps"


@pytest.mark.parametrize("verbose", [0, 1, 2])
def test_verbose_chooses_silence_a_line_per_epoch_or_a_bar(verbose):
    out = io.StringIO()
    trainer, _ = make_trainer(verbose=verbose, file=out)
    trainer.fit(2)
    text = out.getvalue()
    if verbose == 0:
        assert text == ""
    elif verbose == 1:
        lines = text.splitlines()
        assert len(lines) == 2 and lines[1].startswith("epoch 2/2: loss ")
        assert "samples/s" in lines[0] and "micro-batch 32" in lines[0] and "0 OOM retries" in lines[0]
    else:
        assert "epoch 1/2" in text and "epoch 2/2" in text and "3/3" in text and "micro-batch 32" in text


def test_bad_input_fails_before_any_work():
    model, optimizer = model_and_optimizer()
    before = [p.detach().clone() for p in model.parameters()]
    data = loader(32)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        Trainer(model, optimizer, nn.CrossEntropyLoss(), data, batch_size=0)
    with pytest.raises(ValueError, match="train_data is empty"):
        Trainer(model, optimizer, nn.CrossEntropyLoss(), [], batch_size=32)
    with pytest.raises(ValueError, match="verbose must be 0"):
        Trainer(model, optimizer, nn.CrossEntropyLoss(), data, batch_size=32, verbose=3)
    with pytest.raises(TypeError, match="optimizer must be"):
        Trainer(model, None, nn.CrossEntropyLoss(), data, batch_size=32)
    with pytest.raises(TypeError, match="loss_fn must be a criterion"):
        Trainer(model, optimizer, None, data, batch_size=32)
    with pytest.raises(TypeError, match="callbacks must have"):
        Trainer(model, optimizer, nn.CrossEntropyLoss(), data, batch_size=32, callbacks=[object()])
    with pytest.raises(TypeError, match=r"loss_fn\(model\(inputs\), targets\) must return a scalar tensor"):
        Trainer(model, optimizer, nn.CrossEntropyLoss(reduction="none"), data, batch_size=32, verbose=0)
    per_row = lambda outputs, targets: F.cross_entropy(outputs, targets, reduction="none")  # noqa: E731
    not_scalar = Trainer(model, optimizer, per_row, data, batch_size=32, verbose=0)
    with pytest.raises(TypeError, match=r"loss_fn\(model\(inputs\), targets\) must return a scalar tensor"):
        not_scalar.fit(1)
    one_shot = Trainer(model, optimizer, nn.CrossEntropyLoss(), iter(list(data)), batch_size=32, verbose=0)
    with pytest.raises(TypeError, match="iterator that can be read only once"):
        one_shot.fit(2)
    with pytest.raises(ValueError, match="yielded no batches"):
        Trainer(model, optimizer, nn.CrossEntropyLoss(), (b for b in []), batch_size=32, verbose=0).fit(1)
    with pytest.raises(TypeError, match="must yield \\(inputs, targets\\)"):
        Trainer(model, optimizer, nn.CrossEntropyLoss(), [torch.zeros(4, 6)], batch_size=4, verbose=0).fit(1)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b) and p.grad is None
    assert toma.Trainer is Trainer


# --- what loaders really yield -----------------------------------------------------------------------------


def test_a_short_step_does_not_shrink_the_micro_batch_of_later_steps():
    trainer, model = make_trainer()
    inputs, targets = dataset().tensors
    trainer.step(inputs[:5], targets[:5])
    assert trainer.micro_batch == 5
    trainer.fit(1)
    assert [s["micro_batch"] for s in trainer.history.steps] == [32, 32, 32], "only an OOM shrinks the size"


class Tagged(torch.utils.data.Dataset):
    """Rows with a string each (their id, as text): a loader yields (tensor, list of str) batches."""

    def __init__(self):
        self.inputs, self.targets = dataset().tensors

    def __len__(self):
        return N

    def __getitem__(self, index):
        return torch.cat([self.inputs[index], torch.tensor([float(index)])]), f"row {index}"


def test_lists_of_one_string_per_row_stay_with_their_rows_when_batches_are_recut():
    model, optimizer = model_and_optimizer()
    targets = dataset().tensors[1]
    seen = []

    def forward(batch):
        features, names = batch
        ids = features[:, -1].long().tolist()
        if torch.is_grad_enabled():  # not toma's one check, without gradients, that the loss adds up
            seen.append((len(ids), [f"row {i}" for i in ids] == list(names)))
        return F.cross_entropy(model(features[:, :-1]), targets[ids])

    data = DataLoader(Tagged(), batch_size=4, shuffle=False)
    trainer = Trainer(model, optimizer, None, data, batch_size=8, initial_micro_batch=3, forward=forward, verbose=0)
    trainer.fit(1)
    assert seen and all(aligned for _, aligned in seen), "every micro-batch sees its own rows' strings"
    assert sum(n for n, _ in seen) == N and {n for n, _ in seen} == {3, 2}


def test_a_part_that_cannot_be_split_with_the_rows_is_a_clear_error():
    model, optimizer = model_and_optimizer()
    batches = [(torch.zeros(4, FEATURES), ["a", "b", "c"]), (torch.zeros(4, FEATURES), ["d", "e", "f"])]
    trainer = Trainer(model, optimizer, None, batches, batch_size=8, forward=lambda b: model(b[0]).sum(), verbose=0)
    with pytest.raises(ValueError, match=r"cannot join batches.*batch\[1\] \(list\).*one item per row"):
        trainer.fit(1)


PAD, VOCAB = -100, 7


def padded_batches(seed=0, count=6, size=4):
    """Token batches as a padding collate function makes them: each padded to its own longest row."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        lengths = torch.randint(1, 9, (size,), generator=generator)
        width = int(lengths.max())
        ids = torch.randint(0, VOCAB, (size, width), generator=generator)
        labels = ids.clone()
        labels[torch.arange(width)[None, :] >= lengths[:, None]] = PAD
        batches.append({"input_ids": ids, "labels": labels})
    return batches


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)

    def forward(self, input_ids, labels=None):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=PAD)
        return {"loss": loss, "logits": logits}  # what a Hugging Face causal LM returns, as a dict


def label_tokens(batch):
    return (batch["labels"][:, 1:] != PAD).sum()


def test_loader_batches_of_different_widths_train_exactly_with_weight():
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = padded_batches()
    trainer = Trainer(
        model, optimizer, None, batches, batch_size=12, forward=lambda b: model(**b), weight=label_tokens, verbose=0
    )
    trainer.fit(1)
    assert [s["rows"] for s in trainer.history.steps] == [12, 12]

    reference = TinyLM()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for logical in (batches[:3], batches[3:]):  # the token mean over each logical batch of 3 loader batches
        reference_optimizer.zero_grad()
        tokens = sum(int(label_tokens(b)) for b in logical)
        total = sum(reference(**b)["loss"] * int(label_tokens(b)) for b in logical)
        (total / tokens).backward()
        reference_optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    results = trainer.evaluate(batches, metrics=["accuracy"])
    assert 0 <= results["accuracy"] <= 1 and results["loss"] > 0


def test_lengths_packs_the_logical_batches_by_tokens_and_trains_as_rows_do():
    batches = []
    for batch in padded_batches(count=6):
        mask = (batch["labels"] != PAD).long()
        mask[:, 0] = 1  # the first token is real in every row (its label is not counted after the shift)
        batches.append({"input_ids": batch["input_ids"] * mask, "attention_mask": mask, "labels": batch["labels"]})
    trained, widths = [], []
    for lengths in (None, "attention_mask"):
        model = TinyLM()

        def forward(batch, model=model):
            widths.append(batch["input_ids"].shape) if lengths else None
            return model(input_ids=batch["input_ids"], labels=batch["labels"])

        trainer = Trainer(
            model, torch.optim.SGD(model.parameters(), lr=0.5), None, batches, batch_size=12, initial_micro_batch=2,
            forward=forward, weight=label_tokens, lengths=lengths, verbose=0,
        )  # fmt: skip
        trainer.fit(1)
        trained.append(model)
    for p, q in zip(trained[0].parameters(), trained[1].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert min(shape[1] for shape in widths) < max(shape[1] for shape in widths), "trimmed micro-batches"


def test_metrics_with_forward_use_the_outputs_logits_and_the_batch_labels():
    model = TinyLM()
    batches = padded_batches(count=3)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        None,
        batches,
        batch_size=4,
        forward=lambda b: model(**b),
        weight=label_tokens,
        verbose=0,
    )

    def next_token_accuracy(logits, labels):
        return accuracy(logits[:, :-1], labels[:, 1:])

    results = trainer.evaluate(batches, metrics={"next_token_accuracy": next_token_accuracy})
    hits = tokens = 0
    losses = 0.0
    with torch.no_grad():
        for b in batches:
            out = model(**b)
            mask = b["labels"][:, 1:] != PAD
            hits += int(((out["logits"][:, :-1].argmax(-1) == b["labels"][:, 1:]) & mask).sum())
            tokens += int(mask.sum())
            losses += float(out["loss"]) * int(mask.sum())
    assert results["next_token_accuracy"] == pytest.approx(hits / tokens, rel=1e-6)
    assert results["loss"] == pytest.approx(losses / tokens, rel=1e-5)
    bare = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        None,
        batches,
        batch_size=4,
        forward=lambda b: model(**b)["loss"],
        verbose=0,
    )
    with pytest.raises(TypeError, match="logits"):
        bare.evaluate(batches, metrics=["accuracy"])


def test_metrics_by_name_and_a_clear_error_for_an_unknown_one():
    trainer, model = make_trainer()
    by_name = trainer.evaluate(loader(32), metrics=["accuracy"])
    by_function = trainer.evaluate(loader(32), metrics=[accuracy])
    assert by_name == by_function
    with pytest.raises(ValueError, match=r"unknown metric 'acc'.*\['accuracy'\]"):
        trainer.evaluate(loader(32), metrics=["acc"])
    with pytest.raises(TypeError, match=r"metrics\['f1'\] must be a function"):
        trainer.evaluate(loader(32), metrics={"f1": 3})


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        inputs, targets = dataset().tensors
        return iter(zip(inputs, targets))


def test_a_loader_over_an_iterable_dataset_trains():
    model, optimizer = model_and_optimizer()
    data = DataLoader(Stream(), batch_size=16)
    out = io.StringIO()
    trainer = Trainer(model, optimizer, nn.CrossEntropyLoss(), data, batch_size=32, verbose=2, file=out)
    trainer.fit(2)
    assert [s["rows"] for s in trainer.history.steps] == [32] * 6
    assert_same_parameters(model, hand_written(2, shuffle=False), exact=False)


class SizedStream(Stream):
    def __len__(self):
        return len(dataset())


def test_the_progress_bar_knows_the_steps_of_an_iterable_dataset_with_a_length():
    out = io.StringIO()
    trainer, _ = make_trainer(DataLoader(SizedStream(), batch_size=16), batch_size=32, verbose=2, file=out)
    trainer.fit(1)
    assert len(trainer.history.steps) == 3 and "3/3" in out.getvalue()


def test_the_progress_bar_counts_the_steps_the_sampler_gives():
    subset = torch.utils.data.SubsetRandomSampler(range(48), generator=torch.Generator().manual_seed(0))
    out = io.StringIO()
    trainer, _ = make_trainer(DataLoader(dataset(), batch_size=8, sampler=subset), batch_size=16, verbose=2, file=out)
    trainer.fit(1)
    assert len(trainer.history.steps) == 3
    assert "3/3" in out.getvalue() and "/6" not in out.getvalue()


@pytest.mark.slow
def test_padded_loader_batches_train_exactly_under_a_real_cpu_memory_cap():
    """Loader batches of 128 rows padded to their own widths, joined into logical batches of 512 that cannot be
    one tensor: under the cap a 128-row micro-batch runs out of memory for real, and the step still equals the
    token-mean step computed before the cap."""
    out = run_python(
        COLLECT_TOMA_LOG
        + """
import json, torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
from toma import Trainer
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
predictable_heap()
VOCAB = 8192
generator = torch.Generator().manual_seed(0)
batches = []
for width in (16, 9, 13, 16, 11, 16, 8, 14):
    ids = torch.randint(0, VOCAB, (128, width), generator=generator)
    labels = ids.clone()
    lengths = torch.randint(1, width + 1, (128,), generator=generator)
    labels[torch.arange(width)[None, :] >= lengths[:, None]] = -100
    batches.append({"input_ids": ids, "labels": labels})
def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB))
def loss_of(model, batch, reduction="mean"):
    logits = model(batch["input_ids"])[:, :-1]
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), ignore_index=-100,
                           reduction=reduction)
def tokens(batch):
    return (batch["labels"][:, 1:] != -100).sum()
reference = make()
optimizer = torch.optim.SGD(reference.parameters(), lr=1.0)
for logical in (batches[:4], batches[4:]):
    optimizer.zero_grad()
    total = sum(int(tokens(b)) for b in logical)
    for b in logical:
        for s in range(0, 128, 32):
            part = {k: v[s:s + 32] for k, v in b.items()}
            (loss_of(reference, part, "sum") / total).backward()
    optimizer.step()
model = make()
trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=1.0), None, batches, batch_size=512,
                  forward=lambda b: loss_of(model, b), weight=tokens, verbose=0)
set_cpu_memory_headroom(96 / 1024)
trainer.fit(1)
error = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), reference.parameters()))
print(json.dumps(dict(messages=messages, error=error, micro_batch=trainer.micro_batch,
                      rows=[s["rows"] for s in trainer.history.steps])))
""",
        timeout=240,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    ooms = [m for m in result["messages"] if "ran out of memory" in m]
    assert ooms and all(m.startswith("Trainer.step ran out of memory at micro-batch size") for m in ooms)
    assert all("can't allocate memory" in m for m in ooms)
    assert result["rows"] == [512, 512] and result["micro_batch"] < 128
    assert result["error"] < 1e-6


def test_an_evaluation_chunk_that_runs_out_of_memory_in_a_metric_is_counted_once(caplog):
    model = TinyLM()
    batches = padded_batches(count=2)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        None,
        batches,
        batch_size=4,
        forward=lambda b: model(**b),
        weight=label_tokens,
        verbose=0,
    )

    def fussy_accuracy(logits, labels):
        if len(logits) > 2:
            raise_fake_oom()  # after the chunk's loss was computed
        return accuracy(logits, labels)

    caplog.set_level("INFO", logger="toma")
    fussy = trainer.evaluate(batches, metrics={"acc": fussy_accuracy})
    plain = trainer.evaluate(batches, metrics={"acc": accuracy})
    assert fussy["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert any(
        "Trainer.evaluate ran out of memory at evaluation chunk size 4" in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize("with_scaler", [False, True], ids=["optimizer", "GradScaler"])
def test_a_logical_batch_with_nothing_to_learn_from_changes_nothing_and_logs_no_nan(with_scaler, caplog):
    """A logical batch whose labels are all padding counts 0 tokens: its mean loss is a mean over nothing (NaN in
    a full-batch pass). The step changes nothing (neither the optimizer, whose momentum would move the weights,
    nor the GradScaler, which asserts that it saw gradients, steps), its loss is 0 and counts for nothing in the
    epoch's loss, and a warning says so; the other batches train as they would without it."""
    batches = padded_batches(count=3)
    batches[1]["labels"].fill_(PAD)

    def train(data):
        model = TinyLM()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu") if with_scaler else None
        trainer = Trainer(
            model,
            optimizer,
            None,
            data,
            batch_size=4,
            forward=lambda b: model(**b),
            weight=label_tokens,
            scaler=scaler,
            verbose=0,
        )
        with caplog.at_level(logging.WARNING, logger="toma"):
            history = trainer.fit(1)
        return model, optimizer, trainer, history

    model, optimizer, trainer, history = train(batches)
    reference, reference_optimizer, _, reference_history = train([batches[0], batches[2]])
    assert "nothing to learn from" in caplog.text and "the optimizer does not step" in caplog.text
    assert trainer.global_step == 3 and [s["loss"] for s in history.steps][1] == 0.0
    assert all(math.isfinite(s["loss"]) for s in history.steps) and math.isfinite(history.epochs[-1]["loss"])
    assert history.epochs[-1]["loss"] == pytest.approx(reference_history.epochs[-1]["loss"], rel=1e-6)
    assert all(state["step"] == 2 for state in optimizer.state.values()), "Adam stepped for the two others only"
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_an_epoch_in_which_no_batch_had_anything_to_learn_from_is_an_error():
    """A weight= that counts the wrong thing would skip every batch and never train: an epoch of nothing but such
    batches is an error, and nothing stepped."""
    model = TinyLM()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    batches = padded_batches(count=2)
    for b in batches:
        b["labels"].fill_(PAD)
    trainer = Trainer(
        model, optimizer, None, batches, batch_size=4, forward=lambda b: model(**b), weight=label_tokens, verbose=0
    )
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"not one of the epoch's 2 logical batches had anything to learn from"):
        trainer.fit(1)
    assert not optimizer.state, "Adam never stepped"
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)


def test_evaluation_runs_each_batch_whole_until_one_runs_out_of_memory():
    """The first evaluation batch's row count is not a limit: a short first batch must not chunk the rest."""
    model, optimizer = model_and_optimizer()
    seen = []
    model.register_forward_pre_hook(lambda module, inputs: seen.append(len(inputs[0])))
    batches = [(torch.randn(n, FEATURES), torch.randint(0, CLASSES, (n,))) for n in (3, 40, 100)]
    trainer = Trainer(model, optimizer, nn.CrossEntropyLoss(), batches, batch_size=4, verbose=0)
    trainer.evaluate(batches)
    assert seen == [3, 40, 100]


def test_the_policy_option_decides_how_micro_batches_shrink():
    from toma import FitToMemory, ShrinkByFactor

    sizes = []
    trainer, model = make_trainer(batch_size=32, policy=ShrinkByFactor(0.75))
    model.register_forward_pre_hook(lambda module, inputs: sizes.append(len(inputs[0])))

    def oom_above_10(module, inputs):
        if len(inputs[0]) > 10:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    handle = model.register_forward_pre_hook(oom_above_10)
    trainer.step(*next(iter(loader(32))))
    handle.remove()
    assert sizes[:4] == [32, 24, 18, 13] and trainer.micro_batch == 9  # 13 * 0.75
    assert isinstance(make_trainer()[0].policy, FitToMemory), "the default measures"
    with pytest.raises(TypeError, match="policy"):
        make_trainer(policy=3)


def test_the_epoch_cuda_peak_is_the_epochs_and_the_steps_measurements_leave_it_alone(monkeypatch):
    """The trainer reads the device's peak per epoch; the measured steps inside it (FitToMemory on the same
    device) must not reset it, or the epoch's peak would be the last measured step's. CUDA is faked."""
    import toma.training.trainer
    from toma import FitToMemory
    from toma.memory.meters import CudaMeter

    from fake_cuda_memory import FakeCuda, MiB

    fake = FakeCuda(monkeypatch, current=0)
    monkeypatch.setattr(toma.training.trainer, "to_device", lambda batch, device, non_blocking=False: batch)
    model, optimizer = model_and_optimizer()
    megabytes = (300, 100, 50)  # what each step's forward holds on the GPU: the first step's is the peak

    def forward(batch):
        inputs, targets = batch
        n = megabytes[trainer.global_step] * MiB
        fake.allocate(0, n)
        fake.free(0, n)
        return F.cross_entropy(model(inputs), targets)

    trainer = Trainer(
        model,
        optimizer,
        None,
        loader(32, shuffle=False),
        batch_size=32,
        verbose=0,
        forward=forward,
        policy=FitToMemory(meter=CudaMeter("cuda:0")),
    )
    trainer.device = torch.device("cuda", 0)  # as if the model were there
    trainer.fit(1)
    assert trainer.global_step == 3
    assert trainer.history.epochs[0]["peak_cuda_allocated"] == 300 * MiB
    assert fake.resets == [0], "only the trainer resets the peak, once, as its epoch begins"


def test_evaluation_chunks_are_measured_on_the_trainers_device():
    """The evaluation step says where its work runs (the trainer's device), so a measuring policy reads that
    device's meter: host batches say nothing about it, and the current CUDA device may be another one."""
    seen = []

    class Recording(toma.FitToMemory):
        def begin(self, call):
            seen.append(call.device)
            return super().begin(call)

    trainer, _ = make_trainer(policy=Recording())
    trainer.evaluate(loader(40, shuffle=False))
    assert seen and all(device == torch.device("cpu") for device in seen)


def flattened(batch):
    """A padded batch as a padding-free collator flattens it: its rows' real tokens in one row, `position_ids`
    restarting at 0, each sequence's first label -100 (TinyLM attends nowhere: its tokens are on their own)."""
    keep = batch["labels"] != PAD
    keep[:, 0] = True  # every row has at least its first token
    lengths = keep.sum(1)
    ids = batch["input_ids"][keep][None]
    positions = torch.cat([torch.arange(int(n)) for n in lengths])[None]
    labels = batch["labels"][keep][None].masked_fill(positions == 0, PAD)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def test_padding_free_loader_batches_train_in_chunks_of_their_sequences_as_the_full_batches_do():
    """Loader batches of 4 packed sequences each, logical batches of 8 sequences (two loader batches: pieces, never
    stacked), every forward pass over more than 12 tokens out of memory: the parameters of full-batch steps."""
    batches = [flattened(b) for b in padded_batches()]

    def forward(model, b):
        return model(input_ids=b["input_ids"], labels=b["labels"])  # TinyLM ignores positions: on their own

    model = TinyLM()
    seen = []

    def refusing(b):
        if torch.is_grad_enabled():
            seen.append(b["input_ids"].shape[1])
            if b["input_ids"].shape[1] > 12:
                raise_fake_oom()
        return forward(model, b)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    trainer = Trainer(
        model,
        optimizer,
        None,
        batches,
        batch_size=8,
        forward=refusing,
        weight=label_tokens,
        lengths="position_ids",
        groups="rows",
        verbose=0,
    )
    trainer.fit(1)
    assert [s["rows"] for s in trainer.history.steps] == [8, 8, 8], "rows count sequences"
    assert trainer.oom_retries >= 1 and max(n for n in seen) > 12 and trainer.micro_batch <= 12

    reference = TinyLM()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for logical in (batches[0:2], batches[2:4], batches[4:6]):
        reference_optimizer.zero_grad()
        tokens = sum(int(label_tokens(b)) for b in logical)
        (sum(forward(reference, b)["loss"] * int(label_tokens(b)) for b in logical) / tokens).backward()
        reference_optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_every_option_given_to_the_trainer_reaches_each_steps_accumulation(monkeypatch):
    """The options are checked once in `__init__` and reach every step unchanged (a step once rebuilt them field
    by field and dropped `gradient_sync`)."""
    from toma.training import trainer as trainer_module

    seen = []
    real = trainer_module.accumulate

    def recording(func, batch, options, sizing, *rest):
        seen.append((options, sizing))
        return real(func, batch, options, sizing, *rest)

    monkeypatch.setattr(trainer_module, "accumulate", recording)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    policy, scaler = toma.Halving(), torch.amp.GradScaler("cpu", enabled=False)
    counted = lambda inputs, targets: len(targets)  # noqa: E731
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=8)
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), data, batch_size=8,
        initial_micro_batch=4, verbose=0, policy=policy, weight=counted, scaler=scaler,
        gradient_sync="logical_batch", groups="pairs", split_for_padding=False, levers=False,
    )  # fmt: skip
    trainer.fit(1)
    assert len(seen) == 2
    for options, sizing in seen:
        assert options.model is model and options.reduction == "mean" and options.weight is counted
        assert options.scaler is scaler and options.gradient_sync == "logical_batch" and options.groups == "pairs"
        assert options.split_for_padding is False and options.check_split is False and options.levers is False
        assert sizing.initial == 4 and sizing.runner.policy is policy
