"""Below one row: where one unit does not fit, `toma.accumulate` turns activation checkpointing on for the rest of
the call, trains the full batch's gradients, leaves the model as it was, starts the function's next call with it,
and with `levers=False` re-raises the error; under a real address-space cap a batch whose one row fails plain
trains to the uncapped reference."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toma import Halving, NoBatchsizeCache, toma

from helpers import CHECKPOINT_TOWER, raise_fake_oom, run_python


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def checkpointed(model):
    return all("forward" in vars(block) for block in model.blocks)


def loss_fn(model, seen):
    """Out of memory for any micro-batch the blocks run plain (as a row that only fits checkpointed)."""

    def compute_loss(x, y):
        if torch.is_grad_enabled():
            seen.append((len(x), checkpointed(model)))
            if not checkpointed(model):
                raise_fake_oom()
        return F.cross_entropy(model(x), y)

    return compute_loss


def reference(x, y):
    model = Tower()
    F.cross_entropy(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def test_one_row_that_does_not_fit_trains_checkpointed_and_the_next_call_starts_so():
    model, seen = Tower(), []
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 1, 0])
    compute_loss = toma.accumulate(model=model, initial_micro_batch=2, policy=Halving())(loss_fn(model, seen))
    compute_loss(x, y)
    assert seen == [(2, False), (1, False), (1, True), (1, True), (1, True), (1, True)]
    for got, expected in zip([p.grad for p in model.parameters()], reference(x, y), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert not checkpointed(model), "the model as the user gave it after the call"
    assert compute_loss.stats.levers == ["activation checkpointing"] and compute_loss.stats.oom_retries == 2
    seen.clear()
    compute_loss(x, y)
    assert all(on for _, on in seen) and compute_loss.stats.oom_retries == 2, "on from the start: no failure"
    assert not checkpointed(model)


def test_levers_false_re_raises_the_error_at_one_row():
    model, seen = Tower(), []
    compute_loss = toma.accumulate(model=model, initial_micro_batch=1, levers=False, cache_type=NoBatchsizeCache)(
        loss_fn(model, seen)
    )
    with pytest.raises(torch.OutOfMemoryError) as raised:
        compute_loss(torch.randn(2, 6), torch.tensor([0, 1]))
    assert "nothing left to reduce" in "".join(getattr(raised.value, "__notes__", []))
    assert seen == [(1, False)] and not checkpointed(model)
    with pytest.raises(TypeError, match="levers must be True or False"):
        toma.accumulate(model=model, levers="yes")


def test_an_error_that_is_not_out_of_memory_passes_through_and_the_lever_is_off_again():
    model, calls = Tower(), []

    def compute_loss(x):
        if torch.is_grad_enabled():
            calls.append(checkpointed(model))
            if not checkpointed(model):
                raise_fake_oom()
            raise ValueError("a bug of the user's")
        return model(x).sum()

    with pytest.raises(ValueError, match="a bug of the user's"):
        toma.accumulate(model=model, initial_micro_batch=1, groups="rows")(compute_loss)(torch.randn(1, 6))
    assert calls == [False, True] and not checkpointed(model)


UNDER_A_CAP = (
    CHECKPOINT_TOWER
    + """
import json
from toma import Halving, toma
x = torch.randn(2, 4096, 256)  # two rows of 4096 tokens: one row's activations need about 0.6 GiB plain
loss = lambda x: model(x).pow(2).mean()
loss(x[:1]).backward(); loss(x[1:]).backward()  # the reference, uncapped: the mean of the rows' means
expected = [p.grad.clone() / 2 for p in model.parameters()]
for p in model.parameters():
    p.grad.zero_()
set_cpu_memory_headroom(0.35)
plain = "fit"
try:
    loss(x[:1]).backward()
except RuntimeError as error:
    plain = "out of memory"
for p in model.parameters():
    p.grad.zero_()
stats = toma.accumulate(model=model, initial_micro_batch=2, policy=Halving())(loss)
stats(x)
worst = max(float((p.grad - e).norm() / e.norm()) for p, e in zip(model.parameters(), expected))
print(json.dumps([plain, stats.stats.levers, worst, "forward" in vars(model[0])]))
"""
)


@pytest.mark.slow
def test_under_a_real_cap_a_row_that_fails_plain_trains_checkpointed_to_the_uncapped_reference():
    out = run_python(UNDER_A_CAP, fresh=True, timeout=300)
    plain, levers, worst, still_on = json.loads(out.stdout.strip().splitlines()[-1])
    assert plain == "out of memory" and levers == ["activation checkpointing"]
    assert worst < 1e-5 and not still_on
