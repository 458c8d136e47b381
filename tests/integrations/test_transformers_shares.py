"""The micro-batches' shares TomaTrainer weights by, on their own: no Trainer, no model run."""

import pytest
import torch

pytest.importorskip("transformers")

from toma.batching.splitting import ArgumentBatch  # noqa: E402
from toma.integrations.transformers_shares import (  # noqa: E402
    LabelCount,
    Shares,
    check_additive,
    check_weight,
    has_labels,
    is_causal_lm,
)


def _batch(labels):
    return {"input_ids": torch.zeros_like(labels), "labels": labels}


def test_num_items_are_the_trainers_times_the_share_counted_in_rows_or_items():
    whole = _batch(torch.tensor([[1, 2], [3, -100], [-100, -100], [4, 5]]))
    part = {key: value[:2] for key, value in whole.items()}
    by_rows = Shares(None, None, 4, 10, 1)
    assert by_rows.num_items_for(whole, whole) == 10 and by_rows.num_items_for(part, whole) == 5
    count = LabelCount(shifted=False)
    by_items = Shares(count, count(whole), 4, 10, 1)
    assert float(by_items.num_items_for(part, whole)) == pytest.approx(10 * 3 / 5)
    assert by_items.num_items_for(whole, whole) == 10, "the whole batch: the Trainer's own value, as it is"
    assert Shares(None, None, 4, None, 1).num_items_for(part, whole) is None
    assert by_rows.weight_of(part, whole) == 2 and int(by_items.weight_of(part, whole)) == 3


def test_label_count_skips_ignored_labels_and_the_first_position_when_shifted():
    batch = _batch(torch.tensor([[1, 2, -100], [-100, 3, 4]]))
    assert int(LabelCount(shifted=False)(batch)) == 4
    assert int(LabelCount(shifted=True)(batch)) == 3
    assert int(LabelCount(shifted=True)({**batch, "shift_labels": torch.tensor([[7, -100]])})) == 1


def test_has_labels_and_is_causal_lm():
    assert has_labels({"labels": torch.ones(2)}) and has_labels({"shift_labels": torch.ones(2)})
    assert not has_labels({"input_ids": torch.ones(2)}) and not has_labels(torch.ones(2))
    assert not is_causal_lm(torch.nn.Linear(2, 2)) and not is_causal_lm(object())


def test_check_weight_and_check_additive():
    assert check_weight(None) is None and check_weight(len) is len
    with pytest.raises(TypeError, match="toma_weight must be a function"):
        check_weight(3)
    batch = ArgumentBatch((_batch(torch.tensor([[1], [2], [3], [4]])),), {}, name="inputs")
    check_additive(lambda part: len(part["labels"]), batch, 4.0)
    with pytest.raises(ValueError, match="row by row"):
        check_additive(lambda part: 1, batch, 1.0)
