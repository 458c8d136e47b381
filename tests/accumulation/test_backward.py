"""A micro-loss's backward pass, chosen once per attempt: scaled, outside autocast, a framework's own."""

import torch

from toma.accumulation.backward import backward_pass, enabled_autocast


class Doubling:
    def scale(self, loss):
        return loss * 2


def test_with_nothing_to_add_the_backward_is_the_tensors_own_or_the_frameworks():
    assert backward_pass(None, None) is torch.Tensor.backward
    own = print
    assert backward_pass(own, None) is own


def test_a_scaler_scales_the_loss_before_the_backward():
    x = torch.ones(2, requires_grad=True)
    backward_pass(None, Doubling())((x * 3).sum())
    assert x.grad.tolist() == [6.0, 6.0]


def test_inside_autocast_the_backward_runs_outside_it():
    seen = []
    with torch.autocast("cpu"):
        assert enabled_autocast() == ("cpu",)
        backward = backward_pass(lambda loss: seen.append(torch.is_autocast_enabled("cpu")), None)
        backward(torch.ones(()))
    assert seen == [False] and enabled_autocast() == ()
