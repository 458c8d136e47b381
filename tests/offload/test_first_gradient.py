"""toma.offload.first_gradient: one call back at a tensor's first gradient, holding neither tensor nor owner."""

import gc
import weakref

import torch

from toma.offload.first_gradient import on_first_gradient


class Owner:
    def __init__(self):
        self.reached = []


def test_the_action_runs_once_at_the_first_gradient_with_the_tensor():
    owner, leaf = Owner(), torch.ones(3, requires_grad=True)
    on_first_gradient(leaf, owner, lambda held, tensor: held.reached.append(tensor.grad.clone()))
    out = (leaf * 2).sum()
    assert owner.reached == [], "not before a backward pass"
    out.backward(retain_graph=True)
    out.backward()
    assert len(owner.reached) == 1 and torch.equal(owner.reached[0], torch.full((3,), 2.0))
    assert torch.equal(leaf.grad, torch.full((3,), 4.0)), "the second pass still accumulates"


def test_neither_the_tensor_nor_the_owner_is_kept_alive():
    owner, leaf = Owner(), torch.ones(3, requires_grad=True)
    on_first_gradient(leaf, owner, lambda held, tensor: held.reached.append(tensor))
    tensor_ref, owner_ref = weakref.ref(leaf), weakref.ref(owner)
    out = (leaf * 2).sum()
    del leaf, owner
    gc.collect()
    assert owner_ref() is None, "the hook does not hold its owner"
    out.backward()  # the owner is gone: nothing to call
    del out
    gc.collect()
    assert tensor_ref() is None, "the tensor lives only as long as its graph"
