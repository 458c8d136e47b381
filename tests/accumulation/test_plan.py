"""The micro-batch plan: which rows each micro-batch gets and what its loss is multiplied by."""

import pytest
import torch

from toma.accumulation.plan import MicroBatchPlan, NothingCounted, Weighting, shares
from toma.batching.splitting import ArgumentBatch


def test_shares_are_each_counts_part_of_the_total_and_none_for_a_count_of_nothing():
    assert shares([1.0, 0.0, 3.0], 4.0) == [0.25, None, 0.75]


def test_a_mean_over_rows_weighs_each_micro_batch_by_its_rows():
    plan = MicroBatchPlan(ArgumentBatch((torch.zeros(10, 2),), {}), 4, Weighting(mean=True))
    assert [(start, stop) for _, start, stop in plan.micro_batches] == [(0, 4), (4, 8), (8, 10)]
    assert plan.running == [(0, 0.4), (1, 0.4), (2, 0.2)]
    assert plan.weight == 10.0
    assert [tuple(args[0].shape) for args, _ in plan.arguments] == [(4, 2), (4, 2), (2, 2)]


def test_a_sum_adds_the_micro_losses_as_they_are():
    plan = MicroBatchPlan(ArgumentBatch((torch.zeros(6),), {}), 4, Weighting(mean=False))
    assert plan.running == [(0, 1.0), (1, 1.0)] and plan.weight == 6.0


def test_a_weight_counts_items_and_a_micro_batch_that_counts_none_does_not_run():
    labels = torch.tensor([1, 1, 0, 0, 1, 0])
    plan = MicroBatchPlan(ArgumentBatch((labels,), {}), 2, Weighting(mean=True, weight=lambda rows: rows.sum()))
    assert plan.running == [(0, 2 / 3), (2, 1 / 3)] and plan.weight == 3.0


def test_a_total_makes_the_counts_shares_of_more_than_the_batch():
    labels = torch.ones(4)
    plan = MicroBatchPlan(ArgumentBatch((labels,), {}), 2, Weighting(True, lambda rows: rows.sum(), torch.tensor(8)))
    assert plan.running == [(0, 0.25), (1, 0.25)] and plan.weight == 4.0


def test_nothing_counted_is_an_error_alone_and_left_to_the_ranks_with_them():
    batch = ArgumentBatch((torch.zeros(4),), {})
    with pytest.raises(NothingCounted, match="counted 0 items in the logical batch of 4 rows"):
        MicroBatchPlan(batch, 2, Weighting(True, lambda rows: rows.sum()))
    assert MicroBatchPlan(batch, 2, Weighting(True, lambda rows: rows.sum(), ranks=True)).running == []
