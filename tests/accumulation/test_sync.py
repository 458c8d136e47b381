"""GradientSync, the interface of how an accumulation's gradients meet other ranks', and its one-process
strategies (the distributed ones run in tests/core/test_agreement.py's processes)."""

import inspect

import pytest
import torch
from torch import nn

from toma.accumulation import fsdp2_syncs, sync
from toma.accumulation.sync import GradientSync, LocalSync, model_device
from toma.accumulation.sync_choice import sync_for


def test_every_strategy_is_a_gradient_sync_and_only_the_interface_is_abstract():
    strategies = [c for _, c in inspect.getmembers(sync, inspect.isclass) if issubclass(c, GradientSync)]
    names = {c.__name__ for c in strategies}
    assert names == {
        "GradientSync",
        "LocalSync",
        "DDPNoSync",
        "AgreeingDDP",
        "AgreeingOnly",
    }
    assert [c.__name__ for c in strategies if inspect.isabstract(c)] == ["GradientSync"]
    with pytest.raises(TypeError):
        GradientSync()  # type: ignore[abstract]
    fsdp2 = [c for _, c in inspect.getmembers(fsdp2_syncs, inspect.isclass) if issubclass(c, GradientSync)]
    assert {c.__name__ for c in fsdp2} - names == {"AgreeingFSDP2", "ReducingFSDP2", "ShardedFSDP2"}
    assert [c.__name__ for c in fsdp2 if c.collectives_in_passes] == ["ShardedFSDP2"]


def test_a_module_on_one_process_syncs_locally_with_nothing_to_do():
    local = sync_for(nn.Linear(2, 1))
    assert isinstance(local, LocalSync) and local.agreement is None
    assert not local.copy_grads and local.watch_grads
    with local.scope(last=False), local.scope(last=True):
        pass
    local.reduce([torch.zeros(1)], None)
    local.reset()


def test_a_cpu_model_computes_on_the_cpu_and_one_without_parameters_nowhere():
    assert model_device(nn.Linear(2, 1).parameters()) == torch.device("cpu")
    assert model_device([]) is None
