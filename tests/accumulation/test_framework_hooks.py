"""The accumulation step's hooks for frameworks (toma.integrations): a backward pass of the framework's own
(`backward=`), and a token mean whose total spans more than the logical batch (`total=`)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toma.accumulation.accumulate import AccumulationOptions, MicroBatchSizing, accumulate
from toma.batching.splitting import ArgumentBatch
from toma.core.caches import GlobalBatchsizeCache
from toma.core.runner import Runner
from toma.sizing.defaults import ACCUMULATION
from toma.sizing.policies import Halving

from helpers import raise_fake_oom

RTOL, ATOL = 1e-5, 1e-6


def padded_tokens(rows=12, width=7, seed=0):
    """A tiny token model's batch: targets padded with -100, from 1 to `width` tokens per row."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, 20, (rows, width), generator=generator)
    lengths = torch.randint(1, width + 1, (rows, 1), generator=generator)
    targets = inputs.masked_fill(torch.arange(width) >= lengths, -100)
    return inputs, targets


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 20))


def tokens(batch):
    return (batch[1] != -100).sum()


def run(model, batch, initial, fail_above=None, **options):
    def micro_loss(inputs, targets):
        if fail_above is not None and len(inputs) > fail_above:
            raise_fake_oom()
        logits = model(inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    total = options.pop("total", None)
    accumulation = AccumulationOptions(model=model, reduction="mean", weight=tokens, **options)
    sizing = MicroBatchSizing(initial, Runner(ACCUMULATION, policy=Halving(), cache=GlobalBatchsizeCache()))
    return accumulate(lambda part: micro_loss(*part), ArgumentBatch((batch,), {}), accumulation, sizing, total)


@pytest.mark.parametrize("fail_above", [None, 4])
def test_a_total_beyond_the_batch_weighs_each_micro_batch_by_its_share_of_it(fail_above):
    """This batch is part of a mean over 3x its tokens (say three batches of an accumulation window): its
    gradients are the window's share, count / total for each micro-batch, whatever the split."""
    batch = padded_tokens()
    window_tokens = 3 * int(tokens(batch))
    model, reference = make_model(), make_model()
    loss = run(model, batch, 12, fail_above=fail_above, total=torch.tensor(window_tokens))
    logits = reference(batch[0])
    summed = F.cross_entropy(logits.flatten(0, 1), batch[1].flatten(), ignore_index=-100, reduction="sum")
    (summed / window_tokens).backward()
    torch.testing.assert_close(loss, (summed / window_tokens).detach(), rtol=RTOL, atol=ATOL)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


def test_a_backward_of_the_frameworks_own_runs_once_per_micro_batch_instead_of_tensor_backward():
    calls = []

    def backward(loss):
        calls.append(float(loss.detach()))
        (loss * 2).backward()  # a framework's scaling, to see that it is the one that ran

    model, reference = make_model(), make_model()
    batch = padded_tokens()
    loss = run(model, batch, 12, fail_above=4, backward=backward)
    assert len(calls) == 4, "12, 6 ran out of memory (never reaching backward); 3 fits: 4 micro-batches"
    assert sum(calls) == pytest.approx(float(loss), rel=1e-6)
    logits = reference(batch[0])
    (2 * F.cross_entropy(logits.flatten(0, 1), batch[1].flatten(), ignore_index=-100)).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


def test_a_batch_that_counts_nothing_inside_a_larger_mean_adds_nothing_without_an_error():
    """With `total=` the batch is part of a larger mean (a window, every rank's batches): counting nothing here
    is no error, the others count; its gradients stay untouched and its loss is 0, its share of the mean."""
    inputs, targets = padded_tokens()
    model = make_model()
    loss = run(model, (inputs, torch.full_like(targets, -100)), 12, total=torch.tensor(30))
    assert float(loss) == 0.0 and all(p.grad is None for p in model.parameters())


def test_a_total_of_zero_with_items_to_count_is_refused():
    with pytest.raises(ValueError, match="total is 0"):
        run(make_model(), padded_tokens(), 12, total=0)
