"""`toma.levers.checkpointing`: activation checkpointing applied to a model and removed again gives the plain
gradients (dropout too), leaves the model as the user gave it, respects the user's own checkpointing, and under a
real address-space cap trains a row that does not fit plain."""

import json

import pytest
import torch
from torch import nn

from toma.levers.checkpointing import ActivationCheckpointing, repeated_blocks

from helpers import CHECKPOINT_TOWER, run_python
from towers import Tower, assert_close, grads


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_checkpointed_blocks_give_the_plain_gradients_and_the_model_is_as_given_after(dropout):
    model, x = Tower(dropout=dropout), torch.randn(8, 3)
    plain, keys = grads(model, x), list(model.state_dict())
    lever = ActivationCheckpointing()
    assert lever.applies_to(model) and repeated_blocks(model) == list(model.blocks)
    remove = lever.apply(model)
    assert not lever.applies_to(model), "on already: applying again changes nothing"
    assert all("forward" in vars(block) for block in model.blocks)
    assert_close(grads(model, x), plain)
    assert list(model.state_dict()) == keys
    remove()
    assert all("forward" not in vars(block) for block in model.blocks)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), Tower(dropout=dropout).eval()(x))


def test_a_model_without_repeated_blocks_is_not_touched():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    assert not ActivationCheckpointing().applies_to(model)
    with pytest.raises(ValueError, match="activation checkpointing does not apply"):
        ActivationCheckpointing().apply(model)


def test_an_instances_own_forward_is_put_back():
    model = Tower()
    own = model.blocks[1].forward
    model.blocks[1].forward = lambda x: own(x) * 1.0
    custom = model.blocks[1].forward
    ActivationCheckpointing().apply(model)()
    assert model.blocks[1].forward is custom


def test_a_hugging_face_model_uses_its_own_switch_and_the_users_setting_is_respected():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 50, (4, 12))
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    plain = [p.grad.clone() for p in model.parameters()]
    lever = ActivationCheckpointing()
    remove = lever.apply(model)
    assert model.is_activation_checkpointing
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    assert_close([p.grad for p in model.parameters()], plain)
    remove()
    assert not model.is_activation_checkpointing
    assert not getattr(model, "_require_grads_hooks", None), "the input embeddings' hook removed with it"
    model.activation_checkpointing_enable()  # the user's own
    assert not lever.applies_to(model)


def gpt2_layers(layers=4):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def test_a_hugging_face_model_inside_a_module_is_switched_with_the_keywords_given_for_it():
    """A LightningModule's (or a wrapper's) Hugging Face model: its own switch, not its blocks; thrown with the
    keywords a trainer's `activation_checkpointing_kwargs` name (`checkpoint_with`), `use_reentrant=False` kept."""
    from toma.levers.checkpointing import checkpoint_with, hugging_face_model

    model = gpt2_layers()
    holder = nn.ModuleDict({"net": model, "extra": nn.Linear(2, 2)})
    assert hugging_face_model(holder) is model and hugging_face_model(Tower()) is None
    checkpoint_with(model, {"every_n_layers": 2, "preserve_rng_state": False})
    lever = ActivationCheckpointing()
    assert lever.applies_to(holder)
    remove = lever.apply(holder)
    on = [layer.gradient_checkpointing for layer in model.transformer.h]
    assert on == [True, False, True, False], "every second layer, as every_n_layers=2 says"
    func = model.transformer.h[0]._gradient_checkpointing_func
    assert func.keywords == {"use_reentrant": False, "preserve_rng_state": False}
    assert not any("forward" in vars(block) for block in model.transformer.h), "no block lever beside it"
    remove()
    assert not model.is_activation_checkpointing
    checkpoint_with(model, None)
    remove = lever.apply(holder)
    assert model.transformer.h[0]._gradient_checkpointing_func.keywords == {"use_reentrant": False}
    remove()


MEASURE = (
    CHECKPOINT_TOWER
    + """
import json
from toma.levers.checkpointing import ActivationCheckpointing
x = torch.randn(4096, 256)
def step():
    model.zero_grad(set_to_none=False)
    model(x).pow(2).mean().backward()
for p in model.parameters():
    p.grad = torch.zeros_like(p)
if LEVER:
    ActivationCheckpointing().apply(model)
set_cpu_memory_headroom(HEADROOM)
try:
    step()
    print(json.dumps("fit"))
except RuntimeError as error:
    print(json.dumps("out of memory" if "alloc" in str(error) or "memory" in str(error) else repr(error)))
"""
)


@pytest.mark.slow
def test_under_a_real_cap_a_row_that_does_not_fit_plain_trains_checkpointed():
    """12 blocks whose activations (4096 x 1024 floats, 16 MiB each) need about 0.6 GiB plain, and about 0.12 GiB
    checkpointed: under 0.35 GiB of headroom the plain step runs out of memory and the checkpointed one fits."""
    outcomes = {}
    for lever in (False, True):
        out = run_python(MEASURE.replace("LEVER", str(lever)).replace("HEADROOM", "0.35"), fresh=True)
        outcomes[lever] = json.loads(out.stdout.strip().splitlines()[-1])
    assert outcomes == {False: "out of memory", True: "fit"}


def test_the_users_own_input_embedding_hook_stays_and_no_hook_of_the_switch_is_left_behind():
    """Hugging Face's switch adds a hook on the input embeddings (and overwrites where the model keeps the user's):
    after each removal the embeddings carry the user's hook alone, kept where the user's own disable finds it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    model.enable_input_require_grads()  # the user's own, as PEFT users do
    users = list(model._require_grads_hooks)
    embeddings = model.get_input_embeddings()
    for _ in range(3):
        ActivationCheckpointing().apply(model)()
        assert len(embeddings._forward_hooks) == 1 and model._require_grads_hooks == users
    model.disable_input_require_grads()
    assert len(embeddings._forward_hooks) == 0
    plain = transformers.GPT2LMHeadModel(config)
    ActivationCheckpointing().apply(plain)()
    assert len(plain.get_input_embeddings()._forward_hooks) == 0 and not getattr(plain, "_require_grads_hooks", None)
