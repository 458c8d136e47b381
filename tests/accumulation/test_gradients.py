"""GradientStash: an attempt's gradients count only if it finishes."""

import pytest
import torch

from toma.accumulation.gradients import GradientStash


def make_params():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    return a, b


def backward(a, b, factor=1.0):
    ((a * factor).sum() + (b * 2 * factor).sum()).backward()


def test_a_finished_attempt_adds_to_the_gradients_set_aside_in_place():
    a, b = make_params()
    a.grad = torch.full((3,), 10.0)
    kept = a.grad
    with GradientStash([a, b]):
        assert a.grad is None  # the attempt starts from nothing
        backward(a, b)
    assert a.grad is kept and torch.equal(a.grad, torch.full((3,), 11.0))
    assert torch.equal(b.grad, torch.full((2,), 2.0))


def test_from_none_there_is_nothing_to_set_aside():
    a, b = make_params()
    with GradientStash([a, b]):
        backward(a, b)
    assert torch.equal(a.grad, torch.ones(3)) and torch.equal(b.grad, torch.full((2,), 2.0))


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_a_failed_attempt_leaves_every_gradient_as_it_was(error):
    a, b = make_params()
    a.grad = torch.full((3,), 10.0)
    kept = a.grad
    with pytest.raises(type(error)):
        with GradientStash([a, b]):
            backward(a, b)
            raise error
    assert a.grad is kept and torch.equal(kept, torch.full((3,), 10.0))
    assert b.grad is None


def test_a_failed_attempt_from_none_leaves_none():
    a, b = make_params()
    with pytest.raises(RuntimeError):
        with GradientStash([a, b]):
            backward(a, b)
            raise RuntimeError
    assert a.grad is None and b.grad is None


def test_an_unused_parameter_keeps_its_gradient():
    a, b = make_params()
    b.grad = torch.full((2,), 5.0)
    with GradientStash([a, b]):
        a.sum().backward()
    assert torch.equal(b.grad, torch.full((2,), 5.0)) and torch.equal(a.grad, torch.ones(3))


def test_with_copy_the_values_survive_when_the_set_aside_memory_is_written():
    """DDP with gradient_as_bucket_view writes the reduced gradients into the memory the old .grad views."""
    a, b = make_params()
    a.grad = torch.full((3,), 10.0)
    bucket = a.grad
    with GradientStash([a, b], copy=True):
        backward(a, b)
        bucket.copy_(a.grad)  # what the reducer does: new values into the bucket, .grad becomes its view
        a.grad = bucket
    assert a.grad is bucket and torch.equal(a.grad, torch.full((3,), 11.0))
    assert torch.equal(b.grad, torch.full((2,), 2.0))


def test_with_copy_a_failed_attempt_puts_the_old_values_back_into_the_same_tensor():
    a, b = make_params()
    a.grad = torch.full((3,), 10.0)
    bucket = a.grad
    with pytest.raises(torch.OutOfMemoryError):
        with GradientStash([a, b], copy=True):
            backward(a, b)
            bucket.fill_(-1.0)  # a reduction that got half-way
            raise torch.OutOfMemoryError("out of memory")
    assert a.grad is bucket and torch.equal(bucket, torch.full((3,), 10.0))
    assert b.grad is None
