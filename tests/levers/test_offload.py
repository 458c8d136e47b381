"""`toma.levers.offload`: saved activations in host memory give the plain gradients (dropout too, with
checkpointing on as well), leave the model as given, apply only on an accelerator by default; through
`toma.accumulate` a row that fits neither plain nor checkpointed trains offloaded; on CUDA, under a real cap."""

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


class Tower(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Dropout(dropout), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def grads(model, x, seed=1):
    model.zero_grad()
    torch.manual_seed(seed)
    model(x).pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def offloaded(model):
    return "_toma_offloaded" in vars(model)


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_offloaded_activations_give_the_plain_gradients_and_the_model_is_as_given_after(dropout, checkpointed):
    model, x = Tower(dropout), torch.randn(5, 8)
    plain, keys = grads(model, x), list(model.state_dict())
    lever = ActivationOffload(devices=("cpu",))
    removals = [ActivationCheckpointing().apply(model)] if checkpointed else []
    assert lever.applies_to(model)
    removals.append(lever.apply(model))
    assert not lever.applies_to(model)
    with pytest.raises(ValueError, match="activation offload does not apply"):
        lever.apply(model)
    for got, expected in zip(grads(model, x), plain, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert list(model.state_dict()) == keys
    for remove in reversed(removals):
        remove()
    assert "forward" not in vars(model) and not offloaded(model)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), Tower(dropout).eval()(x))


def test_it_applies_on_an_accelerator_only_by_default_and_puts_an_instances_own_forward_back():
    model = Tower()
    assert not ActivationOffload().applies_to(model), "on the CPU offloading to the CPU saves nothing"
    own = lambda x: Tower.forward(model, x)  # noqa: E731
    model.forward = own
    ActivationOffload(devices=("cpu",)).apply(model)()
    assert model.forward is own


def test_a_row_that_fits_neither_plain_nor_checkpointed_trains_offloaded(monkeypatch):
    """Offload made to apply on the CPU: the one row runs out of memory plain and checkpointed, and trains
    with both levers on, to the full batch's gradients; `levers=False` keeps the error."""
    monkeypatch.setattr(levers_in_use, "LEVERS", (ActivationCheckpointing(), ActivationOffload(devices=("cpu",))))
    model, seen = Tower(), []
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 1, 0])

    def compute_loss(x, y):
        if torch.is_grad_enabled():
            seen.append((len(x), offloaded(model)))
            if not offloaded(model):
                raise_fake_oom()
        return F.cross_entropy(model(x), y)

    step = toma.accumulate(model=model, initial_micro_batch=1, policy=Halving(), cache_type=NoBatchsizeCache)
    step(compute_loss)(x, y)
    assert seen == [(1, False), (1, False)] + [(1, True)] * 4
    reference = Tower()
    F.cross_entropy(reference(x), y).backward()
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-7)
    assert "forward" not in vars(model) and all("forward" not in vars(block) for block in model.blocks)
    model.zero_grad()
    with pytest.raises(torch.OutOfMemoryError) as raised:
        toma.accumulate(model=model, initial_micro_batch=1, levers=False)(compute_loss)(x, y)
    assert "nothing left to reduce" in "".join(raised.value.__notes__)


UNDER_A_CUDA_CAP = """
import json, torch, torch.nn as nn, torch.nn.functional as F
from toma import toma, NoBatchsizeCache
torch.manual_seed(0)
# no repeated blocks (checkpointing cannot apply): one Sequential of different layers; one row of 16384 tokens
# saves 11 activations of 16384 x 4096 fp32 (256 MiB each, about 2.75 GiB) for its backward pass, and needs
# about 1 GiB at a time with them in host memory: under 1.5 GiB of headroom it fits offloaded only
layers = [nn.Linear(256, 4096)]
for activation in (nn.GELU, nn.Tanh, nn.SiLU, nn.Sigmoid, nn.Softplus):
    layers += [activation(), nn.Linear(4096, 4096)]
model = nn.Sequential(*layers, nn.Linear(4096, 256)).cuda()
x = torch.randn(2, 16384, 256, device="cuda")
def loss_of(x):
    return model(x).pow(2).mean()
for row in (x[:1], x[1:]):  # the reference, uncapped: the mean of the rows' means
    (loss_of(row) / 2).backward()
expected = [p.grad.clone() for p in model.parameters()]
model.zero_grad(set_to_none=True)
torch.cuda.empty_cache()
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + 1.5 * 2**30) / total)
try:
    loss_of(x[:1]).backward()
    plain = "fit"
except torch.OutOfMemoryError:
    plain = "out of memory"
model.zero_grad(set_to_none=True)
torch.cuda.empty_cache()
step = toma.accumulate(model=model, initial_micro_batch=1, cache_type=NoBatchsizeCache)(loss_of)
step(x)
worst = max(float((p.grad - e).norm() / e.norm()) for p, e in zip(model.parameters(), expected))
with torch.no_grad():
    after = "forward" not in vars(model) and model(x[:1, :4]).shape == (1, 4, 256)
print(json.dumps([plain, step.stats.levers, worst, after]))
"""


@pytest.mark.cuda
@requires_cuda
def test_under_a_real_cuda_cap_a_row_that_does_not_fit_trains_offloaded():
    out = run_python(UNDER_A_CUDA_CAP, fresh=True)
    plain, levers, worst, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert plain == "out of memory" and levers == ["activation offload"]
    assert worst < 1e-5 and after
