"""The pieces of `toma.accumulation.fsdp2` that need no process group: how a unit's unsharded gradients are laid
out for a reduce-scatter (dim 0 in one chunk per rank, padded as FSDP2 pads), and how the ranks' agreement
(`toma.core.agreement`) turns an out-of-memory error at the smallest size into a retry in the lighter way."""

import pytest
import torch

from toma.accumulation.fsdp2 import _copy_padded, _padded_rows
from toma.core.agreement import FINISHED, LIGHTER, AgreedRetry, Agreement, RankFailed
from toma.sizing.policies import Halving


class _Param:
    def __init__(self, *shape: int) -> None:
        self.unsharded_param = torch.empty(shape)


@pytest.mark.parametrize(
    "shape, world, expected", [((6, 3), 2, (3, 9)), ((5, 3), 2, (3, 9)), ((1, 4), 4, (1, 4)), ((7,), 3, (3, 3))]
)
def test_a_parameters_rows_per_rank_are_its_dim_0_in_world_chunks_rounded_up(shape, world, expected):
    assert _padded_rows(_Param(*shape), world) == expected


@pytest.mark.parametrize("rows", [6, 5, 1])
def test_each_ranks_row_of_the_layout_is_its_torch_chunk_of_dim_0_then_zeros(rows):
    world = 2
    grad = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    per_rank, n = _padded_rows(_Param(rows, 3), world)
    into = torch.full((world, n), float("nan"))
    _copy_padded(grad, into, per_rank)
    chunks = torch.chunk(grad, world)
    for rank in range(world):
        piece = chunks[rank].reshape(-1) if rank < len(chunks) else torch.empty(0)
        assert torch.equal(into[rank, : piece.numel()], piece)
        assert torch.equal(into[rank, piece.numel() :], torch.zeros(n - piece.numel()))


def test_a_parameter_without_a_gradient_counts_as_zeros():
    into = torch.ones(2, 4)
    _copy_padded(None, into, 2)
    assert torch.equal(into, torch.zeros(2, 4))


def _agreement(answer: int, world: int = 2, rank: int = 0) -> "tuple[Agreement, list]":
    """An agreement whose ranks' MIN is `answer`, recording what this rank proposed."""
    agreement = Agreement.__new__(Agreement)
    agreement.rank, agreement.world_size, agreement.propose = rank, world, None
    proposed: list = []

    def _min(value: int) -> int:
        proposed.append(value)
        return answer

    agreement._min = _min  # type: ignore[method-assign]
    return agreement, proposed


def test_an_oom_at_the_smallest_size_with_a_lighter_way_makes_every_rank_retry_at_that_size():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    agreement, proposed = _agreement(LIGHTER)
    with pytest.raises(AgreedRetry) as retry:
        agreement.after_attempt(1, oom, Halving(), lighter=lambda: True)
    assert proposed == [LIGHTER] and retry.value.size == 1 and retry.value.lighter
    # the other rank, which finished, retries with it
    other, _ = _agreement(LIGHTER, rank=1)
    with pytest.raises(AgreedRetry) as retry:
        other.after_attempt(1, None, Halving())
    assert retry.value.lighter and retry.value.size == 1


def test_without_a_lighter_way_an_oom_at_the_smallest_size_stops_every_rank():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    agreement, proposed = _agreement(-(1 + 2 + 0))
    agreement.after_attempt(1, oom, Halving())  # returns: this rank's own error is re-raised by its caller
    assert proposed == [-(1 + 2 + 0)]


def test_an_oom_above_the_smallest_size_shrinks_first_and_another_ranks_bug_beats_the_lighter_way():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    agreement, proposed = _agreement(2)
    with pytest.raises(AgreedRetry) as retry:
        agreement.after_attempt(4, oom, Halving(), lighter=lambda: True)
    assert proposed == [2] and not retry.value.lighter
    agreement, _ = _agreement(-(1 + 1))  # rank 1 failed with an error that is not out of memory
    with pytest.raises(RankFailed, match="rank 1 failed with an error that is not out of memory"):
        agreement.after_attempt(1, oom, Halving(), lighter=lambda: True)


def test_before_an_attempt_the_ranks_agree_on_the_most_micro_batches_or_follow_a_rank_that_failed():
    agreement, proposed = _agreement(FINISHED - 5)
    assert agreement.before_attempt(3, 2) == 5 and proposed == [FINISHED - 2]
    agreement, _ = _agreement(1)  # a rank that ran out of memory before its first collective proposes 1
    with pytest.raises(AgreedRetry) as retry:
        agreement.before_attempt(3, 2)
    assert retry.value.size == 1 and not retry.value.lighter
