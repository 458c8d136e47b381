"""Batches as data: rows, cutting, joining, moving, re-cutting into logical batches."""

import pytest
import torch

from toma.batching.batches import (
    Pieces,
    concatenate,
    group_cut_widths,
    logical_batches,
    rows,
    take,
    to_device,
    whole_batch_count,
)


def batch(start, n):
    x = torch.arange(start, start + n)
    return {"x": x, "pair": (x * 2, "tag")}, x + 100


def test_rows_take_and_concatenate_nested_batches():
    a, b = batch(0, 3), batch(3, 5)
    assert rows(a) == 3
    joined = concatenate([a, b])
    assert rows(joined) == 8 and torch.equal(joined[0]["x"], torch.arange(8)) and joined[0]["pair"][1] == "tag"
    part = take(joined, 2, 6)
    assert torch.equal(part[1], torch.arange(102, 106)) and torch.equal(part[0]["pair"][0], torch.arange(2, 6) * 2)
    with pytest.raises(ValueError, match="disagree"):
        rows((torch.zeros(3), torch.zeros(4)))


def test_to_device_moves_every_tensor():
    moved = to_device(batch(0, 4), "cpu")
    assert torch.equal(moved[0]["x"], torch.arange(4)) and moved[0]["pair"][1] == "tag"


def test_logical_batches_pass_through_join_and_cut():
    exact = [batch(0, 4), batch(4, 4)]
    assert all(out is given for out, given in zip(logical_batches(exact, 4), exact, strict=True))
    small = [batch(i, 3) for i in range(0, 12, 3)]  # 4 batches of 3 rows -> 5, 5, 2
    cut = list(logical_batches(small, 5))
    assert [rows(b) for b in cut] == [5, 5, 2]
    assert torch.equal(torch.cat([b[1] for b in cut]), torch.arange(100, 112))
    big = list(logical_batches([batch(0, 11)], 4))
    assert [rows(b) for b in big] == [4, 4, 3]


def test_lists_of_one_item_per_row_are_cut_and_joined_with_their_rows():
    a = (torch.arange(3), ["r0", "r1", "r2"], ("x0", "x1", "x2"))
    b = (torch.arange(3, 5), ["r3", "r4"], ("x3", "x4"))
    joined = concatenate([a, b])
    assert joined[1] == ["r0", "r1", "r2", "r3", "r4"] and joined[2] == ("x0", "x1", "x2", "x3", "x4")
    assert take(joined, 1, 3)[1] == ["r1", "r2"]
    cut = list(logical_batches([a, b], 4))
    assert [c[1] for c in cut] == [["r0", "r1", "r2", "r3"], ["r4"]]
    assert [c[0].tolist() for c in cut] == [[0, 1, 2, 3], [4]]


def test_what_cannot_be_split_with_the_rows_is_refused_when_batches_are_recut():
    odd = (torch.arange(4), ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"cannot cut .*batch\[1\] is a list of 3 items for 4 rows"):
        list(logical_batches([odd], 3))
    with pytest.raises(ValueError, match=r"cannot join .*batch\[1\]"):
        concatenate([(torch.arange(2), "train"), (torch.arange(2), "eval")])
    assert concatenate([(torch.arange(2), "train"), (torch.arange(1), "train")])[1] == "train"


def test_batches_of_different_widths_become_pieces_not_one_tensor():
    narrow, wide, narrow_too = torch.zeros(2, 3), torch.ones(2, 5), torch.zeros(2, 3)
    (logical,) = list(logical_batches([(narrow, narrow[:, 0]), (wide, wide[:, 0]), (narrow_too, narrow_too[:, 0])], 6))
    assert isinstance(logical, Pieces) and [s[0].shape[1] for s in logical] == [3, 5, 3]
    assert rows(logical) == 6
    (joined,) = list(logical_batches([(narrow, narrow[:, 0]), (narrow_too, narrow_too[:, 0])], 4))
    assert not isinstance(joined, Pieces) and joined[0].shape == (4, 3)


def test_zero_dim_tensors_are_values_joined_only_when_equal_and_lists_of_them_are_per_row():
    a = {"x": torch.zeros(2, 3), "temperature": torch.tensor(0.5), "scores": [torch.tensor(1.0), torch.tensor(2.0)]}
    b = {"x": torch.ones(2, 3), "temperature": torch.tensor(0.5), "scores": [torch.tensor(3.0), torch.tensor(4.0)]}
    joined = concatenate([a, b])
    assert torch.equal(joined["temperature"], torch.tensor(0.5))
    assert [float(s) for s in joined["scores"]] == [1.0, 2.0, 3.0, 4.0]
    assert [float(s) for s in take(joined, 1, 3)["scores"]] == [2.0, 3.0]
    b["temperature"] = torch.tensor(0.7)
    with pytest.raises(ValueError, match=r"batch\['temperature'\] \(Tensor\)"):
        concatenate([a, b])  # not silently the first batch's value


def test_per_row_lists_inside_a_tuple_of_lists_are_cut_and_joined_like_inside_a_dict():
    names, ids = ["a", "b", "c", "d"], [10, 11, 12, 13]
    batch = (torch.arange(4), (names, ids))
    part = take(batch, 1, 3)
    assert part[1] == (["b", "c"], [11, 12])
    other = (torch.arange(4, 6), (["e", "f"], [14, 15]))
    joined = concatenate([batch, other])
    assert joined[1] == (names + ["e", "f"], ids + [14, 15])
    assert [b[1] for b in logical_batches([batch, other], 3)] == [
        (["a", "b", "c"], [10, 11, 12]),
        (["d", "e", "f"], [13, 14, 15]),
    ]


def test_batches_whose_rows_belong_together_are_never_cut_or_stacked_row_by_row():
    """Under groups (pairs: chosen rows then their rejected rows, laid out per loader batch), a logical batch holds
    whole loader batches as pieces, as many as batch_size rows hold; a larger batch is cut by whole pairs under
    "pairs" and refused under any other grouping."""
    loaded = [torch.arange(8) + 8 * k for k in range(5)]
    found = list(logical_batches(loaded, 16, "pairs"))
    assert [type(b) for b in found] == [Pieces, Pieces, torch.Tensor]
    assert [[p.tolist() for p in b] for b in found[:2]] == [[t.tolist() for t in loaded[i : i + 2]] for i in (0, 2)]
    assert torch.equal(found[2], loaded[4])
    assert whole_batch_count([8] * 5, 16) == 3
    uneven = list(logical_batches([torch.zeros(6)] * 4, 16, "pairs"))
    assert [rows(b) for b in uneven] == [12, 12] and whole_batch_count([6] * 4, 16) == 2
    chosen_then_rejected = torch.arange(20)  # pair i: rows i and i + 10
    cut = list(logical_batches([chosen_then_rejected], 8, "pairs"))
    assert [b.tolist() for b in cut] == [[0, 1, 2, 3, 10, 11, 12, 13], [4, 5, 6, 7, 14, 15, 16, 17], [8, 9, 18, 19]]
    assert group_cut_widths(20, 8, "pairs") == [8, 8, 4] and group_cut_widths(20, 8, "batch") == [20]
    with pytest.raises(ValueError, match=r"32 rows, more than batch_size=16, and groups='batch'"):
        list(logical_batches([torch.zeros(32)], 16, "batch"))
    with pytest.raises(ValueError, match=r"more than batch_size=1, and groups='pairs'"):
        list(logical_batches([torch.zeros(4)], 1, "pairs"))
