"""Batches as data: rows, cutting, joining, moving, re-cutting into logical batches."""

import pytest
import torch

from toma.batches import concatenate, logical_batches, rows, take, to_device


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
