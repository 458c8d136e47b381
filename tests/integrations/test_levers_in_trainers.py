"""The memory lever where training runs (single process): `toma.Trainer`, `TomaTrainer` and `MicroBatching` turn
activation checkpointing on where one row does not fit (fake out-of-memory errors for any forward pass the
model runs plain), train to the plain run's parameters, keep what the lever needed for their next step (one
`AccumulationStats` per training: the second step starts with it on and never fails first), and leave the model
as it was given. TomaTrainer throws the model's own switch with `args.activation_checkpointing_kwargs` and leaves
the user's own `args.activation_checkpointing=True` alone; MicroBatching finds the blocks inside the
LightningModule."""

import gc
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import toma
from toma import Halving

from helpers import CHECKPOINT_TOWER, raise_fake_oom, run_python

RTOL, ATOL = 1e-5, 1e-7
LEVER = "activation checkpointing"


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Tower(nn.Module):
    """Three same-type blocks in a ModuleList; with `fails`, any forward pass with gradients that runs them plain
    is out of memory (a row that only fits checkpointed). `seen`: (rows, checkpointed) per such pass."""

    def __init__(self, fails=True):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(6, 3)
        self.fails, self.seen = fails, []

    def checkpointed(self):
        return all("forward" in vars(block) for block in self.blocks)

    def forward(self, x):
        if torch.is_grad_enabled() and self.fails:
            self.seen.append((len(x), self.checkpointed()))
            if not self.checkpointed():
                raise_fake_oom()
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def data(rows=16):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, 6, generator=generator), torch.randint(0, 3, (rows,), generator=generator)


def plain_tower(steps, batch=8, lr=0.5):
    """The plain loop's parameters: `steps` SGD steps on batches of `batch` rows."""
    model, (x, y) = Tower(fails=False), data()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x[step * batch : (step + 1) * batch]), y[step * batch : (step + 1) * batch]).backward()
        optimizer.step()
    return model


def assert_same_parameters(model, reference):
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


def assert_second_step_never_fails(seen, rows=8, micro=1):
    """The first step: one plain pass fails, then every micro-batch checkpointed; the second: all checkpointed."""
    first = [(micro, False)] + [(micro, True)] * (rows // micro)
    assert seen == first + [(micro, True)] * (rows // micro), seen


# --- toma.Trainer -------------------------------------------------------------------------------------------------


def test_the_trainer_turns_checkpointing_on_for_a_row_that_does_not_fit_and_starts_its_next_step_with_it():
    model = Tower()
    x, y = data()
    trainer = toma.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.5), nn.CrossEntropyLoss(),
        DataLoader(TensorDataset(x, y), batch_size=8), batch_size=8, initial_micro_batch=1, policy=Halving(),
        verbose=0, groups="rows",
    )  # fmt: skip
    trainer.fit(1)
    assert_second_step_never_fails(model.seen)
    assert trainer.stats.levers == [LEVER] and trainer.oom_retries == 1
    assert not model.checkpointed(), "the model as given after every step"
    assert_same_parameters(model, plain_tower(2))


def test_the_trainer_with_levers_false_raises_the_error_at_one_row():
    model = Tower()
    x, y = data(8)
    trainer = toma.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.5), nn.CrossEntropyLoss(), [(x, y)], batch_size=8,
        initial_micro_batch=1, verbose=0, levers=False, groups="rows",
    )  # fmt: skip
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit(1)
    assert model.seen == [(1, False)] and not model.checkpointed()
    with pytest.raises(TypeError, match="levers must be True or False"):
        toma.Trainer(
            model, torch.optim.SGD(model.parameters()), nn.CrossEntropyLoss(), [(x, y)], batch_size=8, levers=0
        )


# --- TomaTrainer ------------------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers", minversion="5.23")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from toma.integrations.transformers import TomaTrainer  # noqa: E402

VOCAB = 100


@pytest.fixture(scope="module", autouse=True)
def frozen_imports():
    """toma collects garbage after an out-of-memory error: with transformers imported, a million objects."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def gpt2(fails=False):
    """A 2-layer GPT-2 from a config (dropout 0); with `fails`, a forward pass with gradients run plain (its own
    switch off) is out of memory. `model.seen`: (rows, checkpointed) per such pass."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    model.seen = []

    def hook(module, args, kwargs):
        if torch.is_grad_enabled() and fails:
            on = model.is_activation_checkpointing
            layer = model.transformer.h[0]
            keywords = layer._gradient_checkpointing_func.keywords if on else None
            model.seen.append((kwargs["input_ids"].shape[0], on, keywords))
            if not on:
                raise_fake_oom()

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def rows(count=16):
    generator = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(1, VOCAB, (12,), generator=generator)} for _ in range(count)]


def collate(batch):
    ids = torch.stack([row["input_ids"] for row in batch])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def arguments(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path), max_grad_norm=0.0, per_device_train_batch_size=8, max_steps=2, learning_rate=0.5,
        optim="sgd", report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0, disable_tqdm=True,
        logging_steps=1,
    )  # fmt: skip
    settings.update(overrides)
    return TrainingArguments(**settings)


def hf_train(cls, tmp_path, model, options=None, **overrides):
    trainer = cls(
        model=model,
        args=arguments(tmp_path, **overrides),
        train_dataset=rows(),
        data_collator=collate,
        **(options or {}),
    )
    trainer.train()
    return trainer


def test_toma_trainer_throws_the_models_own_switch_with_the_trainers_kwargs_and_keeps_it_for_the_next_step(tmp_path):
    """`args.activation_checkpointing_kwargs` reach the switch (use_reentrant=False kept beside them); the second
    step starts with it on; the parameters are the plain Trainer's; the model's switch is off after."""
    reference = hf_train(Trainer, tmp_path / "plain", gpt2()).model
    model = gpt2(fails=True)
    kwargs = {"preserve_rng_state": False}
    options = dict(toma_initial_micro_batch=1, toma_policy=Halving(), toma_pack_tokens=False)
    trainer = hf_train(TomaTrainer, tmp_path, model, options, activation_checkpointing_kwargs=kwargs)
    keywords = {"use_reentrant": False, "preserve_rng_state": False}
    assert model.seen == [(1, False, None)] + [(1, True, keywords)] * 16, model.seen
    assert trainer.toma_stats.levers == [LEVER] and trainer.toma_stats.oom_retries == 1
    assert not model.is_activation_checkpointing
    assert not getattr(model, "_require_grads_hooks", None), "no hook left on the input embeddings"
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


def test_toma_trainer_leaves_the_users_own_checkpointing_on_and_with_toma_levers_false_raises(tmp_path):
    model = gpt2(fails=True)
    trainer = hf_train(TomaTrainer, tmp_path, model, activation_checkpointing=True)
    assert model.seen and all(on for _, on, _ in model.seen)
    assert model.is_activation_checkpointing, "the user's own: never turned off"
    assert trainer.toma_stats.levers == []
    model = gpt2(fails=True)
    options = dict(toma_initial_micro_batch=1, toma_levers=False)
    with pytest.raises(torch.OutOfMemoryError):
        hf_train(TomaTrainer, tmp_path, model, options)
    assert [on for _, on, _ in model.seen] == [False] and not model.is_activation_checkpointing


# --- MicroBatching ----------------------------------------------------------------------------------------------

pl = pytest.importorskip("lightning.pytorch")

from toma.integrations.lightning import MicroBatching  # noqa: E402


class TowerModule(pl.LightningModule):
    """A LightningModule whose model (a Tower, or GPT-2) is an attribute: the lever finds it inside."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        if isinstance(self.net, Tower):
            return F.cross_entropy(self.net(batch[0]), batch[1])
        return self.net(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def lightning_fit(module, callback, loader):
    trainer = pl.Trainer(
        max_steps=2, callbacks=[callback], accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(module, loader)


def test_micro_batching_checkpoints_the_blocks_inside_the_lightning_module_and_keeps_it_for_the_next_step():
    module, callback = TowerModule(Tower()), MicroBatching(1, policy=Halving(), groups="rows")
    lightning_fit(module, callback, DataLoader(TensorDataset(*data()), batch_size=8))
    assert_second_step_never_fails(module.net.seen)
    assert callback.stats.levers == [LEVER] and callback.stats.oom_retries == 1
    assert not module.net.checkpointed()
    assert_same_parameters(module.net, plain_tower(2))


def test_micro_batching_throws_the_switch_of_the_hugging_face_model_inside_the_lightning_module():
    module, callback = TowerModule(gpt2(fails=True)), MicroBatching(1, policy=Halving(), pack_tokens=False)
    lightning_fit(module, callback, DataLoader(rows(), batch_size=8, collate_fn=collate))
    assert [(n, on) for n, on, _ in module.net.seen] == [(1, False)] + [(1, True)] * 16
    assert callback.stats.levers == [LEVER] and not module.net.is_activation_checkpointing
    assert not any("forward" in vars(block) for block in module.net.transformer.h), "its own switch, not blocks"


# --- under a real address-space cap (subprocesses) --------------------------------------------------------------

TRAINER_ON_THE_TOWER = (
    CHECKPOINT_TOWER
    + """
import copy, json
import toma
x = torch.randn(3, 4096, 256)  # rows of 4096 tokens: one row's activations need about 0.6 GiB plain
y = torch.zeros(3, 4096, 256)
reference = copy.deepcopy(model)
optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
for rows in (slice(0, 2), slice(2, 3)):  # the uncapped reference: two steps, of 2 rows and of 1
    optimizer.zero_grad()
    nn.functional.mse_loss(reference(x[rows]), y[rows]).backward()
    optimizer.step()
reference.eval()
with torch.no_grad():
    expected = reference(x[:1])
set_cpu_memory_headroom(0.35)
plain = "fit"
try:
    nn.functional.mse_loss(model(x[:1]), y[:1]).backward()
except RuntimeError:
    plain = "out of memory"
model.zero_grad(set_to_none=True)
trainer = toma.Trainer(
    model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), [(x, y)], batch_size=2, policy=toma.Halving(),
    verbose=0, groups="rows",
)
trainer.fit(1)
worst = max(float((p - q).norm() / q.norm()) for p, q in zip(model.parameters(), reference.parameters()))
model.eval()
with torch.no_grad():
    answer = float((model(x[:1]) - expected).norm() / expected.norm())
on = any("forward" in vars(block) for block in model)
print(json.dumps([plain, trainer.stats.levers, trainer.oom_retries, worst, answer, on]))
"""
)


@pytest.mark.slow
def test_under_a_real_cap_the_trainer_trains_the_tower_checkpointed_to_the_uncapped_reference():
    """`toma.Trainer` on a ModuleList-like tower (12 blocks, rows of 4096 tokens of width 256): under 0.35 GiB of
    headroom one row fails plain (it needs about 0.6 GiB) and fits checkpointed; two steps (2 rows, then 1: the
    second starts with the lever on, so only the first step's two failed attempts count) train to the uncapped
    reference, and afterwards the model answers a plain forward as the reference does, its blocks as given."""
    out = run_python(TRAINER_ON_THE_TOWER, fresh=True, timeout=300)
    plain, levers, retries, worst, answer, on = json.loads(out.stdout.strip().splitlines()[-1])
    assert plain == "out of memory" and levers == [LEVER] and retries == 2
    assert worst < 1e-5 and answer < 1e-5 and not on


TOMA_TRAINER_ON_GPT2 = """
import json, tempfile, torch
torch.set_num_threads(1)
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
predictable_heap()
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from toma import Halving
from toma.integrations.transformers import TomaTrainer

SEQUENCE = 1536
def gpt2():
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=100, n_positions=SEQUENCE, n_embd=128, n_layer=8, n_head=4, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager", use_cache=False,
    )
    return GPT2LMHeadModel(config)
ids = torch.randint(1, 100, (2, SEQUENCE), generator=torch.Generator().manual_seed(1))
rows = [{"input_ids": row} for row in ids]
def collate(batch):
    stacked = torch.stack([row["input_ids"] for row in batch])
    return {"input_ids": stacked, "attention_mask": torch.ones_like(stacked), "labels": stacked.clone()}
def run(cls, model, output, **options):
    args = TrainingArguments(
        output_dir=output, max_grad_norm=0.0, per_device_train_batch_size=2, max_steps=1, learning_rate=0.5,
        optim="sgd", report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0, disable_tqdm=True,
    )
    trainer = cls(model=model, args=args, train_dataset=rows, data_collator=collate, **options)
    return trainer
with tempfile.TemporaryDirectory() as output:
    reference = gpt2()
    run(Trainer, reference, output).train()  # uncapped
    reference.eval()
    with torch.no_grad():
        expected = reference(input_ids=ids[:1]).logits
    model = gpt2()
    trainer = run(TomaTrainer, model, output, toma_policy=Halving(), toma_pack_tokens=False)
    set_cpu_memory_headroom(0.35)
    plain = "fit"
    try:
        model(input_ids=ids[:1], labels=ids[:1]).loss.backward()
    except RuntimeError:
        plain = "out of memory"
    model.zero_grad(set_to_none=True)
    trainer.train()
worst = max(float((p - q).norm() / q.norm()) for p, q in zip(model.parameters(), reference.parameters()))
model.eval()
with torch.no_grad():
    answer = float((model(input_ids=ids[:1]).logits - expected).norm() / expected.norm())
stats = trainer.toma_stats
print(json.dumps([plain, stats.levers, stats.oom_retries, worst, answer, model.is_activation_checkpointing]))
"""


@pytest.mark.slow
def test_under_a_real_cap_toma_trainer_trains_gpt2_checkpointed_to_the_uncapped_reference():
    """`TomaTrainer` on GPT-2 from a config (8 layers, width 128, 4 heads, eager attention, dropout 0) with rows of
    1536 tokens: one row needs between 0.5 and 0.6 GiB plain (the attention weights of every layer kept for the
    backward pass) and between 0.15 and 0.2 GiB checkpointed (measured by capping a single row's step), so under
    0.35 GiB of headroom one row fails plain and fits with the model's own switch. One step of 2 rows trains to
    the plain Trainer's uncapped parameters; afterwards the switch is off and a plain forward answers as the
    reference does."""
    out = run_python(TOMA_TRAINER_ON_GPT2, fresh=True, timeout=300)
    plain, levers, retries, worst, answer, on = json.loads(out.stdout.strip().splitlines()[-1])
    assert plain == "out of memory" and levers == [LEVER] and retries == 2
    assert worst < 1e-5 and answer < 1e-5 and not on


MICRO_BATCHING_ON_THE_TOWER = (
    CHECKPOINT_TOWER
    + """
import copy, json
import lightning.pytorch as pl
from toma import Halving
from toma.integrations.lightning import MicroBatching
x = torch.randn(2, 4096, 256)  # rows of 4096 tokens: one row's activations need about 0.6 GiB plain
reference = copy.deepcopy(model)
reference(x).pow(2).mean().backward()  # the uncapped reference: one step of SGD
with torch.no_grad():
    for p in reference.parameters():
        p -= 0.1 * p.grad
reference.eval()
with torch.no_grad():
    expected = reference(x[:1])

class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.tower = model
    def training_step(self, batch, batch_idx):
        return self.tower(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

module, callback = Module(), MicroBatching(policy=Halving(), groups="rows")
trainer = pl.Trainer(
    max_steps=1, callbacks=[callback], accelerator="cpu", logger=False, enable_progress_bar=False,
    enable_model_summary=False, enable_checkpointing=False,
)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=2)
set_cpu_memory_headroom(0.35)
plain = "fit"
try:
    model(x[:1]).pow(2).mean().backward()
except RuntimeError:
    plain = "out of memory"
model.zero_grad(set_to_none=True)
trainer.fit(module, loader)
worst = max(float((p - q).norm() / q.norm()) for p, q in zip(model.parameters(), reference.parameters()))
model.eval()
with torch.no_grad():
    answer = float((model(x[:1]) - expected).norm() / expected.norm())
on = any("forward" in vars(block) for block in model)
print(json.dumps([plain, callback.stats.levers, callback.stats.oom_retries, worst, answer, on]))
"""
)


@pytest.mark.slow
def test_under_a_real_cap_micro_batching_trains_the_tower_inside_a_lightning_module_to_the_uncapped_reference():
    """`MicroBatching` on a LightningModule holding the tower: under 0.35 GiB of headroom (set after Lightning's
    Trainer is made; its fit adds little beside the rows) one row fails plain and the step trains checkpointed to
    the uncapped reference; afterwards the blocks are as given and a plain forward answers as the reference's."""
    out = run_python(MICRO_BATCHING_ON_THE_TOWER, fresh=True, timeout=300)
    plain, levers, retries, worst, answer, on = json.loads(out.stdout.strip().splitlines()[-1])
    assert plain == "out of memory" and levers == [LEVER] and retries == 2
    assert worst < 1e-5 and answer < 1e-5 and not on
