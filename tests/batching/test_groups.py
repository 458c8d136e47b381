"""Rows that belong together: micro-batches of whole groups, their rows in batch order."""

import pytest
import torch

from toma import whole
from toma.batching.groups import GroupedBatch, check_groups, grouped_batch
from toma.batching.micro_batch_cost import MicroBatchCost
from toma.batching.splitting import ArgumentBatch
from toma.batching.tokens import TokenBatch


def preference_batch(pairs=4, width=6):
    """DPO's layout: the chosen rows first, the rejected second; reference log-probabilities one per pair."""
    ids = torch.arange(2 * pairs * width).reshape(2 * pairs, width)
    return {
        "input_ids": ids,
        "ref_chosen_logps": torch.arange(pairs).float(),
        "texts": [f"r{i}" for i in range(2 * pairs)],
    }


def test_pairs_keep_the_chosen_then_rejected_layout_in_every_micro_batch():
    batch = preference_batch()
    grouped = grouped_batch((batch,), {}, "pairs")
    assert isinstance(grouped, GroupedBatch) and grouped.size == 8 and grouped.unit_count == 4
    assert [(start, stop) for _, start, stop in grouped.micro_batches(4)] == [(0, 2), (2, 4)]
    ((part,), _) = grouped.arguments(2, 4)
    assert part["input_ids"][:, 0].tolist() == [12, 18, 36, 42], "chosen 2, 3 then rejected 2, 3"
    chosen, rejected = part["input_ids"].chunk(2)
    assert (rejected - chosen).eq(4 * 6).all(), "halving the micro-batch pairs its rows as halving the batch does"
    assert part["ref_chosen_logps"].tolist() == [2.0, 3.0], "one value per pair goes with its pair"
    assert part["texts"] == ["r2", "r3", "r6", "r7"]
    ((full,), _) = grouped.arguments(0, 4)
    assert full is batch


def test_a_pair_is_never_split_even_below_two_rows():
    grouped = grouped_batch((preference_batch(),), {}, "pairs")
    assert [(start, stop) for _, start, stop in grouped.micro_batches(1)] == [(i, i + 1) for i in range(4)]


def test_groups_from_a_function_hold_their_rows_and_the_batch_grouping_never_splits():
    x = torch.arange(6)

    def query(values):
        return [0, 1, 0, 2, 1, 0]

    grouped = grouped_batch((x,), {}, query)
    assert grouped.units == [[0, 2, 5], [1, 4], [3]]
    assert [(s, e) for _, s, e in grouped.micro_batches(4)] == [(0, 1), (1, 3)]
    ((part,), _) = grouped.arguments(1, 3)
    assert part.tolist() == [1, 3, 4]
    whole_batch = grouped_batch((x,), {}, "batch")
    assert [(s, e) for _, s, e in whole_batch.micro_batches(1)] == [(0, 1)]
    assert isinstance(grouped_batch((x,), {}, "rows"), ArgumentBatch)


def test_bad_groupings_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="groups must be 'rows'"):
        check_groups("pair", "groups")
    with pytest.raises(ValueError, match="even number of rows"):
        grouped_batch((torch.zeros(5, 2),), {}, "pairs")
    with pytest.raises(ValueError, match=r"one per pair \(2\), but args\[1\] has 3"):
        grouped_batch((torch.zeros(4, 2), torch.zeros(3)), {}, "pairs")
    with pytest.raises(ValueError, match="one group id for each of the 3 rows"):
        grouped_batch((torch.zeros(3),), {}, lambda x: [0, 1])


def test_token_packing_sorts_whole_groups_and_trims_to_the_longest_row_of_each_micro_batch():
    mask = torch.tensor(
        [[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]]
        + [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]]
    )
    batch = {"input_ids": mask * torch.arange(1, 9)[:, None], "attention_mask": mask, "ref": torch.arange(4.0)}
    grouped = grouped_batch((batch,), {}, "pairs")
    tokens = TokenBatch(grouped, "attention_mask", MicroBatchCost(1 << 40))
    assert tokens.order == [1, 2, 0, 3] and tokens.widths == [6, 4, 3, 2] and tokens.rows == [2, 2, 2, 2]
    micro = tokens.micro_batches(16)  # 2 pairs of width 4 fit 16 after the first pair's 12
    assert [(start, stop, width) for _, start, stop, width in micro] == [(0, 1, 6), (1, 3, 4), (3, 4, 2)]
    piece, start, stop, width = micro[1]
    ((part,), _) = piece.arguments(start, stop, width=width)
    assert part["input_ids"][:, 0].tolist() == [1, 3, 5, 7], "pairs 0 and 2 in batch order: chosen, then rejected"
    assert part["input_ids"].shape == (4, 4) and part["ref"].tolist() == [0.0, 2.0]
    assert tokens.area == 8 * 6 and tokens.area_between(1, 3) == 4 * 4


def test_whole_values_go_to_every_micro_batch():
    grouped = grouped_batch((torch.zeros(4, 2), whole(torch.ones(4))), {}, "pairs")
    (_, shared), _ = grouped.arguments(0, 1)
    assert shared.shape == (4,)


@pytest.mark.parametrize("groups", ["pairs", lambda x, meta: torch.arange(8) // 2])
def test_per_row_lists_inside_a_tuple_are_cut_with_their_rows_and_other_lengths_go_whole(groups):
    """A tuple of per-row lists (ids, texts) holds the rows' own data wherever it sits, as without groups; a tuple
    of another length (a shape) goes to every micro-batch whole, as without groups."""
    x = torch.arange(8)
    meta = (list(range(100, 108)), [f"t{i}" for i in range(8)], (3, 5, 7))
    grouped = grouped_batch((x, meta), {}, groups)
    ((part, (ids, texts, shape)), _) = grouped.arguments(0, 2)
    assert [i - 100 for i in ids] == part.tolist() and texts == [f"t{i}" for i in part.tolist()]
    assert shape == (3, 5, 7)
    assert len(part) == 4


def test_per_pair_lists_inside_a_tuple_go_with_their_pairs():
    x = torch.arange(8)
    grouped = grouped_batch((x, ([f"p{i}" for i in range(4)],)), {}, "pairs")
    ((part, (per_pair,)), _) = grouped.arguments(1, 3)
    assert part.tolist() == [1, 2, 5, 6] and per_pair == ["p1", "p2"]


@pytest.mark.parametrize("returned", [None, 3, "0101"])
def test_a_group_function_returning_no_id_per_row_is_refused_naming_it(returned):
    def my_groups(x):
        return returned

    with pytest.raises(TypeError, match=r"groups \(.*my_groups\) must return a group id for each row"):
        grouped_batch((torch.zeros(4),), {}, my_groups)
