"""The one door into the engine: a Runner resolves the policy, the cache entry, the agreement and the observers,
and every capability goes through it, so `toma.DEFAULT_POLICY` is honoured everywhere."""

import ast
import pathlib

import pytest
import torch

import toma as toma_package
from toma import GlobalBatchsizeCache, NoBatchsizeCache, ShrinkByFactor, explicit, toma
from toma.core.caches import Batchsize
from toma.core.observers import Observer
from toma.core.policy import CallState
from toma.core.runner import Runner
from toma.core.steps import BatchStep
from toma.sizing import defaults
from toma.sizing.fit_to_memory import FitToMemory
from toma.sizing.policies import Halving

from helpers import raise_fake_oom

PACKAGE = pathlib.Path(toma_package.__file__).parent


def fails_above(limit, sizes):
    def work(size, *args):
        sizes.append(size)
        if size > limit:
            raise_fake_oom()
        return size

    return work


def test_each_capability_has_its_default_until_toma_default_policy_is_assigned():
    runner = Runner(defaults.ACCUMULATION)
    assert isinstance(runner.resolved_policy(), FitToMemory)
    assert isinstance(Runner(defaults.CALLS).resolved_policy(), Halving)
    toma_package.DEFAULT_POLICY = assigned = ShrinkByFactor(0.9)
    assert runner.resolved_policy() is assigned and Runner(defaults.CALLS).resolved_policy() is assigned
    given = Halving()
    assert Runner(defaults.ACCUMULATION, policy=given).resolved_policy() is given, "a given policy wins"


def test_toma_default_policy_reaches_accumulate_and_the_trainer():
    toma_package.DEFAULT_POLICY = ShrinkByFactor(0.9)
    model = torch.nn.Linear(3, 1)
    sizes = []

    def loss(x):
        if not torch.is_grad_enabled():  # toma's one check, without gradients, that the loss adds up
            return model(x).pow(2).mean()
        sizes.append(len(x))
        if len(x) > 40:
            raise_fake_oom()
        return model(x).pow(2).mean()

    explicit.accumulate(loss, model, 64, torch.randn(64, 3), toma_cache_type=NoBatchsizeCache)
    assert sizes[:5] == [64, 57, 51, 45, 40], "accumulation follows the assigned policy's sequence"
    data = [(torch.randn(4, 3), torch.randn(4, 1))]
    trainer = toma_package.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss(), data, batch_size=4, verbose=0
    )
    assert trainer.policy is toma_package.DEFAULT_POLICY


def test_a_runner_with_a_fixed_cache_keeps_one_entry_and_reports_the_state():
    cache = GlobalBatchsizeCache()
    runner = Runner(defaults.CALLS, cache=cache)
    sizes = []
    state = runner.drive(BatchStep(fails_above(10, sizes), (), {}), 64)
    assert isinstance(state, CallState)
    assert (state.size, state.attempts, state.failures) == (8, 4, 3)
    assert state.entry is cache.get_batchsize(64) and state.entry.value == 8
    sizes.clear()
    assert runner.perform(BatchStep(fails_above(10, sizes), (), {}), 64).result == 8 and sizes == [8]


def test_a_runner_checks_its_options_where_they_enter():
    with pytest.raises(TypeError, match="toma_policy"):
        Runner(defaults.CALLS, policy=3, prefix="toma_")
    with pytest.raises(TypeError, match="cache_type"):
        Runner(defaults.CALLS, cache_type=dict)


class Recorder(Observer):
    def __init__(self):
        self.events = []

    def starting(self, state):
        self.events.append(("starting", state.size))

    def retrying(self, state):
        self.events.append(("retrying", state.size, state.next_size, state.reason.split(":")[0]))
        assert state.error is None, "no observer sees the failed attempt's error (its frames must be freed)"


def test_observers_hear_each_run_and_each_retry():
    recorder = Recorder()
    runner = Runner(defaults.CALLS, cache=NoBatchsizeCache(), observers=[recorder])
    runner.perform(BatchStep(fails_above(20, []), (), {}), 64)
    assert recorder.events == [
        ("starting", 64),
        ("retrying", 64, 32, "OutOfMemoryError"),
        ("retrying", 32, 16, "OutOfMemoryError"),
    ]


def test_a_learning_policy_is_asked_once_per_failed_attempt():
    asked = []

    class Counting(FitToMemory):
        def after_oom(self, call):
            asked.append(call.size)
            assert call.error is not None, "the policy sees the error while it decides"
            return super().after_oom(call)

    state = CallState(BatchStep(lambda size: size, (), {}), Batchsize(None), Counting(), 8)
    error = torch.OutOfMemoryError("CUDA out of memory")
    first = state.propose(8, 8, error)
    assert state.propose(8, 8, error) == first and asked == [8], "the agreement and the engine share one answer"
    state.new_attempt()
    state.propose(4, 4, error)
    assert asked == [8, 4]


def test_no_module_outside_core_calls_the_engine():
    """Every form, trainer and integration enters through `toma.core.runner.Runner`."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("core/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "toma.core.engine":
                offenders.append(f"{relative}: from toma.core.engine import ...")
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "toma.core"
                and any(alias.name == "engine" for alias in node.names)
            ):
                offenders.append(f"{relative}: from toma.core import engine")
    assert offenders == []


def test_the_decorators_still_keep_caches_of_their_own():
    sizes = []

    @toma.batch(initial_batchsize=64)
    def first(batchsize):
        return fails_above(16, sizes)(batchsize)

    seen = []
    for _ in range(2):  # one call site
        sizes.clear()
        first()
        seen.append(list(sizes))
    assert seen == [[64, 32, 16], [16]], "the decorated function's own cache remembers"


def test_assigning_an_owners_policy_is_honoured_from_the_next_run():
    """A trainer's or an embedding's `policy` is built into its Runners; assigning it rebuilds them, keeping the
    caches, instead of being silently ignored."""
    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1))]
    trainer = toma_package.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss(), data, batch_size=4, verbose=0
    )
    cache = trainer._training.cache(None)
    trainer.policy = chosen = ShrinkByFactor(0.9)
    assert trainer.policy is chosen and trainer._evaluation.resolved_policy() is chosen
    assert trainer._training.cache(None) is cache, "the sizes learned so far are kept"
    with pytest.raises(TypeError, match="policy"):
        trainer.policy = 3
    embedding = toma_package.HostedEmbedding(10, 2, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert embedding.policy is None
    embedding.policy = chosen
    assert embedding.policy is chosen and embedding._runner.resolved_policy() is chosen
    runner = Runner(defaults.CALLS, cache=GlobalBatchsizeCache())
    assert runner.with_policy(chosen).cache(None) is runner.cache(None)
