"""`toma.levers.offload`: activation offload applied to a model (here on the CPU, its device test widened) gives
the plain gradients (dropout too), alone and with activation checkpointing, packs what is saved but the parameters,
leaves the model as the user gave it; `toma.accumulate` turns it on where one row does not fit and nothing cheaper
applies; on a GPU under a real CUDA cap, a row whose activations do not fit plain trains to the uncapped reference."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toma import Halving, NoBatchsizeCache, toma
from toma.accumulation import levers_in_use
from toma.levers.checkpointing import ActivationCheckpointing
from toma.levers.offload import ActivationOffload

from helpers import raise_fake_oom, requires_cuda, run_python
from towers import Tower, assert_close, grads

ON_THE_CPU = ("cpu", "cuda")  # the device test widened, so that the CPU checks what a GPU would do


class Packs:
    """Counts what autograd packs under the innermost saved-tensor hooks, by wrapping the hooks toma pushes."""

    def __init__(self, monkeypatch):
        self.shapes, self.parameters = [], []  # what was copied; the shapes of what was kept as a reference
        hooks = torch.autograd.graph.saved_tensors_hooks
        packs = self

        class Counting(hooks):
            def __init__(self, pack, unpack):
                def counted(tensor):
                    packed = pack(tensor)
                    (packs.parameters if packed[0] is None else packs.shapes).append(tuple(tensor.shape))
                    return packed

                super().__init__(counted, unpack)

        monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks", Counting)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["alone", "with-checkpointing"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_offloaded_gives_the_plain_gradients_and_the_model_is_as_given_after(dropout, checkpointing, monkeypatch):
    model, x = Tower(dropout=dropout), torch.randn(8, 3)
    plain, keys = grads(model, x), list(model.state_dict())
    lever, packs = ActivationOffload(devices=ON_THE_CPU), Packs(monkeypatch)
    assert lever.applies_to(model)
    removals = [ActivationCheckpointing().apply(model)] if checkpointing else []
    removals.append(lever.apply(model))
    assert not lever.applies_to(model), "on already: applying again changes nothing"
    assert "forward" in vars(model)
    assert_close(grads(model, x), plain)
    assert packs.shapes and packs.parameters, "activations packed, the parameters kept as references"
    if checkpointing:  # all that is left to save: the embedding's input, each block's input, the head's input
        assert packs.shapes == [(8, 3)] + [(8, 16)] * 4 + [(8, 16)]
    assert list(model.state_dict()) == keys
    for removal in reversed(removals):
        removal()
    assert "forward" not in vars(model) and all("forward" not in vars(block) for block in model.blocks)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), Tower(dropout=dropout).eval()(x))


def test_without_grad_nothing_is_packed(monkeypatch):
    model, packs = Tower(), Packs(monkeypatch)
    ActivationOffload(devices=ON_THE_CPU).apply(model)
    with torch.no_grad():
        model(torch.randn(2, 3))
    assert packs.shapes == []


def test_on_the_cpu_it_does_not_apply_and_twice_is_refused():
    model = Tower()
    assert ActivationOffload.devices == ("cuda",) and not ActivationOffload().applies_to(model)
    with pytest.raises(ValueError, match="activation offload does not apply"):
        ActivationOffload().apply(model)
    assert not ActivationOffload().applies_to(nn.ReLU()), "no tensor, no device"
    lever = ActivationOffload(devices=ON_THE_CPU)
    lever.apply(model)
    with pytest.raises(ValueError, match="activation offload does not apply"):
        lever.apply(model)


def test_an_instances_own_forward_is_put_back():
    model = Tower()
    own = model.forward
    model.forward = lambda x: own(x) * 1.0
    custom = model.forward
    remove = ActivationOffload(devices=ON_THE_CPU).apply(model)
    assert model.forward is not custom
    model(torch.randn(2, 3)).sum().backward()
    remove()
    assert model.forward is custom


def test_a_hugging_face_model_with_keyword_arguments_gives_the_plain_gradients_with_both_levers():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 50, (4, 12))
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    plain = [p.grad.clone() for p in model.parameters()]
    removals = [ActivationCheckpointing().apply(model), ActivationOffload(devices=ON_THE_CPU).apply(model)]
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    assert_close([p.grad for p in model.parameters()], plain)
    for removal in reversed(removals):
        removal()
    assert "forward" not in vars(model) and not model.is_activation_checkpointing


def test_it_comes_after_checkpointing_in_the_levers():
    assert [lever.name for lever in levers_in_use.LEVERS] == ["activation checkpointing", "activation offload"]


class Wide(nn.Module):
    """No repeated blocks: activation checkpointing does not apply, only offload."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(6, 12), nn.Linear(12, 2)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def offloaded(model):
    return "forward" in vars(model)


def loss_fn(model, seen):
    """Out of memory for any micro-batch the model runs plain (as a row that only fits offloaded)."""

    def compute_loss(x, y):
        if torch.is_grad_enabled():
            seen.append((len(x), offloaded(model)))
            if not offloaded(model):
                raise_fake_oom()
        return F.cross_entropy(model(x), y)

    return compute_loss


@pytest.fixture
def offload_on_the_cpu(monkeypatch):
    monkeypatch.setattr(levers_in_use, "LEVERS", (ActivationCheckpointing(), ActivationOffload(devices=ON_THE_CPU)))


def test_one_row_that_does_not_fit_trains_offloaded(offload_on_the_cpu):
    model, seen = Wide(), []
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 1, 0])
    compute_loss = toma.accumulate(model=model, initial_micro_batch=2, policy=Halving())(loss_fn(model, seen))
    compute_loss(x, y)
    assert seen == [(2, False), (1, False), (1, True), (1, True), (1, True), (1, True)]
    reference = Wide()
    F.cross_entropy(reference(x), y).backward()
    assert_close([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()])
    assert not offloaded(model), "the model as the user gave it after the call"
    assert compute_loss.stats.levers == ["activation offload"]


def test_levers_false_re_raises_the_error_at_one_row(offload_on_the_cpu):
    model, seen = Wide(), []
    compute_loss = toma.accumulate(model=model, initial_micro_batch=1, levers=False, cache_type=NoBatchsizeCache)(
        loss_fn(model, seen)
    )
    with pytest.raises(torch.OutOfMemoryError):
        compute_loss(torch.randn(2, 6), torch.tensor([0, 1]))
    assert seen == [(1, False)] and not offloaded(model)


# One row of 32768 tokens, about 1024 wide (128-160 MiB a tensor), through 16 linear layers and GELUs with no
# repeated blocks (a ModuleDict: activation checkpointing finds none): about 4.6 GiB saved for the backward pass, all
# on the GPU plain, under a cap of 2 GiB of headroom; offloaded, the GPU holds a few of one layer's tensors at a time
# (under 1 GiB, as does the split check's forward pass over both rows without gradients). The parameters are small
# (80 MiB), so their gradients fit beside.
UNDER_A_CUDA_CAP = """
import gc, json, torch, torch.nn as nn, torch.nn.functional as F
from toma import Halving, toma
from toma.levers.checkpointing import ActivationCheckpointing
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
TOTAL = torch.cuda.get_device_properties(0).total_memory

class Net(nn.Module):
    def __init__(self, widths):
        super().__init__()
        pairs = zip(widths, widths[1:])
        self.layers = nn.ModuleDict({f"layer{i}": nn.Linear(a, b) for i, (a, b) in enumerate(pairs)})
    def forward(self, x):
        for layer in self.layers.values():
            x = F.gelu(layer(x))
        return x

torch.manual_seed(0)
model = Net([1024 + 16 * i for i in range(17)]).cuda()
x = torch.randn(2, 32768, 1024, device="cuda")
loss = lambda x: model(x).pow(2).mean()
loss(x[:1]).backward(); loss(x[1:]).backward()  # the reference, uncapped: the mean of the rows' means
expected = [p.grad.clone() / 2 for p in model.parameters()]
model.zero_grad(set_to_none=False)
gc.collect(); torch.cuda.synchronize(); torch.cuda.empty_cache()
torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + 2 * 2**30) / TOTAL))
plain = "fit"
try:
    loss(x[:1]).backward()
except torch.OutOfMemoryError:
    plain = "out of memory"
model.zero_grad(set_to_none=False)
compute_loss = toma.accumulate(model=model, initial_micro_batch=2, policy=Halving())(loss)
compute_loss(x)
worst = max(float((p.grad - e).norm() / e.norm()) for p, e in zip(model.parameters(), expected))
still_on = "forward" in vars(model)
with torch.no_grad():
    after = list(model(x[:1, :16]).shape)
checkpointable = ActivationCheckpointing().applies_to(model)
print(json.dumps([plain, compute_loss.stats.levers, worst, still_on, after, checkpointable]))
"""


@pytest.mark.cuda
@pytest.mark.slow
@requires_cuda
def test_under_a_real_cuda_cap_a_row_that_fails_plain_trains_offloaded_to_the_uncapped_reference():
    out = run_python(UNDER_A_CUDA_CAP, fresh=True, timeout=300)
    plain, levers, worst, still_on, after, checkpointable = json.loads(out.stdout.strip().splitlines()[-1])
    assert plain == "out of memory" and not checkpointable and levers == ["activation offload"]
    assert worst < 1e-5 and not still_on and after == [1, 16, 1024 + 16 * 16]


def test_a_model_whose_parameters_are_a_tensor_subclass_is_not_offloaded():
    """FSDP2's sharded parameters are DTensors, which have no storage of their own to keep in place (reading it
    raised a RuntimeError in the first forward): such a model is not offloaded."""

    class Subclass(torch.Tensor):
        pass

    model = Tower()
    assert ActivationOffload(devices=ON_THE_CPU).applies_to(model)
    model.head.weight = nn.Parameter(model.head.weight.detach().as_subclass(Subclass))
    assert not ActivationOffload(devices=ON_THE_CPU).applies_to(model)
