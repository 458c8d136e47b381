"""`toma.sizing.defaults`: one registry says which policy each capability uses where a call gives none, and
`toma.DEFAULT_POLICY` reads the policy the forms use, then the assigned one for all."""

import torch

import toma as toma_package
from toma import FitToMemory, Halving, NoBatchsizeCache, ShrinkByFactor, explicit, toma
from toma.sizing.defaults import DEFAULTS

from helpers import raise_fake_oom


def test_each_capability_resolves_its_own_until_one_is_assigned_over_all():
    assert isinstance(DEFAULTS.calls.resolve(), Halving)
    assert isinstance(DEFAULTS.accumulation.resolve(), FitToMemory)
    assert isinstance(DEFAULTS.accelerate.resolve(), ShrinkByFactor)
    assert toma_package.DEFAULT_POLICY is DEFAULTS.calls.resolve()
    assigned = ShrinkByFactor(0.5)
    toma_package.DEFAULT_POLICY = assigned
    assert all(entry.resolve() is assigned for entry in DEFAULTS.capabilities.values())
    assert DEFAULTS.calls.own is not assigned, "a capability's own default is kept for when the assignment goes"


def test_the_registrys_repr_says_what_accumulation_and_the_trainers_use_and_how_to_change_each():
    text = repr(DEFAULTS)
    assert "accumulation: FitToMemory(" in text and "toma.Trainer, TomaTrainer, MicroBatching" in text
    assert "calls: Halving(" in text and "toma.DEFAULT_POLICY = ..." in text and "policy=" in text
    toma_package.DEFAULT_POLICY = ShrinkByFactor(0.9)
    assert "accumulation: ShrinkByFactor(" in repr(DEFAULTS), "the repr shows what a run would use now"


def test_what_default_policy_reads_is_what_a_form_given_none_uses():
    tried = []

    def work(batchsize):
        tried.append(batchsize)
        if batchsize > 20:
            raise_fake_oom()
        return batchsize

    explicit.batch(work, 64, toma_cache_type=NoBatchsizeCache)
    expected, size = [], 64
    while size is not None and size > 20:
        expected.append(size)
        size = toma_package.DEFAULT_POLICY.shrink(size)
    assert tried == [*expected, size]


def test_accumulation_given_no_policy_measures_and_follows_an_assigned_one():
    model = torch.nn.Linear(3, 1)

    @toma.accumulate(model=model, initial_micro_batch=8, cache_type=NoBatchsizeCache)
    def loss(x):
        return model(x).pow(2).mean()

    loss(torch.randn(8, 3))
    assert loss.stats.learned is not None, "FitToMemory keeps what it learned on the entry; Halving keeps nothing"
    toma_package.DEFAULT_POLICY = Halving()
    loss(torch.randn(8, 3))
    assert loss.stats.learned is None
