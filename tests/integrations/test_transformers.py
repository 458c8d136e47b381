"""TomaTrainer and TomaTrainerMixin against the plain Hugging Face Trainer on the same batches.

Models from configs in code (a 2-layer GPT-2, a 2-layer BERT classifier, hidden size 32, vocabulary 100), data
made here, no downloads. The optimizer is SGD: its step is linear in the gradient, so parameters that agree to
rtol 1e-5 after several steps mean gradients that agree (Adam's normalisation would blow rounding noise in
near-zero gradients up to a full step).
"""

import functools
import gc
import json
import logging
import math
import re
import tempfile

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", minversion="5.23")  # the integration refuses older ones
pytest.importorskip("accelerate")

from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from toma import CoupledRows, Halving  # noqa: E402
from toma.integrations.transformers import TomaTrainer, TomaTrainerMixin  # noqa: E402

from helpers import COLLECT_TOMA_LOG, raise_fake_oom, requires_cuda, run_python  # noqa: E402

RTOL, ATOL = 1e-5, 1e-7
VOCAB, ROWS = 100, 48


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="module")
def frozen_imports():
    """After an out-of-memory error toma collects garbage; with transformers imported that walks a million objects
    (half a second). Those are the modules' own and never garbage: set aside, the tests run in a third the time."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)


def bert(num_labels: int = 3) -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=num_labels,
    )
    return BertForSequenceClassification(config)


def texts(count: int = ROWS, seed: int = 1, classes: int = 0) -> list:
    """Token rows of 2 to 19 tokens (padded per batch to very different widths), with a class for BERT."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 20, (count,), generator=generator).tolist()
    rows = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=generator)} for n in lengths]
    if classes:
        for row in rows:
            row["labels"] = int(row["input_ids"].sum()) % classes
    return rows


def pad(rows: list) -> dict:
    """A causal LM's collate function: padded per batch, labels -100 where padded."""
    ids = [row["input_ids"] for row in rows]
    labels = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=-100)
    return {
        "input_ids": torch.nn.utils.rnn.pad_sequence(ids, batch_first=True),
        "attention_mask": (labels != -100).long(),
        "labels": labels,
    }


def pad_classes(rows: list) -> dict:
    batch = pad(rows)
    batch["labels"] = torch.tensor([row["labels"] for row in rows])
    return batch


def arguments(tmp_path, **overrides) -> TrainingArguments:
    settings = dict(
        output_dir=str(tmp_path),
        max_grad_norm=0.0,  # no clipping: it would hide a gradient off by a factor
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        max_steps=3,
        learning_rate=0.5,
        optim="sgd",
        report_to="none",
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return TrainingArguments(**settings)


def oom_above(model: torch.nn.Module, rows: int) -> list:
    """A forward pass of more than `rows` rows raises CUDA's out-of-memory error; returns the rows of each call."""
    seen = []

    def hook(module, args, kwargs):
        n = kwargs["input_ids"].shape[0]
        seen.append(n)
        if n > rows:
            raise_fake_oom()

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def train(cls, tmp_path, make=gpt2, classes=0, oom_rows=None, options=None, rows=True, **overrides):
    """Train a fresh model for 3 steps on batches of 8 rows (`classes`: BERT's classes, else a causal LM's text).
    `rows`: a toma trainer's micro-batches are rows in the loader's order (`toma_pack_tokens=False`), which the
    tests of sizes in rows count on; False leaves its default, packing by tokens."""
    options = dict(options or {})
    if rows and issubclass(cls, TomaTrainerMixin):
        options.setdefault("toma_pack_tokens", False)
    model = make()
    seen = oom_above(model, oom_rows) if oom_rows is not None else None
    trainer = cls(
        model=model,
        args=arguments(tmp_path, **overrides),
        train_dataset=texts(classes=classes),
        data_collator=pad_classes if classes else pad,
        **options,
    )
    trainer.train()
    return model, trainer, seen


@functools.lru_cache(maxsize=None)
def plain_run(cls=Trainer, make=None, **overrides):
    """The plain Trainer's parameters and training losses, once per setting."""
    with tempfile.TemporaryDirectory() as output:
        model, trainer, _ = train(cls, output, make=make or gpt2, **overrides)
    return [p.detach().clone() for p in model.parameters()], training_losses(trainer)


def reference_model(parameters, make):
    """A model holding the plain run's parameters."""
    model = make()
    with torch.no_grad():
        for p, q in zip(model.parameters(), parameters, strict=True):
            p.copy_(q)
    return model


def assert_same_parameters(model, reference):
    reference = reference if isinstance(reference, list) else list(reference.parameters())
    for (name, p), q in zip(model.named_parameters(), reference, strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def training_losses(trainer) -> list:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


# --- training: the same parameters as the plain Trainer -----------------------------------------------


def test_with_no_out_of_memory_each_batch_trains_whole_to_the_plain_trainers_parameters(tmp_path):
    reference, losses = plain_run()
    model, trainer, seen = train(TomaTrainer, tmp_path, oom_rows=10**6)
    assert_same_parameters(model, reference)
    assert set(seen) == {8} and trainer.toma_stats.oom_retries == 0
    assert training_losses(trainer) == pytest.approx(losses, rel=1e-6)


def test_packed_by_tokens_under_injected_ooms_the_micro_batches_are_trimmed_and_train_the_plain_parameters(tmp_path):
    reference, losses = plain_run()
    widths = []

    def recorded_gpt2():
        model = gpt2()
        model.register_forward_pre_hook(lambda m, a, k: widths.append(k["input_ids"].shape), with_kwargs=True)
        return model

    options = dict(toma_policy=Halving())  # packing by tokens is the default
    model, trainer, seen = train(TomaTrainer, tmp_path, make=recorded_gpt2, oom_rows=3, options=options, rows=False)
    assert_same_parameters(model, reference)
    assert training_losses(trainer) == pytest.approx(losses, rel=1e-5)
    assert trainer.toma_stats.oom_retries >= 1 and max(seen) > 3 and max(seen[-3:]) <= 3
    full = max(shape[1] for shape in widths)
    assert any(shape[1] < full for shape in widths), "micro-batches trimmed to their longest row"


def test_with_packing_turned_off_every_micro_batch_has_the_loader_batchs_width(tmp_path):
    reference, _ = plain_run()
    widths = {"plain": set(), "toma": set()}

    def recorded(into):
        def make():
            model = gpt2()
            model.register_forward_pre_hook(lambda m, a, k: widths[into].add(k["input_ids"].shape[1]), with_kwargs=True)
            return model

        return make

    train(Trainer, tmp_path / "plain", make=recorded("plain"))
    options = dict(toma_policy=Halving(), toma_pack_tokens=False)
    model, _, seen = train(
        TomaTrainer, tmp_path / "toma", make=recorded("toma"), oom_rows=3, options=options, rows=False
    )
    assert_same_parameters(model, reference)
    assert seen[:3] == [8, 4, 2], "rows, halved, in the loader's order"
    assert widths["toma"] == widths["plain"], "every micro-batch as wide as its loader batch: nothing trimmed"


def test_packed_by_tokens_with_group_by_length_trains_the_plain_trainers_parameters(tmp_path):
    """Transformers 5 spells `group_by_length=True` as `train_sampling_strategy="group_by_length"`."""
    reference, losses = plain_run(train_sampling_strategy="group_by_length")
    options = dict(toma_pack_tokens=True, toma_policy=Halving())
    model, trainer, _ = train(
        TomaTrainer, tmp_path, oom_rows=3, options=options, rows=False, train_sampling_strategy="group_by_length"
    )
    assert_same_parameters(model, reference)
    assert training_losses(trainer) == pytest.approx(losses, rel=1e-5) and trainer.toma_stats.oom_retries >= 1


def test_injected_out_of_memory_errors_split_the_batch_and_give_the_plain_trainers_parameters(tmp_path):
    reference, losses = plain_run()
    model, trainer, seen = train(TomaTrainer, tmp_path, oom_rows=3, options=dict(toma_policy=Halving()))
    assert seen[:3] == [8, 4, 2] and set(seen[3:]) == {2}, "8 and 4 run out of memory; 2 fits and is kept"
    assert trainer.toma_stats.micro_batch == 2 and trainer.toma_stats.oom_retries == 2
    assert_same_parameters(model, reference)
    assert training_losses(trainer) == pytest.approx(losses, rel=1e-5)


def test_a_bert_classifier_under_injected_out_of_memory_errors_matches_the_plain_trainer(tmp_path):
    reference, _ = plain_run(make=bert, classes=3)
    model, trainer, _ = train(TomaTrainer, tmp_path, make=bert, classes=3, oom_rows=3)
    assert trainer.toma_stats.micro_batch <= 3 and trainer.toma_stats.oom_retries >= 1
    assert_same_parameters(model, reference)


def no_loss_kwargs() -> GPT2LMHeadModel:
    """A causal LM whose loss the Trainer does not normalise by num_items_in_batch: a mean per batch."""
    model = gpt2()
    model.accepts_loss_kwargs = False
    return model


@pytest.mark.parametrize("make", [gpt2, no_loss_kwargs], ids=["num_items_in_batch", "per-batch mean"])
def test_gradient_accumulation_over_padded_batches_counts_tokens_as_the_trainer_does(tmp_path, make):
    """Batches of 8 rows padded to their own widths, 2 per optimizer step: with num_items_in_batch (the window's
    label tokens) or without (a token mean per batch, divided by the accumulation steps)."""
    reference, losses = plain_run(make=make, gradient_accumulation_steps=2)
    model, trainer, _ = train(TomaTrainer, tmp_path, make=make, oom_rows=3, gradient_accumulation_steps=2)
    assert trainer.toma_stats.micro_batch <= 3
    assert_same_parameters(model, reference)
    assert training_losses(trainer) == pytest.approx(losses, rel=1e-5)


def token_sum_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """A compute_loss of one's own: cross-entropy plus a z-loss, summed over tokens, normalised by the window's
    tokens (num_items_in_batch) as the Trainer's docs ask."""
    labels = inputs.pop("labels")
    outputs = model(**inputs)
    logits, targets = outputs.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    kept = targets != -100
    tokens = F.cross_entropy(logits, targets, ignore_index=-100, reduction="none")
    z = torch.logsumexp(logits, dim=-1).square() * kept
    count = num_items_in_batch if num_items_in_batch is not None else kept.sum()
    loss = (tokens.sum() + 1e-2 * z.sum()) / count
    return (loss, outputs) if return_outputs else loss


def sequence_mean_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """Each row's token mean, averaged over the rows: a mean over rows, not tokens."""
    labels = inputs.pop("labels")
    outputs = model(**inputs)
    logits, targets = outputs.logits[:, :-1], labels[:, 1:]
    tokens = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
    per_row = tokens.sum(1) / (targets != -100).sum(1).clamp(min=1)
    loss = per_row.mean()
    return (loss, outputs) if return_outputs else loss


def fixed_scale_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """Token losses summed and scaled by a constant: normalised by compute_loss itself, so batches add up."""
    labels = inputs.pop("labels")
    outputs = model(**inputs)
    logits, targets = outputs.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    loss = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum") / 200
    return (loss, outputs) if return_outputs else loss


class PlainTokenSum(Trainer):
    compute_loss = token_sum_loss


class TomaTokenSum(TomaTrainer):
    compute_loss = token_sum_loss


class PlainSequenceMean(Trainer):
    compute_loss = sequence_mean_loss
    loss_is_scaled_for_ga = False  # a mean per batch: the Trainer divides by the accumulation steps


class TomaSequenceMean(TomaTrainer):
    compute_loss = sequence_mean_loss
    loss_is_scaled_for_ga = False


class PlainFixedScale(Trainer):
    compute_loss = fixed_scale_loss
    loss_is_scaled_for_ga = True  # normalised already: the Trainer adds the batches' losses


class TomaFixedScale(TomaTrainer):
    compute_loss = fixed_scale_loss
    loss_is_scaled_for_ga = True


def rows_of(batch):
    return batch["input_ids"].shape[0]


@pytest.mark.parametrize(
    "plain_class, toma_class, options",
    [
        (PlainTokenSum, TomaTokenSum, {}),
        (PlainSequenceMean, TomaSequenceMean, dict(toma_weight=rows_of)),
        (PlainFixedScale, TomaFixedScale, {}),
    ],
    ids=["token sum over num_items_in_batch", "mean over rows with toma_weight", "declared scaled: a sum"],
)
def test_a_compute_loss_override_is_called_per_micro_batch_and_weighted_as_its_mean(
    tmp_path, plain_class, toma_class, options
):
    make = no_loss_kwargs if plain_class is PlainFixedScale else gpt2  # no num_items_in_batch: its own scale
    reference, _ = plain_run(plain_class, make=make, gradient_accumulation_steps=2)
    model, trainer, _ = train(
        toma_class, tmp_path, make=make, oom_rows=3, options=options, gradient_accumulation_steps=2
    )
    assert trainer.toma_stats.micro_batch <= 3
    assert_same_parameters(model, reference)
    data = texts(16, seed=4)
    expected = plain_class(model=reference_model(reference, make), args=arguments(tmp_path), data_collator=pad)
    assert trainer.evaluate(data)["eval_loss"] == pytest.approx(expected.evaluate(data)["eval_loss"], rel=1e-5)


# --- what the Trainer counts: a model's own loss, terms added once per batch, no silent zero -------------------


class RegressionConfig(transformers.PretrainedConfig):
    model_type = "toma-test-regression"

    def __init__(self, features: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.features = features


class Regression(transformers.PreTrainedModel):
    """A model that computes its own loss (a mean squared error over its rows), with no loss type the Trainer knows:
    `PreTrainedModel.loss_function` falls back to the causal LM's loss for it, which shifts labels; its own does not.
    Takes loss keywords (`**kwargs`) and ignores num_items_in_batch."""

    config_class = RegressionConfig

    def __init__(self, config):
        super().__init__(config)
        self.linear = torch.nn.Linear(config.features, 1)
        self.post_init()

    def forward(self, input_x, labels=None, **kwargs):
        y = self.linear(input_x).squeeze(-1)
        return {"loss": None if labels is None else F.mse_loss(y, labels), "logits": y}


class RegressionWithoutLossKeywords(Regression):
    def forward(self, input_x, labels=None):
        return super().forward(input_x, labels)


def regression_rows(count: int = 24) -> list:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(count, 4, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(count, generator=generator)
    return [{"input_x": row, "labels": label} for row, label in zip(x, y, strict=True)]


def train_regression(cls, tmp_path, make=Regression, oom_rows=None, **overrides):
    torch.manual_seed(0)
    model = make(RegressionConfig())
    if oom_rows is not None:

        def refuse(module, args, kwargs):
            if kwargs["input_x"].shape[0] > oom_rows:
                raise_fake_oom()

        model.register_forward_pre_hook(refuse, with_kwargs=True)
    settings = dict(max_steps=4, learning_rate=0.1, lr_scheduler_type="constant")
    settings.update(overrides)
    trainer = cls(model=model, args=arguments(tmp_path, **settings), train_dataset=regression_rows())
    trainer.train()
    return model, trainer


@pytest.mark.parametrize("make", [Regression, RegressionWithoutLossKeywords], ids=["loss keywords", "none"])
@pytest.mark.parametrize(
    "setting",
    [dict(per_device_train_batch_size=1), dict(oom_rows=10**6), dict(oom_rows=3, gradient_accumulation_steps=2)],
    ids=["one row per batch", "no out-of-memory error", "split, accumulated"],
)
def test_a_model_with_its_own_loss_trains_as_the_plain_trainer_trains_it(tmp_path, make, setting):
    """A model whose loss the Trainer cannot name was counted as a causal LM's, one row short per micro-batch: with
    one row per batch nothing trained (loss and gradient 0, silently), and whole batches were weighted 7/8."""
    setting = dict(setting)
    oom_rows = setting.pop("oom_rows", None)
    reference, plain = train_regression(Trainer, tmp_path / "plain", make=make, **setting)
    model, trainer = train_regression(TomaTrainer, tmp_path / "toma", make=make, oom_rows=oom_rows, **setting)
    if oom_rows == 3:
        assert trainer.toma_stats.micro_batch <= 3 and trainer.toma_stats.oom_retries >= 1
    assert_same_parameters(model, reference)
    assert training_losses(trainer) == pytest.approx(training_losses(plain), rel=1e-5)
    assert all(loss > 0 for loss in training_losses(trainer))


def with_batch_terms(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """The Trainer's loss plus two terms added once per batch: an L2 penalty on the weights and an auxiliary loss,
    a mean over the batch's label tokens (a z-loss) that num_items_in_batch does not normalise."""
    labels = inputs["labels"]
    loss, outputs = Trainer.compute_loss(self, model, inputs, True, num_items_in_batch)
    targets = labels[:, 1:] != -100
    z = torch.logsumexp(outputs.logits[:, :-1], dim=-1).square()
    auxiliary = (z * targets).sum() / targets.sum()
    penalty = sum(p.square().sum() for p in model.parameters())
    loss = loss + 1e-2 * auxiliary + 1e-3 * penalty
    return (loss, outputs) if return_outputs else loss


class PlainBatchTerms(Trainer):
    compute_loss = with_batch_terms


class TomaBatchTerms(TomaTrainer):
    compute_loss = with_batch_terms


@pytest.mark.parametrize("make", [gpt2, no_loss_kwargs], ids=["model_accepts_loss_kwargs", "no loss keywords"])
def test_terms_added_once_per_batch_are_added_once_per_logical_batch_not_per_micro_batch(tmp_path, make):
    reference, losses = plain_run(PlainBatchTerms, make=make, gradient_accumulation_steps=2)
    model, trainer, _ = train(TomaBatchTerms, tmp_path, make=make, oom_rows=3, gradient_accumulation_steps=2)
    assert trainer.toma_stats.micro_batch <= 3
    assert_same_parameters(model, reference)
    assert training_losses(trainer) == pytest.approx(losses, rel=1e-5)


def test_a_toma_weight_that_counts_nothing_in_a_labelled_batch_is_an_error_not_a_silent_zero(tmp_path):
    with pytest.raises(ValueError, match="toma_weight counted 0 items in a batch of 8 rows whose labels hold"):
        train(TomaTrainer, tmp_path, options=dict(toma_weight=lambda batch: 0))


def test_a_toma_weight_whose_micro_batches_do_not_add_up_to_the_batch_is_an_error(tmp_path):
    def mean_length(batch):  # a mean, not a count: the micro-batches' shares would not add up to 1
        return batch["attention_mask"].sum(1).float().mean()

    with pytest.raises(ValueError, match="must count a batch's items row by row"):
        train(TomaTrainer, tmp_path, oom_rows=3, options=dict(toma_weight=mean_length))


class Tagging(Trainer):
    """A Trainer subclass of one's own: counts its compute_loss calls and the rows they saw."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.rows_seen = getattr(self, "rows_seen", []) + [inputs["input_ids"].shape[0]]
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class TomaTagging(TomaTrainerMixin, Tagging):
    pass


def test_the_mixin_on_a_trainer_subclass_keeps_its_hooks_and_gives_the_plain_parameters(tmp_path):
    reference, _ = plain_run(gradient_accumulation_steps=2)
    model, trainer, _ = train(TomaTagging, tmp_path, oom_rows=3, gradient_accumulation_steps=2)
    assert_same_parameters(model, reference)
    assert max(trainer.rows_seen) == 8 and trainer.rows_seen[-4:] == [2, 2, 2, 2], "its compute_loss per micro-batch"


def test_the_training_logs_carry_the_micro_batch_size_and_the_retries_when_asked(tmp_path):
    options = dict(toma_policy=Halving(), toma_log_micro_batch=True)
    _, trainer, _ = train(TomaTrainer, tmp_path, oom_rows=3, options=options)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 3
    assert [(entry["micro_batch"], entry["toma_oom_retries"]) for entry in logged] == [(2, 2)] * 3
    assert all("micro_batch" not in entry for entry in trainer.state.log_history if "train_loss" in entry)


class Recorder(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_callbacks_get_the_micro_batch_size_in_their_logs_when_asked(tmp_path):
    recorder = Recorder()
    train(TomaTrainer, tmp_path, options=dict(callbacks=[recorder], toma_log_micro_batch=True))
    assert [entry["micro_batch"] for entry in recorder.logs if "loss" in entry] == [8, 8, 8]


def test_by_default_the_logs_hold_the_plain_trainers_keys_only(tmp_path):
    plain, toma = Recorder(), Recorder()
    train(Trainer, tmp_path / "plain", options=dict(callbacks=[plain]))
    _, trainer, _ = train(TomaTrainer, tmp_path / "toma", oom_rows=3, options=dict(callbacks=[toma]))
    assert trainer.toma_stats.micro_batch <= 3 and trainer.toma_stats.oom_retries >= 1
    assert [sorted(entry) for entry in toma.logs] == [sorted(entry) for entry in plain.logs]


def test_backward_goes_through_the_accelerator_once_per_micro_batch(tmp_path, monkeypatch):
    model = gpt2()
    oom_above(model, 3)
    trainer = TomaTrainer(
        model=model,
        args=arguments(tmp_path, max_steps=2),
        train_dataset=texts(),
        data_collator=pad,
        toma_pack_tokens=False,
    )
    calls = []
    backward = trainer.accelerator.backward
    monkeypatch.setattr(
        trainer.accelerator,
        "backward",
        lambda loss, **kw: calls.append(loss.grad_fn is not None) or backward(loss, **kw),
    )
    trainer.train()
    assert calls.count(True) == 8, "8 rows in micro-batches of 2, two steps: the OOMed attempts never reach backward"
    # and once per step the Trainer's own backward of the batch's loss, detached: it reaches no parameter
    assert calls.count(False) == 2


# --- evaluation and prediction -------------------------------------------------------------------------


def accuracy(prediction):
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def test_evaluate_and_predict_under_injected_out_of_memory_equal_the_plain_trainer(tmp_path):
    data = texts(20, seed=3, classes=3)  # 8, 8 and 4 rows per evaluation batch
    plain = Trainer(model=bert(), args=arguments(tmp_path), data_collator=pad_classes, compute_metrics=accuracy)
    model = bert()
    seen = oom_above(model, 3)
    trainer = TomaTrainer(model=model, args=arguments(tmp_path), data_collator=pad_classes, compute_metrics=accuracy)
    expected, got = plain.evaluate(data), trainer.evaluate(data)
    assert max(seen) == 8 and seen[-1] <= 3, "the batches ran out of memory and were chunked"
    assert got["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-6)
    assert got["eval_accuracy"] == expected["eval_accuracy"]
    expected, got = plain.predict(data), trainer.predict(data)
    torch.testing.assert_close(
        torch.as_tensor(got.predictions), torch.as_tensor(expected.predictions), rtol=1e-5, atol=1e-6
    )
    assert (got.label_ids == expected.label_ids).all()
    assert model.training is False and all(p.grad is None for p in model.parameters())


def test_the_evaluation_loss_of_padded_batches_averages_over_tokens_across_chunks(tmp_path):
    data = texts(16, seed=4)
    plain = Trainer(model=gpt2(), args=arguments(tmp_path), data_collator=pad)
    model = gpt2()
    seen = oom_above(model, 3)
    trainer = TomaTrainer(model=model, args=arguments(tmp_path), data_collator=pad)
    expected, got = plain.evaluate(data), trainer.evaluate(data)
    assert seen[-1] <= 3
    assert got["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-6)
    expected, got = plain.predict(data), trainer.predict(data)
    torch.testing.assert_close(
        torch.as_tensor(got.predictions), torch.as_tensor(expected.predictions), rtol=1e-5, atol=1e-6
    )


# --- errors ----------------------------------------------------------------------------------------------


def test_toma_options_are_checked_early_with_their_names(tmp_path):
    settings = dict(model=gpt2(), args=arguments(tmp_path))
    with pytest.raises(TypeError, match="toma_policy"):
        TomaTrainer(**settings, toma_policy="fit")
    with pytest.raises(ValueError, match="toma_initial_micro_batch"):
        TomaTrainer(**settings, toma_initial_micro_batch=0)
    with pytest.raises(TypeError, match="toma_weight"):
        TomaTrainer(**settings, toma_weight=3)
    with pytest.raises(TypeError, match="toma_log_micro_batch"):
        TomaTrainer(**settings, toma_log_micro_batch="yes")
    with pytest.raises(TypeError, match="toma_polcy.*toma_policy="):
        TomaTrainer(**settings, toma_polcy=Halving())


def test_the_mixin_must_come_before_the_trainer_and_be_on_one():
    with pytest.raises(TypeError, match="TomaTrainerMixin must come before transformers.Trainer"):

        class Wrong(Trainer, TomaTrainerMixin):
            pass

    class Alone(TomaTrainerMixin):
        pass

    with pytest.raises(TypeError, match="without transformers.Trainer"):
        Alone()


def test_a_subclass_training_step_runs_around_the_micro_batches_once_per_step(tmp_path):
    """A Trainer subclass's own training_step (TRL's wrap theirs: activation offloading, GRPO's step counter) runs
    as in a plain run, once per step; inside it the Trainer's compute_loss call is what toma splits."""

    class Wrapping(Trainer):
        def training_step(self, *args, **kwargs):
            self.wrapped = getattr(self, "wrapped", 0) + 1
            return super().training_step(*args, **kwargs)

    class Mixed(TomaTrainerMixin, Wrapping):
        pass

    plain_model, model = gpt2(), gpt2()
    plain = Wrapping(model=plain_model, args=arguments(tmp_path, max_steps=2), train_dataset=texts(), data_collator=pad)
    plain.train()
    oom_above(model, 3)
    trainer = Mixed(model=model, args=arguments(tmp_path, max_steps=2), train_dataset=texts(), data_collator=pad)
    trainer.train()
    assert trainer.wrapped == plain.wrapped == 2
    assert trainer.toma_stats.oom_retries >= 1
    assert_same_parameters(model, plain_model)


def test_a_training_step_that_never_reaches_compute_loss_is_named_in_a_warning(tmp_path, caplog):
    class Own(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            return torch.zeros(())

    class Mixed(TomaTrainerMixin, Own):
        pass

    trainer = Mixed(model=gpt2(), args=arguments(tmp_path, max_steps=1), train_dataset=texts(), data_collator=pad)
    with caplog.at_level(logging.WARNING, logger="toma"):
        trainer.train()
    assert any("did not reach the Trainer's call of compute_loss" in r.getMessage() for r in caplog.records)


def test_setups_that_cannot_be_split_are_refused_naming_the_setting(tmp_path):
    with pytest.raises(ValueError, match="optim='lomo'"):
        TomaTrainer(model=gpt2(), args=arguments(tmp_path, optim="lomo"))


def test_fsdp1_through_accelerate_is_refused_and_fsdp2_taken_and_micro_batch_needs_fsdp2(tmp_path):
    """accelerate turns FSDP on for GPU jobs only: the checks are shown here with its plugin set by hand."""
    trainer = TomaTrainer(model=gpt2(), args=arguments(tmp_path))
    trainer.is_fsdp_enabled = True
    try:
        trainer.accelerator.state.fsdp_plugin = type("Plugin", (), {"fsdp_version": 1})()
        with pytest.raises(ValueError, match=r"under FSDP1 \(args.fsdp without fsdp_version 2\).*FSDP2 .* supported"):
            trainer._toma_check_setup()
        trainer.accelerator.state.fsdp_plugin = type("Plugin", (), {"fsdp_version": 2})()
        trainer._toma_check_setup()  # taken
        trainer.toma_gradient_sync = "micro_batch"
        trainer._toma_check_setup()
        trainer.is_fsdp_enabled = False
        with pytest.raises(ValueError, match="toma_gradient_sync='micro_batch', which is for FSDP2's gradients"):
            trainer._toma_check_setup()
        trainer.toma_gradient_sync = "sharded"
        with pytest.raises(ValueError, match="toma_gradient_sync='sharded', which is for FSDP2's gradients"):
            trainer._toma_check_setup()
    finally:
        trainer.accelerator.state.fsdp_plugin = None
    with pytest.raises(ValueError, match="toma_gradient_sync must be one of 'auto', 'logical_batch', 'micro_batch'"):
        TomaTrainer(model=gpt2(), args=arguments(tmp_path), toma_gradient_sync="each")


def test_an_error_that_is_not_out_of_memory_passes_through_untouched(tmp_path):
    model = gpt2()
    problem = ValueError("a bug in the model")

    def hook(module, args, kwargs):
        raise problem

    model.register_forward_pre_hook(hook, with_kwargs=True)
    trainer = TomaTrainer(model=model, args=arguments(tmp_path), train_dataset=texts(), data_collator=pad)
    with pytest.raises(ValueError) as raised:
        trainer.train()
    assert raised.value is problem and all(p.grad is None for p in model.parameters())


# --- mixed precision -------------------------------------------------------------------------------------


def test_bf16_autocast_on_the_cpu_stays_within_bf16s_rounding_of_the_plain_trainer(tmp_path):
    """bf16 rounds each micro-batch's matmuls on its own, so the split is not bit-exact: the parameters' distance
    from the plain bf16 run must stay a small part of the training's own movement (0.2% here; the same run in
    fp32 is 0.4% away, and micro-batches weighted by rows instead of tokens 75%)."""
    reference, _ = plain_run(bf16=True, gradient_accumulation_steps=2)
    model, trainer, _ = train(TomaTrainer, tmp_path, oom_rows=3, bf16=True, gradient_accumulation_steps=2)
    assert trainer.accelerator.mixed_precision == "bf16" and trainer.toma_stats.micro_batch <= 3
    start = [p.detach() for p in gpt2().parameters()]
    distance = sum(float((p.detach() - q).square().sum()) for p, q in zip(model.parameters(), reference)) ** 0.5
    moved = sum(float((q - s).square().sum()) for q, s in zip(reference, start)) ** 0.5
    assert distance < 0.01 * moved, (distance, moved)


@requires_cuda
@pytest.mark.cuda
def test_fp16_with_the_accelerators_grad_scaler_follows_the_plain_trainer_on_a_gpu(tmp_path):
    """fp16: every micro-batch's backward goes through accelerate's GradScaler. Both scalers start at 2**8, where
    no gradient overflows, so neither run skips a step; what differs is fp16's rounding of the split."""
    runs = []
    for cls, oom_rows in ((Trainer, None), (TomaTrainer, 3)):
        model = gpt2()
        if oom_rows is not None:
            oom_above(model, oom_rows)
        args = arguments(tmp_path, use_cpu=False, fp16=True, gradient_accumulation_steps=2)
        trainer = cls(model=model, args=args, train_dataset=texts(), data_collator=pad)
        assert trainer.accelerator.scaler is not None
        trainer.accelerator.scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8)
        trainer.train()
        runs.append((model, trainer))
    (reference, _), (model, trainer) = runs
    assert trainer.toma_stats.micro_batch <= 3 and trainer.state.global_step == 3
    start = [p.detach().cuda() for p in gpt2().parameters()]
    distance = sum(float((p - q).detach().square().sum()) for p, q in zip(model.parameters(), reference.parameters()))
    moved = sum(float((q.detach() - s).square().sum()) for q, s in zip(reference.parameters(), start))
    assert distance**0.5 < 0.01 * moved**0.5, (distance, moved)


# --- a real out-of-memory error, and auto_find_batch_size beside it ----------------------------------------

# A causal LM whose logits (32 rows x 64 tokens x 4096 words, 32 MiB, and their copies in the loss and its
# gradient) cannot pass in one piece under a cap of 80 MiB above what the process holds; 8 rows fit. The
# reference trains outside the cap; then, under it, the plain Trainer, TomaTrainer and auto_find_batch_size.
UNDER_A_CAP = (
    COLLECT_TOMA_LOG
    + """
import json, torch
torch.set_num_threads(1)
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
predictable_heap()
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, logging as hf_logging
from toma.integrations.transformers import TomaTrainer
hf_logging.set_verbosity_error()

def make():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=4096, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)

generator = torch.Generator().manual_seed(0)
data = [{"input_ids": row, "labels": row} for row in torch.randint(0, 4096, (96, 64), generator=generator)]

def run(cls, **overrides):
    settings = dict(output_dir="out", per_device_train_batch_size=32, num_train_epochs=1, learning_rate=0.5,
                    optim="sgd", lr_scheduler_type="constant", report_to="none", use_cpu=True, logging_steps=1,
                    save_strategy="no", seed=0, disable_tqdm=True, dataloader_drop_last=True)
    settings.update(overrides)
    model = make()
    trainer = cls(model=model, args=TrainingArguments(**settings), train_dataset=data)
    restarts = []
    inner = trainer._inner_training_loop
    def counted(*args, **kwargs):
        restarts.append(kwargs.get("batch_size", args[0] if args else None))
        return inner(*args, **kwargs)
    trainer._inner_training_loop = counted
    try:
        trainer.train()
    except RuntimeError as error:
        return dict(error=str(error).splitlines()[0])
    return dict(params=[p.detach().clone() for p in model.parameters()], steps=trainer.state.global_step,
                batch=trainer._train_batch_size, loops=restarts, trainer=trainer)

reference = run(Trainer)
set_cpu_memory_headroom(80 / 1024)
plain = run(Trainer)
toma = run(TomaTrainer)
auto = run(Trainer, auto_find_batch_size=True)
close = all(bool(torch.allclose(p, r, rtol=1e-5, atol=1e-7)) for p, r in zip(toma["params"], reference["params"]))
auto_close = all(bool(torch.allclose(p, r, rtol=1e-5, atol=1e-7)) for p, r in zip(auto["params"], reference["params"]))
stats = toma["trainer"].toma_stats
print(json.dumps(dict(
    plain=plain.get("error"), reference_steps=reference["steps"], toma_close=close, toma_steps=toma["steps"],
    micro_batch=stats.micro_batch, retries=stats.oom_retries, toma_batch=toma["batch"],
    auto_steps=auto["steps"], auto_batch=auto["batch"], auto_loops=auto["loops"], auto_close=auto_close,
    messages=messages)))
"""
)


@pytest.mark.slow
def test_under_a_real_cpu_cap_the_plain_trainer_fails_toma_trains_the_reference_and_auto_find_shrinks_the_batch(
    tmp_path,
):
    out = run_python(f"import os; os.chdir({str(tmp_path)!r})\n" + UNDER_A_CAP, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["plain"] and "can't allocate memory" in result["plain"], "the plain Trainer must run out of memory"
    ooms = [m for m in result["messages"] if "ran out of memory" in m]
    assert ooms and all("can't allocate memory" in m for m in ooms)
    assert 1 <= result["micro_batch"] < 32 and result["retries"] >= 1
    assert result["toma_close"], "TomaTrainer under the cap must give the uncapped plain Trainer's parameters"
    assert result["toma_steps"] == result["reference_steps"] == 3 and result["toma_batch"] == 32
    # auto_find_batch_size: the batch halves and training starts over, with more, smaller optimizer steps.
    assert result["auto_batch"] < 32 and len(result["auto_loops"]) >= 2
    assert result["auto_steps"] == 96 // result["auto_batch"] and not result["auto_close"]
    print(
        f"\nTomaTrainer: micro-batch {result['micro_batch']}, {result['retries']} retries, batch 32, "
        f"{result['toma_steps']} steps; auto_find_batch_size: batch sizes {result['auto_loops']}, "
        f"{len(result['auto_loops']) - 1} restarts, {result['auto_steps']} steps of {result['auto_batch']} rows"
    )


@pytest.mark.slow
def test_the_causal_lm_example_finds_a_micro_batch_under_its_cap(tmp_path):
    import os
    import subprocess
    import sys

    from helpers import REPO

    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "hf_causal_lm.py"), "--output-dir", str(tmp_path)]
        + ["--rows", "256"],  # 4 steps: the cap, the OOMs and the restarts come in the first
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    found = dict(
        re.findall(r"^(micro-batch size found|out-of-memory retries|plain Trainer): (.+)$", result.stdout, re.M)
    )
    size, unit = found["micro-batch size found"].split(" ", 1)
    failed = re.findall(r"ran out of memory at token budget (\d+)", result.stdout)
    assert unit == "padded tokens" and failed and 0 < int(size) < int(failed[0]), result.stdout
    assert int(found["out-of-memory retries"]) >= 1, result.stdout
    assert "can't allocate memory" in found["plain Trainer"], result.stdout


# --- DDP through accelerate, two CPU ranks -------------------------------------------------------------------

# Each rank trains the plain Trainer and then TomaTrainer (rank 0's forward passes refusing more than 3 rows) as
# accelerate's DDP runs them, gradient accumulation over padded batches included; prints its parameters' sums.
DDP_RUN = """
import json, os, torch
torch.set_num_threads(1)
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, logging as hf_logging
from toma.integrations.transformers import TomaTrainer
hf_logging.set_verbosity_error()
rank = int(os.environ["RANK"])
FSDP2, SYNC, GPU = False, "auto", False
if FSDP2 and not GPU:
    # accelerate turns FSDP on for GPU jobs only; everything else it does for FSDP2 runs on the CPU with gloo.
    # This makes its state take a CPU job for a GPU one, so that its FSDP2 branch (the plugin, fully_shard on
    # the blocks, the tail group and the root, its backward and clipping) is what runs here.
    import accelerate.state as accelerate_state

    accelerate_init = accelerate_state.AcceleratorState.__init__

    def as_gpu_job(self, *args, **kwargs):
        shared = accelerate_state.PartialState._shared_state
        if shared.get("distributed_type") == accelerate_state.DistributedType.MULTI_CPU:
            shared["distributed_type"] = accelerate_state.DistributedType.MULTI_GPU
        accelerate_init(self, *args, **kwargs)

    accelerate_state.AcceleratorState.__init__ = as_gpu_job
sharding = dict(fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]})

def make():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)

generator = torch.Generator().manual_seed(1)
rows = [torch.randint(1, 100, (n,), generator=generator) for n in torch.randint(2, 20, (64,), generator=generator)]
def pad(batch):
    labels = torch.nn.utils.rnn.pad_sequence(batch, batch_first=True, padding_value=-100)
    return {"input_ids": labels.clamp(min=0), "attention_mask": (labels != -100).long(), "labels": labels}

def refuse(module, args, kwargs):
    if kwargs["input_ids"].shape[0] > 3:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

def run(cls, oom):
    model = make()
    if oom:
        model.register_forward_pre_hook(refuse, with_kwargs=True)
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             max_steps=2, optim="sgd", learning_rate=0.5, report_to="none", use_cpu=not GPU,
                             save_strategy="no", disable_tqdm=True, seed=0, **(sharding if FSDP2 else {}))
    options = dict(toma_pack_tokens=False, toma_gradient_sync=SYNC) if cls is TomaTrainer else {}  # rows: <= 3 below
    trainer = cls(model=model, args=args, train_dataset=rows, data_collator=pad, **options)
    trainer.train()
    return trainer, [(p.full_tensor() if FSDP2 else p).detach().clone().cpu() for p in model.parameters()]

plain, reference = run(Trainer, False)
toma, params = run(TomaTrainer, rank == 0)
close = all(bool(torch.allclose(p, r, rtol=1e-5, atol=1e-7)) for p, r in zip(params, reference))
ddp = type(toma.model_wrapped).__name__ if not FSDP2 else toma.accelerator.distributed_type.value
# Evaluation batches of 8 rows per rank, in chunks of at most 3 on both ranks (rank 0 refuses more): each chunk's
# loss is normalised by its label tokens over both ranks, as the Trainer's prediction_step does.
evaluation = rows[:32]
losses = [trainer.evaluate(evaluation)["eval_loss"] for trainer in (plain, toma)]
print(json.dumps(dict(rank=rank, close=close, micro=toma.toma_stats.micro_batch, ddp=ddp,
                      retries=toma.toma_stats.oom_retries, eval_losses=losses)), flush=True)
toma.accelerator.wait_for_everyone()
os._exit(0)
"""


def run_against_the_plain_trainer(
    tmp_path, ranks: int, sharding: str, expect: str, fsdp2=False, sync="auto", gpu=False
):
    """DDP_RUN on `ranks` ranks: every rank at the same micro-batch (<= 3 rows), the ranks that did not run out of
    memory retrying with rank 0, the plain Trainer's parameters and evaluation loss."""
    from helpers import run_ranks

    script = DDP_RUN.replace('FSDP2, SYNC, GPU = False, "auto", False', f"FSDP2, SYNC, GPU = {fsdp2}, {sync!r}, {gpu}")
    outputs = run_ranks(f"import os; os.chdir({str(tmp_path)!r})\n" + script, ranks, timeout=300)
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert [r["ddp"] for r in results] == [expect] * ranks, sharding
    assert [r["micro"] for r in results] == [results[0]["micro"]] * ranks and results[0]["micro"] <= 3, results
    assert results[-1]["retries"] >= 1, "the last rank never ran out of memory, yet retried with rank 0"
    assert all(r["close"] for r in results), results
    for r in results:
        plain_loss, toma_loss = r["eval_losses"]
        assert toma_loss == pytest.approx(plain_loss, rel=1e-5), r


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ddp_through_accelerate_ranks_agree_on_the_micro_batch_and_match_the_plain_trainer(tmp_path):
    run_against_the_plain_trainer(tmp_path, 2, "DDP", "DistributedDataParallel")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("gradient_sync", ["auto", "micro_batch", "sharded"])
def test_fsdp2_through_accelerate_ranks_agree_on_the_micro_batch_and_match_the_plain_trainer(tmp_path, gradient_sync):
    """The DDP run above with accelerate's FSDP2 plugin (`fsdp_config={"fsdp_version": 2}`): the plain Trainer's
    FSDP2 parameters and evaluation loss, with rank 0 refusing more than 3 rows."""
    run_against_the_plain_trainer(tmp_path, 2, "FSDP2", "FSDP", fsdp2=True, sync=gradient_sync)


@pytest.mark.cuda
@requires_cuda
def test_on_a_gpu_fsdp2_through_accelerate_trains_the_plain_trainers_parameters(tmp_path):
    """The FSDP2 run above on one GPU, as accelerate runs it there (NCCL, no forcing): one rank refusing more
    than 3 rows."""
    run_against_the_plain_trainer(tmp_path, 1, "FSDP2 on a GPU", "FSDP", fsdp2=True, gpu=True)


def test_a_batch_whose_every_label_is_padding_changes_nothing_and_logs_no_nan(tmp_path, caplog):
    """A loss over no label token is a mean over nothing. TomaTrainer skips such a batch (no forward or backward
    pass, no gradient: an optimizer with momentum or weight decay does not move the weights either), logs its loss
    as 0 and says so; with SGD its parameters end where the plain Trainer's do."""

    def no_labels_in_the_second_batch():
        calls = []

        def collate(rows):
            batch = pad(rows)
            calls.append(1)
            if len(calls) == 2:
                batch["labels"].fill_(-100)
            return batch

        return collate

    seen = []

    class Snapshots(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen.append([p.detach().clone() for p in model.parameters()])

    plain_model, model = gpt2(), gpt2()
    plain = Trainer(
        model=plain_model,
        args=arguments(tmp_path, max_steps=3),
        train_dataset=texts(),
        data_collator=no_labels_in_the_second_batch(),
    )
    plain.train()
    oom_above(model, 3)
    trainer = TomaTrainer(
        model=model,
        args=arguments(tmp_path, max_steps=3),
        train_dataset=texts(),
        data_collator=no_labels_in_the_second_batch(),
        callbacks=[Snapshots()],
    )
    with caplog.at_level(logging.WARNING, logger="toma"):
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[1] == 0.0 and all(math.isfinite(loss) for loss in losses)
    assert "has nothing to learn from" in caplog.text
    assert all(torch.equal(p, q) for p, q in zip(seen[0], seen[1])), "the second batch changed nothing"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert_same_parameters(model, plain_model)


def test_every_toma_option_given_to_the_trainer_reaches_each_steps_accumulation(tmp_path, monkeypatch):
    """`toma_*` options are checked once in `__init__` (with `toma.accumulate`'s checks and messages, named as
    given) and reach every step's accumulation unchanged."""
    from toma.integrations import transformers as mixin_module

    seen = []
    real = mixin_module.accumulate

    def recording(func, batch, options, sizing, *rest, **kwargs):
        seen.append((options, sizing))
        return real(func, batch, options, sizing, *rest, **kwargs)

    monkeypatch.setattr(mixin_module, "accumulate", recording)
    policy = Halving()
    options = dict(
        toma_policy=policy, toma_initial_micro_batch=4, toma_gradient_sync="logical_batch", toma_groups="rows",
        toma_split_for_padding=False, toma_pack_tokens=True, toma_levers=False,
    )  # fmt: skip
    _, trainer, _ = train(TomaTrainer, tmp_path, options=options, rows=False, max_steps=2)
    assert len(seen) == 2 and trainer.toma_levers is False
    for accumulation, sizing in seen:
        assert accumulation.gradient_sync == "logical_batch" and accumulation.groups == "rows"
        assert accumulation.levers is False
        assert accumulation.split_for_padding is False and accumulation.lengths == "attention_mask"
        assert sizing.initial == 4 and sizing.runner.policy is policy
    for name, value, error in [
        ("toma_groups", "triples", "toma_groups must be"),
        ("toma_split_for_padding", 1, "toma_split_for_padding must be True or False"),
        ("toma_levers", "off", "toma_levers must be True or False"),
        ("toma_pack_tokens", "yes", "toma_pack_tokens must be True or False"),
    ]:
        with pytest.raises((TypeError, ValueError), match=error):
            TomaTrainer(model=gpt2(), args=arguments(tmp_path), **{name: value})


class InBatchScores(Trainer):
    """A loss that couples rows (every row's embedding against every other's), the labels left out of the model's
    call: what a contrastive Trainer subclass computes."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = {key: value for key, value in inputs.items() if key != "labels"}
        outputs = model(**inputs)
        embedded = F.normalize(outputs.logits, dim=-1)
        loss = torch.logsumexp((embedded @ embedded.T * 10).flatten(), 0) - math.log(len(embedded))
        return (loss, outputs) if return_outputs else loss


class TomaInBatchScores(TomaTrainerMixin, InBatchScores):
    pass


def in_batch_bert():
    return bert(num_labels=8)  # 8 logits a row: the embedding the loss compares


def oom_inside_above(model: torch.nn.Module, rows: int) -> list:
    """`oom_above` on the encoder inside the model: where memory runs out, inside the forward pass (a hook on the model
    itself would run once for its whole call, before toma cuts it)."""
    seen = []

    def hook(module, args, kwargs):
        n = (args[0] if args else kwargs["input_ids"]).shape[0]
        seen.append(n)
        if n > rows:
            raise_fake_oom()

    model.bert.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def test_a_loss_that_couples_rows_trains_and_evaluates_as_the_plain_trainer_under_oom(tmp_path, caplog):
    """Training: the split check finds the coupling, gradient caching trains the plain Trainer's parameters.
    Evaluation: batches of 8 chunked to 3 rows give the plain eval_loss, not an average of the chunks' losses
    (which `toma_groups="rows"` reports, to show it differs)."""
    data = texts(24, seed=5, classes=3)
    reference = in_batch_bert()
    plain = InBatchScores(model=reference, args=arguments(tmp_path), train_dataset=data, data_collator=pad_classes)
    plain.train()
    expected = plain.evaluate(data)["eval_loss"]
    model = in_batch_bert()
    seen = oom_inside_above(model, 3)
    trainer = TomaInBatchScores(model=model, args=arguments(tmp_path), train_dataset=data, data_collator=pad_classes)
    with caplog.at_level(logging.INFO, logger="toma"):
        trainer.train()
    assert trainer.toma_stats.split_check.coupled and "gradient caching" in caplog.text
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-5)  # 3 steps at lr 0.5: fp32 sums in another order
    seen.clear()
    got = trainer.evaluate(data)["eval_loss"]
    assert seen[0] == 8 and seen[-1] <= 3, "the evaluation batches ran out of memory and were cut"
    assert got == pytest.approx(expected, rel=1e-5)
    averaged = TomaInBatchScores(
        model=model, args=arguments(tmp_path), data_collator=pad_classes, toma_groups="rows"
    ).evaluate(data)["eval_loss"]
    assert abs(averaged - expected) > 0.05 * abs(expected), (averaged, expected)


def test_an_evaluation_that_finds_the_coupling_itself_reports_the_whole_batchs_loss(tmp_path, caplog):
    """No training first: the first evaluation batch cut into chunks is checked (its first chunk against its halves);
    found coupled, the batch's loss is computed whole with the model's calls cut, and every later batch too."""
    data = texts(20, seed=6, classes=3)
    expected = InBatchScores(model=in_batch_bert(), args=arguments(tmp_path), data_collator=pad_classes).evaluate(data)
    model = in_batch_bert()
    oom_inside_above(model, 3)
    trainer = TomaInBatchScores(model=model, args=arguments(tmp_path), data_collator=pad_classes)
    with caplog.at_level(logging.INFO, logger="toma"):
        got = trainer.evaluate(data)
    assert got["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-5)
    assert trainer._toma_eval_coupling.coupled and "the evaluation loss couples rows" in caplog.text


class EmbeddedInBatchScores(InBatchScores):
    """The same loss, the model fed embeddings computed in compute_loss (inputs that require gradients)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        embeds = model.bert.embeddings.word_embeddings(inputs["input_ids"])
        outputs = model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"])
        embedded = F.normalize(outputs.logits, dim=-1)
        return torch.logsumexp((embedded @ embedded.T * 10).flatten(), 0)


class TomaEmbeddedInBatchScores(TomaTrainerMixin, EmbeddedInBatchScores):
    pass


def test_a_refusal_in_a_trainer_names_the_trainers_keywords(tmp_path):
    """What gradient caching cannot cut is refused before anything trains, its remedies named as the trainer takes
    them (`toma_groups=`, not `groups=`, which the trainer would not take)."""
    model = in_batch_bert()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = TomaEmbeddedInBatchScores(
        model=model,
        args=arguments(tmp_path),
        train_dataset=texts(24, seed=5, classes=3),
        data_collator=pad_classes,
        toma_initial_micro_batch=3,
    )
    with pytest.raises(CoupledRows, match="inputs that require gradients") as raised:
        trainer.train()
    assert "toma_groups=" in str(raised.value) and not re.search(r"(?<![\w.])groups=", str(raised.value))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "nothing trained"
    assert str(trainer.toma_stats).startswith("toma: ")
