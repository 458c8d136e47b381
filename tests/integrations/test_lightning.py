"""toma.integrations.lightning.MicroBatching: each loader batch one logical batch in micro-batches that fit, the
parameters those of a plain Lightning run on the same batches (rtol 1e-5)."""

import csv
import functools
import json
import logging
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from toma import Halving  # noqa: E402
from toma.integrations.lightning import MicroBatching  # noqa: E402

from helpers import WIDE_MLP_UNDER_A_CAP, raise_fake_oom, requires_cuda, run_python  # noqa: E402

RTOL, ATOL = 1e-5, 1e-7
ROWS, BATCH = 128, 32


class OomInBackward(torch.autograd.Function):
    """The identity, whose backward pass runs out of memory: a micro-batch whose forward pass fit."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise_fake_oom()


class Classifier(pl.LightningModule):
    """An MLP whose training step logs its loss; out of memory above `oom_above` rows (in the forward pass) or
    `backward_oom_above` rows (in the backward pass), as a device with less memory would be."""

    def __init__(self, oom_above=None, backward_oom_above=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
        self.oom_above, self.backward_oom_above = oom_above, backward_oom_above
        self.rows = []  # the rows of every training_step call

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        if torch.is_grad_enabled():  # not toma's one check, without gradients, that the loss adds up
            self.rows.append(len(inputs))
        if self.oom_above is not None and len(inputs) > self.oom_above:
            raise_fake_oom()
        logits = self.net(inputs)
        if self.backward_oom_above is not None and len(inputs) > self.backward_oom_above:
            logits = OomInBackward.apply(logits)
        loss = F.cross_entropy(logits, targets)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def loader(batch_size=BATCH):
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(ROWS, 8, generator=generator), torch.randint(0, 3, (ROWS,), generator=generator)
    )
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


def quiet_trainer(steps, callbacks=(), **options):
    """A CPU Lightning Trainer of `steps` steps that shows, checks and saves nothing (no logger unless given)."""
    options.setdefault("logger", False)
    options.setdefault("accelerator", "cpu")
    return pl.Trainer(
        max_steps=steps,
        callbacks=list(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **options,
    )


def fit(module, callbacks=(), batch_size=BATCH, steps=4, **options):
    trainer = quiet_trainer(steps, callbacks, **options)
    trainer.fit(module, loader(batch_size))
    return trainer


def assert_same_parameters(module, reference):
    for got, expected in zip(module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


def logged_rows(trainer):
    with open(f"{trainer.logger.log_dir}/metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


# --- parameters and losses equal a plain run ------------------------------------------------------------


def test_without_an_out_of_memory_error_each_batch_runs_whole_and_trains_as_a_plain_run(tmp_path):
    """With `log_micro_batch=True` the micro-batch size is logged on the steps Lightning writes to its loggers,
    beside the module's values."""
    plain = Classifier()
    plain_rows = logged_rows(fit(plain, logger=CSVLogger(tmp_path / "plain"), log_every_n_steps=3))
    module, callback = Classifier(), MicroBatching(log_micro_batch=True)
    rows = logged_rows(fit(module, [callback], logger=CSVLogger(tmp_path / "micro"), log_every_n_steps=3))
    assert module.rows == [BATCH] * 4
    assert_same_parameters(module, plain)
    assert [row["step"] for row in rows] == [row["step"] for row in plain_rows] == ["2"]
    assert float(rows[0]["train_loss"]) == pytest.approx(float(plain_rows[0]["train_loss"]), rel=RTOL)
    assert float(rows[0]["micro_batch"]) == BATCH
    assert callback.stats.micro_batch == BATCH and callback.stats.oom_retries == 0
    assert "training_step" not in module.__dict__, "the module's own training_step is back after the fit"


def test_out_of_memory_in_backward_shrinks_the_micro_batch_and_logs_what_a_plain_run_logs(tmp_path):
    """An OOM in the backward pass after the micro-batch's forward already logged its loss: the failed attempt's
    values are dropped, and each logged loss is the logical batch's (micro-batch means weighted by rows)."""
    plain_trainer = fit(Classifier(), logger=CSVLogger(tmp_path / "plain"), log_every_n_steps=1)
    plain_rows = logged_rows(plain_trainer)
    module, callback = Classifier(backward_oom_above=8), MicroBatching(policy=Halving(), log_micro_batch=True)
    trainer = fit(module, [callback], logger=CSVLogger(tmp_path / "micro"), log_every_n_steps=1)
    # 32 rows, then 16 (out of memory in the backward pass), then 8 for the rest
    assert module.rows == [32, 16] + [8] * 16, module.rows
    assert callback.stats.micro_batch == 8 and callback.stats.oom_retries == 2
    rows = logged_rows(trainer)
    assert [row["step"] for row in rows] == [row["step"] for row in plain_rows] == ["0", "1", "2", "3"]
    for row, plain_row in zip(rows, plain_rows, strict=True):
        assert float(row["train_loss"]) == pytest.approx(float(plain_row["train_loss"]), rel=RTOL)
        assert float(row["micro_batch"]) == 8
    assert_same_parameters(module, plain_trainer.lightning_module)


def test_accumulate_grad_batches_with_out_of_memory_in_the_forward_pass():
    plain = Classifier()
    fit(plain, accumulate_grad_batches=2)
    module, callback = Classifier(oom_above=8), MicroBatching()
    fit(module, [callback], accumulate_grad_batches=2)
    assert callback.stats.micro_batch <= 8 and callback.stats.oom_retries >= 1
    assert_same_parameters(module, plain)


def hand_split_reference(**options):
    """The plain run that trains a batch of 32 as 4 batches of 8 with accumulate_grad_batches=4: what micro-batches
    of 8 give, done by Lightning itself (under mixed precision a micro-batch's rounding is not the whole batch's)."""
    reference = Classifier()
    fit(reference, batch_size=8, steps=2, accumulate_grad_batches=4, **options)
    return reference


def test_bf16_mixed_precision_trains_as_lightning_does_with_the_same_micro_batches():
    module, callback = Classifier(), MicroBatching(initial_micro_batch=8)
    trainer = fit(module, [callback], steps=2, precision="bf16-mixed")
    assert isinstance(trainer.precision_plugin, MixedPrecision) and trainer.precision_plugin.scaler is None
    assert module.rows == [8] * 8
    assert_same_parameters(module, hand_split_reference(precision="bf16-mixed"))


def test_fp16_mixed_precision_scales_every_micro_batch_backward_pass_with_lightnings_scaler(monkeypatch):
    """Lightning's AMP plugin with a GradScaler (usable on the CPU): each micro-batch's loss goes through
    scaler.scale before its backward pass (fp16 gradients would underflow otherwise), the logical batch's loss
    once more in Lightning's backward pass, and the gradients the optimizer sees carry the scale once."""
    scaled = []
    original = torch.amp.GradScaler.scale

    def spy(self, outputs):
        if isinstance(outputs, torch.Tensor) and outputs.requires_grad:
            scaled.append(outputs.grad_fn is not None and type(outputs.grad_fn).__name__)
        return original(self, outputs)

    monkeypatch.setattr(torch.amp.GradScaler, "scale", spy)
    module, callback = Classifier(), MicroBatching(initial_micro_batch=8)
    trainer = fit(module, [callback], steps=2, plugins=[MixedPrecision("16-mixed", "cpu")])
    scaler = trainer.precision_plugin.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() and scaler.get_scale() > 1
    # per step: 4 micro-batch losses (each scaled by its share of the batch), then Lightning's backward on the
    # logical batch's loss (divided by accumulate_grad_batches)
    assert scaled == (["MulBackward0"] * 4 + ["DivBackward0"]) * 2, scaled
    scaled.clear()
    assert_same_parameters(module, hand_split_reference(plugins=[MixedPrecision("16-mixed", "cpu")]))


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_fp16_with_gradient_clipping_after_an_out_of_memory_error_equals_lightnings_run_over_the_same_micro_batches(
    algorithm,
):
    """The scaler unscales the logical batch's gradients before Lightning clips them, as in its own accumulation
    (the whole batch in fp16 rounds otherwise, which is what a split changes)."""
    options = dict(
        plugins=[MixedPrecision("16-mixed", "cpu")], gradient_clip_val=0.05, gradient_clip_algorithm=algorithm
    )
    module, callback = Classifier(oom_above=8), MicroBatching()
    fit(module, [callback], steps=2, **options)
    assert callback.stats.micro_batch == 8 and callback.stats.oom_retries >= 1
    assert_same_parameters(module, hand_split_reference(**options))


class ClosureOptimizer(Classifier):
    """In float64: LBFGS's line search turns float32's rounding (the micro-batches' sums) into more than rtol."""

    def __init__(self, oom_above=None):
        super().__init__(oom_above)
        self.double()

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return super().training_step((inputs.double(), targets), batch_idx)

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=5)


def test_an_optimizer_that_calls_the_closure_several_times_trains_the_logical_batch_each_time():
    """LBFGS calls Lightning's closure (training step and backward) several times a step: each call is the
    logical batch, in micro-batches after an out-of-memory error, and the steps are a plain run's."""
    plain = ClosureOptimizer()
    fit(plain, steps=3)
    module, callback = ClosureOptimizer(oom_above=8), MicroBatching()
    fit(module, [callback], steps=3)
    assert callback.stats.micro_batch == 8 and callback.stats.calls == len(plain.rows) > 3
    assert_same_parameters(module, plain)


class TokenMean(pl.LightningModule):
    """A causal-LM-like step on a dict batch whose loss averages over the label tokens that are not padding."""

    def __init__(self, oom_above=None):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(20, 16), nn.Linear(16, 20)
        self.oom_above = oom_above

    def training_step(self, batch, batch_idx):
        if self.oom_above is not None and len(batch["input_ids"]) > self.oom_above:
            raise_fake_oom()
        logits = self.head(self.embed(batch["input_ids"]))
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Padded(torch.utils.data.Dataset):
    """Rows of 12 tokens whose labels are padded after a length of 1 to 12: token counts far apart."""

    def __init__(self):
        generator = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, 20, (64, 12), generator=generator)
        lengths = torch.randint(1, 13, (64, 1), generator=generator)
        self.labels = self.ids.masked_fill(torch.arange(12) >= lengths, -100)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def label_tokens(batch):
    return (batch["labels"] != -100).sum()


def test_weight_gives_a_token_mean_loss_the_plain_runs_gradients_and_logged_loss(tmp_path):
    def run(module, callbacks, name):
        trainer = quiet_trainer(3, callbacks, logger=CSVLogger(tmp_path / name), log_every_n_steps=1)
        trainer.fit(module, torch.utils.data.DataLoader(Padded(), batch_size=16))
        return logged_rows(trainer)

    plain = TokenMean()
    plain_rows = run(plain, [], "plain")
    module = TokenMean(oom_above=4)
    rows = run(module, [MicroBatching(weight=label_tokens, policy=Halving(), log_micro_batch=True)], "micro")
    assert [float(row["micro_batch"]) for row in rows] == [4.0] * 3
    for row, plain_row in zip(rows, plain_rows, strict=True):
        assert float(row["train_loss"]) == pytest.approx(float(plain_row["train_loss"]), rel=RTOL)
    assert_same_parameters(module, plain)


class PaddedWithMask(Padded):
    """The same rows padded as a tokenizer pads them: id 0 and a 0 in `attention_mask` past each row's length."""

    def __getitem__(self, index):
        mask = (self.labels[index] != -100).long()
        return {"input_ids": self.ids[index] * mask, "attention_mask": mask, "labels": self.labels[index]}


class TrimmedTokenMean(TokenMean):
    """TokenMean that runs out of memory above 24 padded tokens, and notes each micro-batch's shape."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def training_step(self, batch, batch_idx):
        self.shapes.append(tuple(batch["input_ids"].shape))
        if batch["input_ids"].numel() > 24:
            raise_fake_oom()
        return super().training_step(batch, batch_idx)


def test_packed_by_tokens_the_micro_batches_are_trimmed_and_train_as_the_plain_run(tmp_path):
    plain, module = TokenMean(), TrimmedTokenMean()
    for trained, callbacks in ((plain, []), (module, [MicroBatching(weight=label_tokens, pack_tokens=True)])):
        quiet_trainer(3, callbacks).fit(trained, torch.utils.data.DataLoader(PaddedWithMask(), batch_size=16))
    assert_same_parameters(module, plain)
    finished = [shape for shape in module.shapes if shape[0] * shape[1] <= 24]
    assert any(width < 12 for _, width in finished), "micro-batches trimmed to their longest row"


class SkipsUnlabelled(TokenMean):
    """Skips a batch with no label token (Lightning's `None`), which `weight=` counts 0 items in."""

    def training_step(self, batch, batch_idx):
        if label_tokens(batch) == 0:
            self.log("skipped", 1.0)
            return None
        return super().training_step(batch, batch_idx)


def test_a_batch_whose_weight_counts_nothing_runs_whole_and_its_none_skips_it_as_in_a_plain_run():
    """`toma.accumulate` refuses a batch that `weight=` counts 0 items in; MicroBatching runs it whole through the
    module's own step instead, so its `None` (and what it logs) reach Lightning as in a plain run."""

    def run(module, callbacks):
        dataset = Padded()
        dataset.labels[16:32] = -100  # the second batch has nothing to learn from
        trainer = quiet_trainer(3, callbacks, log_every_n_steps=1)
        trainer.fit(module, torch.utils.data.DataLoader(dataset, batch_size=16))
        return trainer

    plain = run(SkipsUnlabelled(), [])
    trainer = run(SkipsUnlabelled(oom_above=4), [MicroBatching(weight=label_tokens, policy=Halving())])
    assert_same_parameters(trainer.lightning_module, plain.lightning_module)
    assert_same_metrics(trainer, plain)
    assert trainer.callback_metrics["skipped"] == 1.0


def test_a_batch_with_nothing_to_learn_from_whose_step_returns_a_nan_loss_is_skipped_changing_nothing(caplog):
    """TokenMean's loss is a mean over its label tokens: over none, NaN, which a plain run would train into every
    parameter. MicroBatching runs the module's own step on the batch (what it logs reaches Lightning as in a plain
    run), but skips the batch rather than train on its mean over nothing, and says so."""
    dataset = Padded()
    dataset.labels[16:32] = -100  # the second batch has nothing to learn from
    seen = []

    class Watched(TokenMean):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            seen.append([p.detach().clone() for p in self.parameters()])

    module = Watched(oom_above=4)
    trainer = quiet_trainer(3, [MicroBatching(weight=label_tokens, policy=Halving())])
    with caplog.at_level(logging.WARNING, logger="toma"):
        trainer.fit(module, torch.utils.data.DataLoader(dataset, batch_size=16))
    assert "has nothing to learn from" in caplog.text
    assert all(torch.equal(p, q) for p, q in zip(seen[0], seen[1])), "the second batch changed nothing"
    assert not all(torch.equal(p, q) for p, q in zip(seen[1], seen[2])), "the third trained"
    assert all(torch.isfinite(p).all() for p in module.parameters())


def flatten(rows):
    """The collate function of a padding-free loader: the rows' real tokens packed into one row, `position_ids`
    restarting at 0, each sequence's first label -100."""
    ids = [
        row["input_ids"][row["labels"] != -100] if (row["labels"] != -100).any() else row["input_ids"][:1]
        for row in rows
    ]
    positions = torch.cat([torch.arange(len(seq)) for seq in ids])[None]
    packed = torch.cat(ids)[None]
    return {"input_ids": packed, "position_ids": positions, "labels": packed.masked_fill(positions == 0, -100)}


class PaddingFree(TokenMean):
    """TokenMean on padding-free batches (its tokens are on their own: nothing attends across sequences)."""

    def training_step(self, batch, batch_idx):
        if self.oom_above is not None and torch.is_grad_enabled() and batch["input_ids"].shape[1] > self.oom_above:
            raise_fake_oom()
        logits = self.head(self.embed(batch["input_ids"]))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
        self.log("train_loss", loss)
        return loss


def test_padding_free_batches_are_cut_between_their_sequences_and_train_as_a_plain_run():
    def run(module, callbacks):
        trainer = quiet_trainer(3, callbacks, log_every_n_steps=1)
        loader = torch.utils.data.DataLoader(Padded(), batch_size=16, collate_fn=flatten)
        trainer.fit(module, loader)
        return trainer

    def shifted_labels(batch):
        return (batch["labels"][:, 1:] != -100).sum()

    plain = run(PaddingFree(), [])
    callback = MicroBatching(weight=shifted_labels, policy=Halving())
    trainer = run(PaddingFree(oom_above=40), [callback])
    assert callback.stats.oom_retries >= 1 and callback.stats.micro_batch <= 40
    assert_same_parameters(trainer.lightning_module, plain.lightning_module)


# --- the training step's contract ---------------------------------------------------------------------------


class DictStep(Classifier):
    """A training step returning a dict with more than the loss, the batch as a dict."""

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        if torch.is_grad_enabled():  # not toma's one check, without gradients, that the loss adds up
            self.rows.append(len(inputs))
        if self.oom_above is not None and len(inputs) > self.oom_above:
            raise_fake_oom()
        return {"loss": F.cross_entropy(self.net(inputs), targets), "rows": len(inputs)}


def test_a_dict_output_keeps_its_other_keys_from_the_last_micro_batch():
    outputs = []

    class Outputs(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, output, batch, batch_idx):
            outputs.append(output)

    plain = DictStep()
    fit(plain, [Outputs()], steps=2)
    plain_outputs, outputs[:] = list(outputs), []
    module = DictStep(oom_above=16)
    fit(module, [MicroBatching(policy=Halving()), Outputs()], steps=2)
    assert [o["rows"] for o in outputs] == [16, 16]
    for got, expected in zip(outputs, plain_outputs, strict=True):
        assert float(got["loss"]) == pytest.approx(float(expected["loss"]), rel=RTOL)
    assert_same_parameters(module, plain)


class Failing(Classifier):
    def training_step(self, batch, batch_idx):
        raise ValueError("not a memory problem")


def test_an_error_that_is_not_out_of_memory_passes_through_and_the_step_is_restored():
    module = Failing()
    with pytest.raises(ValueError, match="not a memory problem"):
        fit(module, [MicroBatching()])
    assert "training_step" not in module.__dict__
    assert all(p.grad is None for p in module.parameters())


class Manual(Classifier):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


def test_manual_optimization_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="automatic optimization"):
        fit(Manual(), [MicroBatching()], steps=1)


def test_bad_options_are_refused_early_naming_the_argument():
    with pytest.raises(ValueError, match="initial_micro_batch"):
        MicroBatching(initial_micro_batch=0)
    with pytest.raises(ValueError, match="reduction"):
        MicroBatching(reduction="max")
    with pytest.raises(TypeError, match="policy"):
        MicroBatching(policy="halving")
    with pytest.raises(ValueError, match="weight"):
        MicroBatching(weight=len, reduction="sum")
    for flag in ("distributed", "log_micro_batch", "pack_tokens"):  # on/off settings: a bool, nothing read as one
        for value in ("yes", "x", 1, None):
            with pytest.raises(TypeError, match=f"^{flag} must be True or False"):
                MicroBatching(**{flag: value})


# --- as a plain run, on what Lightning's own tests exercise ---------------------------------------------------


def assert_same_metrics(trainer, reference):
    """The logged and the callback metrics of two fits: the same names, the same values."""
    for got, expected in (
        (trainer.logged_metrics, reference.logged_metrics),
        (trainer.callback_metrics, reference.callback_metrics),
    ):
        assert sorted(got) == sorted(expected)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=RTOL, atol=ATOL, msg=name)


def test_the_callback_pickles_and_a_copy_trains_as_the_original(tmp_path):
    """Lightning pickles its callbacks (`ddp_spawn`'s processes, a pickled Trainer): the copy keeps the options,
    the counts and the size found (no out-of-memory error again), and trains as a plain run."""
    import copy
    import pickle

    callback = MicroBatching(policy=Halving(), reduction="mean")
    fit(Classifier(oom_above=8), [callback])
    for copied in (pickle.loads(pickle.dumps(callback)), copy.deepcopy(callback)):
        assert isinstance(copied.policy, Halving) and copied.stats == callback.stats
        assert copied.stats.micro_batch == 8 and copied.stats.oom_retries == 2
        module = Classifier(oom_above=8)
        fit(module, [copied])
        assert copied.stats.micro_batch == 8 and copied.stats.oom_retries == 2, "it starts at the size found"
        assert_same_parameters(module, fit(Classifier()).lightning_module)


def test_a_copy_of_the_callback_keeps_what_its_sizing_policy_learned():
    import copy
    import pickle

    callback = MicroBatching()  # FitToMemory: what it learned is in stats and on the cache's entry
    fit(Classifier(oom_above=8), [callback], steps=1)
    for copied in (pickle.loads(pickle.dumps(callback)), copy.deepcopy(callback)):
        assert copied.stats.learned is not None and copied.stats == callback.stats
        assert copied.stats.learned is copied.cache.batchsize.learned


class Skipping(Classifier):
    """Skips every other batch by returning None, as Lightning lets a training step do."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 2 else loss


@pytest.mark.parametrize("initial_micro_batch", [None, 8])
def test_a_training_step_that_returns_none_skips_the_batch_as_a_plain_run_does(initial_micro_batch):
    plain = fit(Skipping(), log_every_n_steps=1)
    trainer = fit(Skipping(), [MicroBatching(initial_micro_batch)], log_every_n_steps=1)
    assert_same_parameters(trainer.lightning_module, plain.lightning_module)
    assert_same_metrics(trainer, plain)


class SkippingSomeRows(Classifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch[1][0] == 0 else loss  # decided by the first row: differs between micro-batches


def test_none_from_some_micro_batches_of_a_batch_and_a_loss_from_others_is_an_error():
    with pytest.raises(RuntimeError, match="returned None for .* micro-batches of a batch and a loss for the others"):
        fit(SkippingSomeRows(), [MicroBatching(initial_micro_batch=4)])


class Returning(Classifier):
    """A training step that returns what Lightning refuses."""

    def __init__(self, output):
        super().__init__()
        self.output = output

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        return self.output


@pytest.mark.parametrize("output", ["the loss", {"accuracy": torch.tensor(0.5)}], ids=["text", "dict-without-loss"])
@pytest.mark.parametrize("initial_micro_batch", [None, 8])
def test_an_output_lightning_refuses_reaches_lightning_and_its_own_error(output, initial_micro_batch):
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException) as plain:
        fit(Returning(output), steps=1)
    with pytest.raises(MisconfigurationException) as micro:
        fit(Returning(output), [MicroBatching(initial_micro_batch)], steps=1)
    assert str(micro.value) == str(plain.value)


class Reductions(Classifier):
    """Values logged with each reduction Lightning has, per step and per epoch."""

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = F.cross_entropy(self.net(inputs), targets)
        self.log("largest", inputs.abs().max(), reduce_fx="max", on_epoch=True)
        self.log("smallest", inputs.min(), on_step=True, on_epoch=True, reduce_fx=torch.min)
        self.log("rows", float(len(inputs)), on_step=True, on_epoch=True, reduce_fx="sum")
        self.log("mean", loss, on_step=True, on_epoch=True)
        return loss


class LogsDict(Classifier):
    """`log_dict`, and `log` with `batch_size=None` or the micro-batch's own size."""

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = F.cross_entropy(self.net(inputs), targets)
        self.log_dict({"twice": 2 * loss, "targets": targets.float().mean()}, on_step=True, on_epoch=True)
        self.log("unsized", loss, on_step=True, on_epoch=True, batch_size=None)
        self.log("sized", loss, on_step=True, on_epoch=True, batch_size=len(inputs))
        return loss


@pytest.mark.parametrize("module", [Reductions, LogsDict])
def test_logged_values_are_the_whole_batchs_when_it_is_split(module):
    """max/min/sum over the micro-batches, the mean weighted by rows; `log_dict` and `batch_size=None` too. The
    loader's last batch holds 8 rows, one micro-batch."""
    plain = fit(module(), batch_size=24, steps=6, log_every_n_steps=1)
    callback = MicroBatching(initial_micro_batch=8, log_micro_batch=False)
    trainer = fit(module(), [callback], batch_size=24, steps=6, log_every_n_steps=1)
    assert_same_parameters(trainer.lightning_module, plain.lightning_module)
    assert_same_metrics(trainer, plain)


class SumLoss(Classifier):
    """A summed loss, logged as it is returned (twice: the default mean and "max" reduce_fx, which Lightning
    applies across steps), and a per-row mean that is not the loss."""

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = F.cross_entropy(self.net(inputs), targets, reduction="sum")
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("largest_loss", loss, on_step=True, on_epoch=True, reduce_fx="max")
        self.log("per_row", loss / len(inputs), on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02)


def test_a_logged_value_that_is_the_returned_loss_is_combined_as_the_loss_is():
    """reduction="sum": the logged loss is the micro-batches' sum, whatever its reduce_fx; any other value
    keeps its reduce_fx rule (the per-row mean weighted by rows)."""
    plain = fit(SumLoss(), batch_size=24, steps=6, log_every_n_steps=1)
    callback = MicroBatching(initial_micro_batch=8, reduction="sum")
    trainer = fit(SumLoss(), [callback], batch_size=24, steps=6, log_every_n_steps=1)
    assert callback.stats.micro_batch == 8
    assert_same_parameters(trainer.lightning_module, plain.lightning_module)
    assert_same_metrics(trainer, plain)


class LogsMany(TokenMean):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log_dict({f"twice_{index}": 2 * loss for index in range(4)})
        return loss


def test_the_log_replay_counts_each_micro_batch_once_however_many_values_are_logged():
    """Each count may be a device synchronisation: the replay asks `weight=` once per micro-batch, as
    `toma.accumulate` does, not once per logged value and micro-batch."""
    calls = []

    def counted_tokens(batch):
        if torch.is_grad_enabled():  # not toma's one check, without gradients, that the loss adds up
            calls.append(len(batch["labels"]))
        return label_tokens(batch)

    def run(callbacks):
        trainer = quiet_trainer(2, callbacks)
        trainer.fit(LogsMany(), torch.utils.data.DataLoader(Padded(), batch_size=16))
        return trainer

    plain = run([])
    trainer = run([MicroBatching(initial_micro_batch=4, weight=counted_tokens)])
    assert calls == [4] * 16, "per step: 4 micro-batches counted by toma.accumulate, then by the replay"
    assert_same_parameters(trainer.lightning_module, plain.lightning_module)
    assert_same_metrics(trainer, plain)


class LogsTwice(Classifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("again", loss, prog_bar=False)
        self.log("again", loss, prog_bar=True)  # Lightning refuses one name logged with two sets of options
        return loss


@pytest.mark.parametrize("initial_micro_batch", [None, 8])
def test_a_name_logged_twice_in_a_step_meets_lightnings_own_error(initial_micro_batch):
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException) as plain:
        fit(LogsTwice(), steps=1)
    with pytest.raises(MisconfigurationException) as micro:
        fit(LogsTwice(), [MicroBatching(initial_micro_batch)], steps=1)
    assert "twice in `training_step`" in str(plain.value) and str(micro.value) == str(plain.value)


def test_the_micro_batch_size_is_not_among_the_logged_metrics_unless_asked_for():
    plain = fit(Classifier(), log_every_n_steps=1)
    callback = MicroBatching(initial_micro_batch=8)
    trainer = fit(Classifier(), [callback], log_every_n_steps=1)
    assert_same_metrics(trainer, plain)
    assert callback.stats.micro_batch == 8


def test_tensor_backward_is_called_once_per_batch_as_lightning_calls_it(monkeypatch):
    """Lightning calls `Tensor.backward` once per batch (hooks and tests count it); the micro-batches' own
    backward passes do not go through it."""
    calls = []
    backward = torch.Tensor.backward

    def counted(self, *args, **kwargs):
        calls.append(self.shape)
        return backward(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", counted)
    plain = fit(Classifier(), steps=3)
    assert len(calls) == 3
    calls.clear()
    module = Classifier()
    fit(module, [MicroBatching(initial_micro_batch=8)], steps=3)
    assert len(calls) == 3 and module.rows == [8] * 12
    assert_same_parameters(module, plain.lightning_module)


def test_a_program_that_patches_the_clock_sees_the_reads_of_a_plain_run(monkeypatch):
    """Lightning's tests simulate time by patching `time.monotonic` (time-based validation): toma's throttled
    free-memory reads between measurements must not advance it."""
    import time

    reads = []
    clock = time.monotonic

    def counted():
        reads.append(None)
        return clock()

    monkeypatch.setattr(time, "monotonic", counted)
    fit(Classifier(), steps=6)
    plain = len(reads)
    reads.clear()
    fit(Classifier(), [MicroBatching()], steps=6)
    assert len(reads) == plain


def test_a_training_step_set_on_the_instance_is_restored_after_the_fit():
    module = Classifier()
    calls = []

    def training_step(batch, batch_idx):
        calls.append(batch_idx)
        return Classifier.training_step(module, batch, batch_idx)

    module.training_step = training_step
    fit(module, [MicroBatching()])
    assert module.training_step is training_step and calls == [0, 1, 2, 3]
    assert_same_parameters(module, fit(Classifier()).lightning_module)


def kept_name(function):
    @functools.wraps(function)
    def decorated(*args, **kwargs):
        return function(*args, **kwargs)

    return decorated


class WithoutBatchIndex(Classifier):
    @kept_name
    def training_step(self, batch):  # Lightning reads the signature through `__wrapped__`: no batch_idx
        return Classifier.training_step(self, batch, None)


def test_a_decorated_training_step_without_batch_idx_is_called_as_lightning_calls_it():
    module = WithoutBatchIndex()
    fit(module, [MicroBatching(initial_micro_batch=16)])
    assert module.rows == [16] * 8
    assert_same_parameters(module, fit(WithoutBatchIndex()).lightning_module)


class Opaque:
    """A batch type toma cannot look into (Lightning moves it as it is)."""

    def __init__(self, items):
        self.inputs = torch.stack([inputs for inputs, _ in items])
        self.targets = torch.stack([targets for _, targets in items])


class OnOpaque(Classifier):
    def training_step(self, batch, batch_idx):
        return Classifier.training_step(self, (batch.inputs, batch.targets), batch_idx)


class OnIterator(Classifier):
    def training_step(self, dataloader_iter):
        batch, batch_idx, _ = next(dataloader_iter)
        inputs, targets = batch
        self.rows.append(len(inputs))
        return F.cross_entropy(self.net(inputs), targets)


@pytest.mark.parametrize("kind", ["opaque batch", "dataloader_iter"])
def test_a_batch_that_cannot_be_split_runs_whole_as_in_a_plain_run(kind):
    def run(callbacks):
        module = OnOpaque() if kind == "opaque batch" else OnIterator()
        data = loader().dataset
        batches = torch.utils.data.DataLoader(
            data, batch_size=BATCH, collate_fn=Opaque if kind == "opaque batch" else None
        )
        trainer = quiet_trainer(4, callbacks)
        trainer.fit(module, batches)
        return module

    plain = run([])
    module = run([MicroBatching(initial_micro_batch=8)])
    assert module.rows == [BATCH] * 4
    assert_same_parameters(module, plain)


@pytest.mark.cuda
@requires_cuda
def test_fp16_mixed_precision_on_a_gpu_trains_as_lightning_does_with_the_same_micro_batches():
    module = Classifier()
    fit(module, [MicroBatching(initial_micro_batch=8)], steps=2, accelerator="gpu", devices=1, precision="16-mixed")
    reference = hand_split_reference(accelerator="gpu", devices=1, precision="16-mixed")
    assert_same_parameters(module, reference)


# --- a real out-of-memory error -------------------------------------------------------------------------


@pytest.mark.slow
def test_under_a_real_cpu_memory_cap_the_plain_run_fails_and_micro_batching_trains_the_reference_step():
    out = run_python(
        WIDE_MLP_UNDER_A_CAP
        + """
import gc, logging
import lightning.pytorch as pl
from toma import should_reduce_batch_size
from toma.integrations.lightning import MicroBatching
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

class Wide(pl.LightningModule):
    def __init__(self, net):
        super().__init__()
        self.net = net
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

def fit(net, x, y, callbacks):
    module = Wide(net)
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, callbacks=callbacks, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x)))
    return module

# Outside the cap: the reference step, and a small fit that has Lightning import and build what it keeps.
reference = make_model()
F.cross_entropy(reference(inputs), targets).backward()
torch.optim.SGD(reference.parameters(), lr=0.5).step()
reference_state = [p.detach().clone() for p in reference.parameters()]
del reference
fit(nn.Linear(32, 10), inputs[:64], targets[:64], [MicroBatching()])

set_cpu_memory_headroom(192 / 1024)
try:
    fit(make_model(), inputs, targets, [])
    plain = "trained"
except Exception as error:
    plain = "out of memory" if should_reduce_batch_size(error) else repr(error)
    del error
gc.collect()
callback = MicroBatching()
module = fit(make_model(), inputs, targets, [callback])
close = [bool(torch.allclose(p, r, rtol=1e-5, atol=1e-6)) for p, r in zip(module.parameters(), reference_state)]
print(json.dumps(dict(plain=plain, close=close, micro_batch=callback.stats.micro_batch, messages=messages)))
""",
        timeout=300,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["plain"] == "out of memory", result["plain"]
    ooms = [m for m in result["messages"] if "ran out of memory" in m]
    assert ooms and all("can't allocate memory" in m and m.startswith("MicroBatching") for m in ooms), ooms
    assert 0 < result["micro_batch"] < 16384
    assert all(result["close"]), "the step must equal the full-batch reference step"


def two_rank_example(name: str, *args: str) -> tuple:
    """An example that makes Lightning start a second CPU rank: its stdout and the JSON line each rank printed."""
    import os
    import subprocess
    import sys

    from helpers import REPO

    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", name), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads(found) for found in re.findall(r'\{"rank"[^}]*\}', done.stdout)]  # the ranks share stdout
    assert sorted(r["rank"] for r in ranks) == [0, 1], done.stdout
    return done.stdout, ranks


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ddp_ranks_agree_on_the_micro_batch_and_match_plain_ddp():
    """`examples/lightning_ddp.py`: two gloo ranks under Lightning's DDP, rank 0 alone out of memory above 8 rows;
    both ranks train at 8 and end with the plain DDP run's parameters."""
    _, ranks = two_rank_example("lightning_ddp.py")
    assert all(r["micro_batch"] == 8 and r["same_parameters_as_plain_ddp"] for r in ranks), ranks


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("gradient_sync", ["auto", "sharded"])
def test_fsdp2_ranks_one_of_them_capped_for_real_agree_and_match_plain_fsdp2(gradient_sync):
    """`examples/lightning_fsdp2.py`: two gloo ranks under ModelParallelStrategy (FSDP2), rank 1 under a real
    address-space cap; both ranks retry together, train at the same micro-batch and end with the plain FSDP2 run's
    parameters (gradient_sync="micro_batch" is the same wiring: `python examples/lightning_fsdp2.py
    --gradient-sync micro_batch`, and tests/accumulation/test_fsdp2.py for the strategy)."""
    out, ranks = two_rank_example("lightning_fsdp2.py", "--gradient-sync", gradient_sync)
    assert "[rank 1] capped" in out
    assert ranks[0]["micro_batch"] == ranks[1]["micro_batch"] < 4096, ranks
    assert all(r["oom_retries"] >= 1 and r["same_parameters_as_plain_fsdp2"] for r in ranks), ranks


def test_gradient_sync_is_checked_where_it_enters():
    with pytest.raises(ValueError, match="gradient_sync must be one of 'auto', 'logical_batch', 'micro_batch'"):
        MicroBatching(gradient_sync="each")
    assert MicroBatching(gradient_sync="micro_batch").gradient_sync == "micro_batch"


def test_fsdp1_and_other_strategies_that_shard_or_accumulate_themselves_are_refused_naming_what_works():
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from toma.integrations.lightning import _check_strategy

    with pytest.raises(ValueError, match=r"FSDPStrategy shards or accumulates .*\(FSDP1, DeepSpeed\)") as refused:
        _check_strategy(FSDPStrategy())
    assert "ModelParallelStrategy" in str(refused.value), "the message names the FSDP2 strategy that works"
    _check_strategy(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))  # accepted


def test_every_option_given_to_micro_batching_reaches_each_steps_accumulation(monkeypatch):
    """The options are checked once where they enter and reach each batch's accumulation unchanged."""
    from toma.integrations import lightning as lightning_module

    seen = []
    real = lightning_module.accumulate

    def recording(func, batch, options, sizing, *rest):
        seen.append((options, sizing))
        return real(func, batch, options, sizing, *rest)

    monkeypatch.setattr(lightning_module, "accumulate", recording)
    policy = Halving()
    callback = MicroBatching(
        initial_micro_batch=8, policy=policy, reduction="sum", distributed=False, pack_tokens=False,
        gradient_sync="logical_batch", groups="pairs", split_for_padding=False, levers=False,
    )  # fmt: skip
    fit(Classifier(), [callback], steps=2)
    weighted = MicroBatching(weight=lambda batch: len(batch[1]))
    fit(Classifier(), [weighted], steps=1)
    assert len(seen) == 3
    for options, sizing in seen[:2]:
        assert options.reduction == "sum" and options.groups == "pairs" and options.split_for_padding is False
        assert options.lengths is None and options.check_split is False and options.levers is False
        assert sizing.initial == 8 and sizing.runner.policy is policy
    assert callback.gradient_sync == "logical_batch" and callback.settings.gradient_sync == "logical_batch"
    assert seen[2][0].weight is weighted.weight and seen[2][0].reduction == "mean" and seen[2][0].check_split
    assert seen[2][0].levers is True and callback.levers is False
    with pytest.raises(TypeError, match="levers must be True or False"):
        callback.levers = 1


# --- a loss that couples rows: gradient caching through the LightningModule's own forward ----------------------


class InBatchNegatives(pl.LightningModule):
    """Each query against every document of the batch, the encoder called twice as `self(...)`; its forward runs out
    of memory (a stand-in) above `oom_above` rows."""

    def __init__(self, oom_above=None):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))
        self.oom_above = oom_above
        self.rows = []

    def forward(self, x):
        self.rows.append(len(x))
        if self.oom_above is not None and len(x) > self.oom_above:
            raise_fake_oom()
        return F.normalize(self.encoder(x), dim=-1)

    def training_step(self, batch, batch_idx):
        queries, documents = batch
        scores = self(queries) @ self(documents).T / 0.1
        loss = F.cross_entropy(scores, torch.arange(len(queries)))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def pair_loader():
    generator = torch.Generator().manual_seed(2)
    data = torch.utils.data.TensorDataset(
        torch.randn(ROWS, 8, generator=generator), torch.randn(ROWS, 8, generator=generator)
    )
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def test_in_batch_negatives_train_by_gradient_caching_to_the_plain_runs_parameters_under_oom(tmp_path):
    """The split check finds the coupling; the LightningModule's forward (`self(...)`) is cut into micro-batches of at
    most 5 rows, the loss computed once on the whole batch: a plain run's parameters, its logged losses."""
    plain = quiet_trainer(4, logger=CSVLogger(tmp_path / "plain"), log_every_n_steps=1)
    plain.fit(InBatchNegatives(), pair_loader())
    module, callback = InBatchNegatives(oom_above=5), MicroBatching(policy=Halving())
    trainer = quiet_trainer(4, [callback], logger=CSVLogger(tmp_path / "toma"), log_every_n_steps=1)
    trainer.fit(module, pair_loader())
    assert_same_parameters(module, plain.lightning_module)
    assert callback.stats.split_check.coupled and "gradient caching" in str(callback.stats)
    assert max(module.rows[-16:]) <= 5  # the last step's calls, cut
    assert_same_metrics(trainer, plain)
