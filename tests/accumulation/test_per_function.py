"""What toma learns about a loss function (toma.accumulation.per_function) is kept for its code and settings, so
that the forms that wrap it anew at every call (`explicit.accumulate`, an inline `toma.accumulate(...)(f)(...)`)
check its loss and time its micro-batches once, as a decorated function does, not at every call."""

import torch
import torch.nn.functional as F
from torch import nn

from toma import explicit, toma
from toma.accumulation.per_function import learned_about


def padded_batch(rows=96, width=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width) < lengths[:, None]).long()
    ids = torch.randint(1, 50, (rows, width), generator=generator) * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_the_micro_batch_cost_is_measured_once_for_a_function_wrapped_at_every_call():
    """Each call used to start timing its micro-batches anew (and pack as if nothing was measured): now the
    measurement is the function's, finished after the first calls, and shared by the inline form."""
    model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50))
    batch = padded_batch()

    def token_loss(batch):
        return F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten())

    def label_tokens(batch):
        return (batch["labels"] != -100).sum()

    for _ in range(4):
        explicit.accumulate(token_loss, model, 16, batch, toma_lengths="attention_mask", toma_weight=label_tokens)
    learned = learned_about(token_loss, "mean", label_tokens, "attention_mask")
    assert not learned.packing.timing, "measured over the calls, then no more timing"
    assert learned.split_check.done
    inline = toma.accumulate(model=model, initial_micro_batch=16, lengths="attention_mask", weight=label_tokens)
    assert inline(token_loss).stats.packing is learned.packing
    assert learned_about(token_loss, "sum", None, "attention_mask") is not learned, "other settings: another"


def test_a_callable_object_is_learned_about_per_wrapper():
    class Loss:
        def __call__(self, inputs):
            return inputs.sum()

    loss = Loss()
    assert learned_about(loss, "mean") is not learned_about(loss, "mean")
