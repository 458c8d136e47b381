"""Splitting a call's arguments into micro-batches."""

from collections import OrderedDict, namedtuple

import pytest
import torch

from toma.batching.splitting import ArgumentBatch, whole

Pair = namedtuple("Pair", "left right")


def test_every_batch_tensor_is_split_also_when_nested():
    x, y, z = torch.arange(10), torch.arange(20).view(10, 2), torch.arange(30).view(10, 3)
    split = ArgumentBatch((x, [y, (z, "label")]), {"extra": {"mask": x > 4}, "scale": 2.0})
    assert split.size == 10
    args, kwargs = split.arguments(4, 7)
    assert torch.equal(args[0], x[4:7])
    assert isinstance(args[1], list) and torch.equal(args[1][0], y[4:7])
    assert isinstance(args[1][1], tuple) and torch.equal(args[1][1][0], z[4:7]) and args[1][1][1] == "label"
    assert torch.equal(kwargs["extra"]["mask"], (x > 4)[4:7])
    assert kwargs["scale"] == 2.0


def test_micro_batches_are_views_not_copies():
    x = torch.zeros(8, 3)
    args, _ = ArgumentBatch((x,), {}).arguments(2, 5)
    assert args[0].data_ptr() == x[2].data_ptr()


def test_the_full_range_hands_over_the_original_arguments():
    x = torch.zeros(8)
    args, kwargs = (x,), {"k": x}
    got_args, got_kwargs = ArgumentBatch(args, kwargs).arguments(0, 8)
    assert got_args is args and got_kwargs is kwargs


def test_zero_dim_tensors_non_tensors_and_whole_go_unsplit():
    x, weights, temperature = torch.zeros(6, 2), torch.ones(3), torch.tensor(0.5)
    split = ArgumentBatch((x, whole(weights), temperature, "text"), {})
    args, _ = split.arguments(0, 6)  # `whole` is unwrapped even when nothing is split
    assert args[1] is weights and args[2] is temperature and args[3] == "text"
    args, _ = split.arguments(2, 4)
    assert args[0].shape == (2, 2) and args[1] is weights and args[2] is temperature


def test_container_types_are_kept():
    x = torch.arange(6)
    args, _ = ArgumentBatch((Pair(x, x * 2), OrderedDict(a=x)), {}).arguments(1, 3)
    assert isinstance(args[0], Pair) and torch.equal(args[0].right, torch.tensor([2, 4]))
    assert isinstance(args[1], OrderedDict) and torch.equal(args[1]["a"], torch.tensor([1, 2]))


def test_disagreeing_batch_sizes_are_named():
    with pytest.raises(ValueError, match=r"args\[0\] has 8 rows, kwargs\['mask'\] has 4.*toma.whole"):
        ArgumentBatch((torch.zeros(8),), {"mask": torch.zeros(4)})


def test_an_empty_logical_batch_is_refused():
    with pytest.raises(ValueError, match=r"empty: args\[0\] has 0 rows"):
        ArgumentBatch((torch.zeros(0, 3),), {})


def test_a_call_without_batch_tensors_is_refused():
    with pytest.raises(ValueError, match="no tensor argument with a batch dimension"):
        ArgumentBatch((1, "x", torch.tensor(2.0), whole(torch.zeros(3))), {})


def test_lists_of_one_plain_value_per_row_are_split_with_the_rows():
    x = torch.arange(4)
    names, classes, tags = ["a", "b", "c", "d"], ["cat", "dog"], ("t0", "t1", "t2", "t3")
    split = ArgumentBatch((x, names), {"meta": {"tags": tags, "classes": classes}, "record": Pair("l", "r")})
    args, kwargs = split.arguments(1, 3)
    assert args[1] == ["b", "c"] and kwargs["meta"]["tags"] == ("t1", "t2")
    assert kwargs["meta"]["classes"] is classes, "a list of another length reaches every micro-batch whole"
    assert kwargs["record"] == Pair("l", "r")
    untouched = ArgumentBatch((x, classes), {})
    assert untouched.arguments(0, 2)[0][1] is classes


def test_micro_batches_cover_the_batch_and_never_span_two_pieces():
    from toma.batching.splitting import ArgumentPieces

    first, second = ArgumentBatch((torch.zeros(5, 2),), {}), ArgumentBatch((torch.zeros(3, 7),), {})
    assert [(s, e) for _, s, e in first.micro_batches(2)] == [(0, 2), (2, 4), (4, 5)]
    pieces = ArgumentPieces([first, second])
    assert pieces.size == 8 and pieces.largest == 5
    assert [(piece is first, s, e) for piece, s, e in pieces.micro_batches(4)] == [
        (True, 0, 2),  # 4 and 1 would leave a row alone: 2 and 3
        (True, 2, 5),
        (False, 0, 3),
    ]


@pytest.mark.parametrize(
    "rows, size, expected",
    [
        (33, 16, [16, 8, 9]),
        (9, 4, [4, 2, 3]),
        (4, 3, [2, 2]),
        (32, 16, [16, 16]),
        (10, 4, [4, 4, 2]),
        (3, 2, [2, 1]),  # two rows at most: an odd batch must leave one alone
        (1, 4, [1]),
    ],
)
def test_a_one_row_remainder_is_shared_with_the_micro_batch_before_it(rows, size, expected):
    split = ArgumentBatch((torch.zeros(rows, 2),), {})
    micro = split.micro_batches(size)
    assert [stop - start for _, start, stop in micro] == expected
    assert [start for _, start, _ in micro] == [sum(expected[:i]) for i in range(len(expected))]


def test_per_row_data_is_found_inside_sequences_and_a_shape_can_be_kept_whole():
    x = torch.arange(4)
    names, ids = ["a", "b", "c", "d"], [10, 11, 12, 13]
    scores = [torch.tensor(float(i)) for i in range(4)]
    split = ArgumentBatch((x, (names, ids), scores), {"size": whole((16, 16, 16, 16))})
    args, kwargs = split.arguments(1, 3)
    assert args[1] == (["b", "c"], [11, 12]), "as inside a dict: a tuple of per-row lists is looked into"
    assert [float(s) for s in args[2]] == [1.0, 2.0], "0-dim tensors are values: a list of them is per row"
    assert kwargs["size"] == (16, 16, 16, 16)


def test_cutting_a_long_per_row_list_does_not_walk_it_again_for_every_micro_batch(monkeypatch):
    import toma.batching.nested as nested

    rows_ = 4096
    split = ArgumentBatch((torch.zeros(rows_), [str(i) for i in range(rows_)]), {})
    walked = []
    real = nested._holds_batch_tensors
    monkeypatch.setattr(nested, "_holds_batch_tensors", lambda obj: walked.append(1) or real(obj))
    for _, start, stop in split.micro_batches(1):
        assert split.arguments(start, stop)[0][1] == [str(start)]
    assert not walked, "what is per-row was decided once, when the batch was scanned"


def _ids(tensors):
    return sorted(id(tensor) for tensor in tensors)


@pytest.mark.parametrize("start, stop", [(2, 5), (0, 6)])
def test_rows_names_the_split_tensors_of_a_micro_batch_and_nothing_else(start, stop):
    x, y, weights, temperature = torch.zeros(6, 2), torch.arange(6), torch.ones(3), torch.tensor(0.5)
    split = ArgumentBatch((x, {"y": y, "w": whole(weights)}, temperature, ["a", "b", "c", "d", "e", "f"]), {"k": x})
    rows = []
    args, kwargs = split.arguments(start, stop, rows)
    assert _ids(rows) == _ids([args[0], args[1]["y"], kwargs["k"]])  # not the whole value, not the 0-dim tensor
    assert args[1]["w"] is weights and args[2] is temperature and args[3] == ["a", "b", "c", "d", "e", "f"][start:stop]
    plain_rows = []
    plain = ArgumentBatch((x, y), {})
    plain_args, _ = plain.arguments(start, stop, plain_rows)
    assert _ids(plain_rows) == _ids(plain_args)


def test_placed_moves_what_is_in_whole_once_and_leaves_the_rest():
    x, weights, temperature, shape = torch.zeros(6, 2), torch.ones(3), torch.tensor(0.5), torch.Size([4, 4])
    split = ArgumentBatch((x, whole({"w": weights, "shape": shape}), temperature, whole(shape)), {"v": whole(weights)})
    moves = []

    def move(tensor):
        moves.append(tensor)
        return tensor.double()

    placed = split.placed(move)
    assert [id(t) for t in moves] == [id(weights), id(weights)]  # each place a whole tensor sits, once
    args, kwargs = placed.arguments(1, 3)
    assert torch.equal(args[0], x[1:3]) and args[2] is temperature
    assert args[1]["w"].dtype == torch.float64 and args[1]["shape"] is shape and args[3] is shape
    assert kwargs["v"].dtype == torch.float64 and placed.describe() == split.describe()
    assert split.arguments(1, 3)[0][1]["w"] is weights  # the original split is unchanged


def test_placed_is_the_split_itself_when_nothing_moves():
    split = ArgumentBatch((torch.zeros(6, 2), whole(torch.ones(3)), whole((224, 224))), {})
    assert split.placed(lambda tensor: tensor) is split
