"""Rows by length: sorting, packing under a token budget, and which tensors are trimmed (and which never are)."""

import logging

import pytest
import torch

from toma.batching.micro_batch_cost import MicroBatchCost
from toma.batching.splitting import ArgumentBatch
from toma.batching.tokens import TokenBatch, check_lengths, restore_order

FILL = MicroBatchCost(1 << 40)  # a micro-batch costs so much that one is never split to save padding


def right_padded(lengths, width, vocab=50, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.randint(1, vocab, (len(lengths), width), generator=generator) * mask
    return ids, mask


def shapes_kw(token_batch, budget):
    token_batch.cost = FILL
    found = []
    for piece, start, stop, width in token_batch.micro_batches(budget):
        _, kwargs = piece.arguments(start, stop, width=width)
        found.append({key: tuple(value.shape) for key, value in kwargs.items()})
    return found


def packing(lengths, budget, overhead):
    ids, mask = right_padded(lengths, width=max(lengths))
    batch = ArgumentBatch(({"input_ids": ids, "attention_mask": mask},), {})
    tokens = TokenBatch(batch, "attention_mask", MicroBatchCost(overhead))
    return [(start, stop, width) for _, start, stop, width in tokens.micro_batches(budget)]


def test_rows_are_sorted_longest_first_and_packed_within_the_budget():
    ids, mask = right_padded([3, 9, 5, 9, 1, 6], width=10)
    tokens = TokenBatch(ArgumentBatch(({"input_ids": ids, "attention_mask": mask},), {}), "attention_mask", FILL)
    assert tokens.order == [1, 3, 5, 2, 0, 4], "longest first, ties in the call's order"
    assert tokens.widths == [9, 9, 6, 5, 3, 1]
    packed = [(start, stop, width) for _, start, stop, width in tokens.micro_batches(18)]
    assert packed == [(0, 2, 9), (2, 5, 6), (5, 6, 1)], "filled while a split never pays"
    assert all((stop - start) * width <= 18 for start, stop, width in packed)
    assert [(start, stop) for _, start, stop, _ in tokens.micro_batches(100)] == [(0, 6)]
    assert [(start, stop) for _, start, stop, _ in tokens.micro_batches(4)] == [(i, i + 1) for i in range(5)] + [
        (5, 6)
    ], "a row longer than the budget runs alone"
    sorted_ids = tokens.batch.args[0]["input_ids"]
    assert torch.equal(sorted_ids, ids[tokens.order]) and restore_order(tokens.order)[1] == 0


def test_a_micro_batch_is_split_where_the_padding_saved_is_worth_more_than_one_more_micro_batch():
    lengths = [3, 9, 5, 9, 1, 6]  # sorted: 9 9 6 5 3 1
    assert packing(lengths, 18, 0) == [(0, 2, 9), (2, 3, 6), (3, 4, 5), (4, 5, 3), (5, 6, 1)], "free: every width"
    # from the 6: rows 3..4 padded to 6 waste (6-5)x2 = 2, row 4 alone (6-3)x1 = 3: a split there saves 3
    assert packing(lengths, 18, 2) == [(0, 2, 9), (2, 4, 6), (4, 6, 3)]
    assert packing(lengths, 18, 3) == [(0, 2, 9), (2, 5, 6), (5, 6, 1)], "saving no more than it costs: no split"
    # one long row among many short ones: the long row goes alone unless a micro-batch costs more than the padding
    tail = [200] + [10] * 30
    assert packing(tail, 10**4, 1000)[0][:2] == (0, 1)
    assert packing(tail, 10**4, 10**5)[0][:2] == (0, 31)


def test_every_tensor_padded_like_the_rows_is_trimmed():
    ids, mask = right_padded([16, 4, 7, 2], width=16)
    labels = ids.masked_fill(mask == 0, -100)
    embeds = torch.randn(4, 16, 3)
    embeds[mask == 0] = torch.tensor([0.5, -1.0, 2.0])  # one pad vector
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels, inputs_embeds=embeds, scale=torch.ones(4))
    tokens = TokenBatch(ArgumentBatch((), batch), "attention_mask", FILL)
    second = tokens.micro_batches(16)[1]
    _, kwargs = second[0].arguments(second[1], second[2], width=second[3])
    assert second[3] == 7
    assert kwargs["input_ids"].shape == (2, 7) and kwargs["labels"].shape == (2, 7)
    assert kwargs["attention_mask"].shape == (2, 7) and kwargs["inputs_embeds"].shape == (2, 7, 3)
    assert torch.equal(kwargs["input_ids"], ids[[2, 1], :7]) and kwargs["scale"].shape == (2,)


def test_a_matrix_as_wide_as_the_mask_by_chance_is_never_trimmed_nor_is_anything_else(caplog):
    ids, mask = right_padded([16, 4, 7, 2], width=16)
    features = torch.randn(4, 16)  # (rows, 16) features: its width equals the mask's by chance
    with caplog.at_level(logging.INFO, logger="toma"):
        tokens = TokenBatch(
            ArgumentBatch((), dict(input_ids=ids, attention_mask=mask, features=features)), "attention_mask"
        )
    assert tokens.batch.trimmed == set() and tokens.widths == [16] * 4
    _, kwargs = tokens.batch.arguments(1, 3, width=7)
    assert kwargs["features"].shape == (2, 16) and kwargs["input_ids"].shape == (2, 16), "nothing misaligned"
    assert torch.equal(kwargs["features"], features[[2, 1]])
    assert any("kwargs['features'] is as wide as the rows but not padded" in r.getMessage() for r in caplog.records)


def test_a_tensor_of_another_width_is_not_trimmed_with_a_mask():
    ids, mask = right_padded([8, 3], width=8)
    other = torch.zeros(2, 12, dtype=torch.long)  # padded alike, but not the mask's width
    tokens = TokenBatch(ArgumentBatch((), dict(input_ids=ids, attention_mask=mask, other=other)), "attention_mask")
    assert shapes_kw(tokens, 3)[1]["other"] == (1, 12) and shapes_kw(tokens, 3)[1]["input_ids"] == (1, 3)


def test_left_padding_is_sorted_not_trimmed_also_with_position_ids_and_says_why_once(caplog):
    ids, mask = right_padded([5, 2, 3], width=5)
    left_ids, left_mask = ids.flip(1), mask.flip(1)
    positions = (left_mask.cumsum(1) - 1).clamp(min=0)
    with caplog.at_level(logging.INFO, logger="toma"):
        for extra in ({}, dict(position_ids=positions)):
            batch = dict(input_ids=left_ids, attention_mask=left_mask, **extra)
            tokens = TokenBatch(ArgumentBatch((), batch), "attention_mask")
            assert tokens.order == [0, 2, 1]
            assert [s["input_ids"] for s in shapes_kw(tokens, 5)] == [(1, 5), (1, 5), (1, 5)]
    said = [r.getMessage() for r in caplog.records if "left padding" in r.getMessage()]
    assert len(said) <= 1


def test_padding_on_both_sides_is_not_trimmed():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 1]])
    tokens = TokenBatch(ArgumentBatch((), dict(input_ids=mask * 7, attention_mask=mask)), "attention_mask")
    assert all(s["input_ids"][1] == 4 for s in shapes_kw(tokens, 4))


def test_lengths_from_a_function_trim_what_is_padded_past_them():
    ids, mask = right_padded([6, 2, 4], width=8)  # padded to 8, the longest row is 6
    tokens = TokenBatch(ArgumentBatch((ids, torch.randn(3, 5)), {}), lambda ids, _: (ids != 0).sum(1))
    assert tokens.widths == [6, 4, 2]
    (cut, features), _ = tokens.batch.arguments(0, 1, width=6)
    assert cut.shape == (1, 6) and features.shape == (1, 5), "narrower than the longest row: not per position"


def test_per_row_values_follow_their_rows():
    ids, mask = right_padded([2, 5, 3], width=5)
    texts = ["two", "five", "three"]
    tokens = TokenBatch(ArgumentBatch((), dict(input_ids=ids, attention_mask=mask, texts=texts)), "attention_mask")
    assert tokens.batch.kwargs["texts"] == ["five", "three", "two"]


def test_bad_lengths_are_named():
    with pytest.raises(TypeError, match="lengths must be the name of a 0/1 mask"):
        check_lengths(3, "lengths")
    ids, mask = right_padded([2, 5], width=5)
    with pytest.raises(ValueError, match="lengths='attention'.*no tensor 'attention'"):
        TokenBatch(ArgumentBatch((), dict(input_ids=ids, attention_mask=mask)), "attention")
    with pytest.raises(ValueError, match=r"must return a whole length of at least 0 for each of the 2 rows"):
        TokenBatch(ArgumentBatch((ids,), {}), lambda ids: [1, 2, 3])
    for returned in (None, 5, "25"):
        with pytest.raises(TypeError, match=r"lengths \(.*\) must return a length for each row .*got"):
            TokenBatch(ArgumentBatch((ids,), {}), lambda ids: returned)
    with pytest.raises(ValueError, match=r"must be \(rows, width\)"):
        TokenBatch(ArgumentBatch((), dict(input_ids=ids, attention_mask=mask[:, :, None])), "attention_mask")


@pytest.mark.parametrize("name", ["input_ids", "labels", "doubled"])
def test_lengths_naming_a_tensor_that_is_not_a_0_1_mask_is_refused_naming_it(name):
    """Token ids or labels are not a mask: taken as one, every row would count as full (nothing packed) or as what
    its ids happen to be; bool and float 0/1 masks are masks."""
    ids, mask = right_padded([3, 9, 5], width=10)
    batch = {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "doubled": mask * 2}
    batch.update(attention_mask=mask, as_bool=mask.bool(), as_float=mask.float())
    with pytest.raises(ValueError, match=f"lengths='{name}' must name a 0/1 mask .* holds other values"):
        TokenBatch(ArgumentBatch((batch,), {}), name, FILL)
    for mask_name in ("attention_mask", "as_bool", "as_float"):
        assert TokenBatch(ArgumentBatch((batch,), {}), mask_name, FILL).longest == 9
