"""The retry engine: what it frees, what it lets through, and what a call that fits costs it."""

import gc
import inspect
import json
import traceback
import weakref

import pytest
import torch

from toma import GlobalBatchsizeCache, NoBatchsizeCache, explicit, simple, toma
from toma.core import engine
from toma.core.caches import Batchsize
from toma.core.oom import should_reduce_batch_size
from toma.core.policy import LearningPolicy
from toma.core.steps import Step
from toma.sizing.policies import Halving

from helpers import COLLECT_TOMA_LOG, raise_fake_oom, requires_cuda, run_python


@pytest.fixture
def no_automatic_gc():
    """Only explicit collections run, so a test sees exactly what toma frees and when."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_failed_attempt_is_released_before_the_retry_starts(no_automatic_gc):
    refs = []
    alive_when_attempt_starts = []

    def attempt(batchsize):
        alive_when_attempt_starts.append([ref() is not None for ref in refs])
        activations = torch.empty(batchsize, 1024)
        # Reachable only through a reference cycle held by this frame: only a collection that runs after
        # the traceback is gone can free it.
        holder = [activations]
        holder.append(holder)
        refs.append(weakref.ref(activations))
        if batchsize > 4:
            raise_fake_oom()
        return batchsize

    assert simple.batch(attempt, 16) == 4
    assert alive_when_attempt_starts == [[], [False], [False, False]]


def test_failed_chunk_is_released_before_the_chunk_is_retried(no_automatic_gc):
    refs = []
    alive = []

    def chunk_fn(chunk, start, end):
        alive.append(sum(ref() is not None for ref in refs))
        scratch = chunk.clone()
        cycle = {"t": scratch}
        cycle["self"] = cycle
        refs.append(weakref.ref(scratch))
        if end - start > 2:
            raise_fake_oom()

    toma.chunked(initial_step=8)(chunk_fn)(torch.zeros(8, 4))
    # Attempts 2 and 3 start right after a failure; by then nothing of the failed chunk may be alive.
    assert alive[1:3] == [0, 0]


def test_engine_drops_its_reference_to_the_error():
    """After the retry, the error (and through it the failed frames) is unreachable from toma's frames."""
    errors = []

    def attempt(batchsize):
        if batchsize > 1:
            error = torch.OutOfMemoryError("CUDA out of memory.")
            errors.append(weakref.ref(error))
            raise error
        return [ref() for ref in errors]

    assert simple.batch(attempt, 2) == [None]


def test_foreign_errors_pass_through_untouched():
    original = ValueError("not a memory problem")
    calls = []

    def attempt(batchsize):
        calls.append(batchsize)
        raise original

    for run in (
        lambda: simple.batch(attempt, 8),
        lambda: toma.batch(initial_batchsize=8)(attempt)(),
        lambda: explicit.range(lambda s, e: attempt(e - s), 0, 16, 8),
    ):
        calls.clear()
        with pytest.raises(ValueError) as info:
            run()
        assert info.value is original
        assert calls == [8], "no retry for an error that is not out-of-memory"
        assert not hasattr(original, "__notes__")
        assert original.__context__ is None and original.__cause__ is None
        frames = traceback.extract_tb(original.__traceback__)
        assert frames[-1].name == "attempt" and frames[-1].line == "raise original"
        assert [f.name for f in frames].count("run") == 1, "re-raised once, not wrapped or chained"
        original.__traceback__ = None


def test_keyboard_interrupt_is_never_caught(monkeypatch):
    classified = []
    monkeypatch.setattr(engine, "should_reduce_batch_size", lambda e: classified.append(e) or True)
    calls = []

    def attempt(batchsize):
        calls.append(batchsize)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        toma.batch(initial_batchsize=8)(attempt)()
    assert calls == [8] and classified == []


def test_system_exit_passes_through():
    with pytest.raises(SystemExit):
        simple.batch(lambda bs: exit(3), 4)


def test_range_never_repeats_a_finished_chunk():
    done = []

    def f(start, end):
        if end - start > 3 and start >= 8:
            raise_fake_oom()
        done.append((start, end))

    simple.range(f, 0, 20, 8)
    covered = [i for s, e in done for i in range(s, e)]
    assert covered == list(range(20)), "every index exactly once, in order"


def test_a_custom_step_drives_the_engine():
    """A new form is a new step (a subclass of `Step` that overrides what it knows), not a new loop."""

    class Doubling(Step):
        func = staticmethod(lambda size: None)
        size_name = "width"

        def __init__(self):
            self.sizes = []

        def __call__(self, size):
            self.sizes.append(size)
            if size > 3:
                raise_fake_oom()
            return len(self.sizes) >= 4

    step = Doubling()
    entry = Batchsize(None)
    engine.run(step, entry, 12, Halving())
    assert step.sizes == [12, 6, 3, 3] and entry.value == 3


def test_engine_records_the_shrunken_size_in_the_entry():
    entry = Batchsize(None)
    step = engine.BatchStep(lambda bs: raise_fake_oom() if bs > 5 else bs, (), {})
    engine.run(step, entry, 40, Halving())
    assert (step.result, entry.value) == (5, 5)


def test_a_call_that_fits_does_no_gc_no_cache_emptying_no_stack_inspection(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("called on the hot path")

    monkeypatch.setattr(gc, "collect", forbidden)
    monkeypatch.setattr(torch.cuda, "empty_cache", forbidden)
    monkeypatch.setattr(inspect, "stack", forbidden)
    t = torch.zeros(16, 2)
    for cache_type in (None, NoBatchsizeCache, GlobalBatchsizeCache):
        assert toma.batch(initial_batchsize=8, cache_type=cache_type)(lambda bs: bs)() == 8
        toma.range(initial_step=4, cache_type=cache_type)(lambda s, e: None)(0, 16)
        toma.chunked(initial_step=4, cache_type=cache_type)(lambda c, s, e: None)(t)
    explicit.batch(lambda bs: bs, 8)
    explicit.range(lambda s, e: None, 0, 8, 4)
    explicit.chunked(lambda c, s, e: None, t, 4)
    simple.batch(lambda bs: bs, 8)
    simple.range(lambda s, e: None, 0, 8, 4)
    simple.chunked(lambda c, s, e: None, t, 4)
    toma.execute.batch(8)(lambda bs: bs)
    toma.execute.range(0, 8, 4)(lambda s, e: None)
    toma.execute.chunked(t, 4)(lambda c, s, e: None)
    model = torch.nn.Linear(2, 1)
    toma.accumulate(model=model, initial_micro_batch=4, reduction="sum")(lambda x: model(x).sum())(t)
    explicit.accumulate(lambda x: model(x).sum(), model, 4, t, toma_reduction="sum")


def test_memory_is_released_after_each_oom(monkeypatch):
    releases = []
    monkeypatch.setattr(engine, "release_memory", lambda: releases.append(1))
    simple.batch(lambda bs: raise_fake_oom() if bs > 2 else bs, 16)
    assert len(releases) == 3


def test_a_policy_that_does_not_shrink_is_refused_instead_of_looping_forever():
    class Stubborn(Halving):
        def shrink(self, size):
            return size

    with pytest.raises(ValueError, match="must return a smaller whole size") as info:
        explicit.batch(lambda bs: raise_fake_oom(), 8, toma_policy=Stubborn())
    assert isinstance(info.value.__context__, torch.OutOfMemoryError), "the OOM stays visible"
    assert not should_reduce_batch_size(info.value), "an outer toma layer does not retry a broken policy"


@pytest.mark.parametrize("returned", [4.0, 4.5, True])
def test_a_policy_that_shrinks_to_a_size_that_is_no_int_is_refused_before_the_work_sees_it(returned):
    class Fractional(Halving):
        def shrink(self, size):
            return returned

    seen = []

    def work(batch_size):
        seen.append(batch_size)
        raise_fake_oom()

    with pytest.raises(ValueError, match="whole size") as info:
        explicit.batch(work, 8, toma_policy=Fractional())
    assert seen == [8] and repr(returned) in str(info.value)


class _RecordingPolicy(LearningPolicy, Halving):
    """A learning policy that only notes the device each hook is told about."""

    def __init__(self):
        super().__init__()
        self.devices = []

    def start(self, call):
        self.devices.append(("start", call.device))
        return call.size

    def begin(self, call):
        self.devices.append(("begin", call.device))
        return None

    def succeeded(self, call):
        return None

    def after_oom(self, call):
        return self.shrink(call.size)

    def explain(self, call):
        return ""


def test_an_attempt_above_the_largest_size_that_fit_gets_the_cached_blocks_back_first(monkeypatch):
    returned, sizes = [], []
    monkeypatch.setattr(engine, "return_cached_blocks", lambda: returned.append(sizes[-1] if sizes else None))
    monkeypatch.setattr(gc, "collect", lambda *a: (_ for _ in ()).throw(AssertionError("no collection to grow")))

    class Growing(_RecordingPolicy):
        def start(self, call):
            return self.target

    policy, entry = Growing(), Batchsize(None)
    step = lambda: engine.BatchStep(lambda bs: sizes.append(bs), (), {})  # noqa: E731
    for target in (8, 8, 12, 12, 6, 20):
        policy.target = target
        engine.run(step(), entry, 64, policy)
    assert sizes == [8, 8, 12, 12, 6, 20]
    # noted as the size that ran just before: only 12 (after 8) and 20 (after 6) are above every size that fit
    assert returned == [8, 6]


def test_a_learning_policy_is_told_the_device_the_step_runs_on():
    from fake_cuda_memory import on_cuda_1

    policy = _RecordingPolicy()
    arguments = (torch.zeros(2), [on_cuda_1(torch.zeros(3))])  # a host tensor, and one on cuda:1 in a list
    step = engine.BatchStep(lambda bs, *_: raise_fake_oom() if bs > 2 else bs, arguments, {})
    engine.run(step, Batchsize(None), 8, policy)
    on_1 = ("begin", torch.device("cuda", 1))
    assert policy.devices == [("start", torch.device("cuda", 1)), on_1, on_1, on_1]


def test_every_step_says_where_its_work_runs():
    from toma.accumulation.options import AccumulationOptions
    from toma.accumulation.step import AccumulateStep
    from toma.batching.splitting import ArgumentBatch
    from toma.batching.transfer import Transfers
    from toma.offload.host_map import MapStep
    from toma.offload.hosted_embedding import HostedEmbedding, _RowUpdate

    from fake_cuda_memory import on_cuda_1

    cuda1, cpu = torch.device("cuda", 1), torch.device("cpu")
    x, host = on_cuda_1(torch.zeros(4, 2)), torch.zeros(4, 2)

    def f(*args, **kwargs):
        return None

    assert engine.BatchStep(f, (host, {"rows": x}), {}).device == cuda1
    assert engine.BatchStep(f, (host,), {"flag": True}).device is None, "host tensors say nothing: not known"
    assert engine.RangeStep(f, 0, 4, (), {"x": x}).device == cuda1
    assert engine.RangeStep(f, 0, 4, (x,), {}, device=cpu).device == cpu, "a device given wins"
    assert engine.ChunkStep(f, x, 0, (), {}).device == cuda1
    assert engine.ChunkStep(f, host, 0, (x,), {}).device == cuda1
    assert MapStep(f, ArgumentBatch((host,), {}), Transfers("cpu"), cpu).device == cpu  # toma.map(..., device="cpu")
    model = torch.nn.Linear(2, 1)
    policy = Halving()
    assert AccumulateStep(f, ArgumentBatch((host,), {}), AccumulationOptions(model=model), policy).device == cpu
    table = HostedEmbedding(10, 2, optimizer=lambda params: torch.optim.SGD(params, lr=0.1), device="cpu")
    ids = torch.arange(3)
    assert _RowUpdate(table, ids, torch.zeros(3, 2), torch.zeros(3, 2)).device == cpu


GROWING_ON_A_WARM_CACHE = (
    COLLECT_TOMA_LOG
    + """
import json, torch
from toma import toma
from toma.core.policy import LearningPolicy
from toma.sizing.policies import Halving

torch.manual_seed(0)
width, hidden = 1024, 4096
w1, w2, w3 = (torch.randn(a, b, device="cuda") / a**0.5 for a, b in ((width, hidden), (hidden, hidden), (hidden, 10)))

def work(size):
    x = torch.randn(size, width, device="cuda")
    return float((torch.relu(torch.relu(x @ w1) @ w2) @ w3).sum())

def fits(size):
    try:
        work(size)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        torch.cuda.empty_cache()

work(8)  # cuBLAS's workspace, inside the cap
torch.cuda.synchronize(); torch.cuda.empty_cache()
cap = torch.cuda.memory_reserved() + 3 * 2**30
torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
low, high = 1, 1 << 19
while high - low > max(1, low // 500):
    middle = (low + high) // 2
    low, high = (middle, high) if fits(middle) else (low, middle)
small, large = int(0.75 * low), int(0.95 * low)
work(small)
try:
    work(large)
    refused = False
except torch.OutOfMemoryError:
    refused = True
torch.cuda.empty_cache()

class Growing(LearningPolicy, Halving):
    target = small
    def start(self, call): return self.target
    def begin(self, call): return None
    def succeeded(self, call): return None
    def after_oom(self, call): return self.shrink(call.size)
    def explain(self, call): return ""

policy = Growing()
sizes = []
run = toma.batch(initial_batchsize=1 << 19, policy=policy)(lambda size: sizes.append(size) or work(size))
for policy.target in (small, large):
    run()  # from one call site: one cache entry, which knows that `small` fit
print(json.dumps(dict(M=low, small=small, large=large, refused_warm=refused, sizes=sizes,
                      retries=[m for m in messages if "ran out of memory" in m])))
"""
)


@pytest.mark.cuda
@requires_cuda
def test_on_cuda_a_size_above_the_largest_that_fit_is_not_refused_for_the_cached_blocks_of_smaller_ones():
    """What an H200 showed: after calls at 0.75 of the largest size that fits from an empty cache (M), the
    allocator's cached blocks are split for a call at 0.95 M and it runs out of memory; toma returns them first."""
    result = json.loads(run_python(GROWING_ON_A_WARM_CACHE, timeout=240).stdout.strip().splitlines()[-1])
    assert result["refused_warm"], f"the allocator itself did not refuse 0.95 M after 0.75 M here: {result}"
    assert result["sizes"] == [result["small"], result["large"]] and result["retries"] == [], result


def test_ranks_that_agree_on_a_way_needing_other_memory_size_anew_from_where_the_call_started():
    """An agreed retry with `restart` (FSDP2's parameters sharded after its held modes failed at every size): the
    entry grows back to the retry's size and forgets what the old way taught; a plain agreed retry only shrinks."""
    from toma.core.agreement import AgreedRetry

    class Restarting(Step):
        def __init__(self):
            self.func, self.sizes = (lambda: None), []

        def __call__(self, size):
            self.sizes.append(size)
            if len(self.sizes) == 1:
                raise AgreedRetry(1, "out of memory at the smallest size, held")
            if len(self.sizes) == 2:
                raise AgreedRetry(64, "another way from here on", lighter=True, restart=True)
            return True

    entry = Batchsize(64)
    entry.record_failure(2)
    entry.record_fit(1)
    step = Restarting()
    engine._attempts(engine.CallState(step, entry, Halving(), 64), None, engine.Observers(()))
    assert step.sizes == [64, 1, 64]
    assert entry.value == 64 and entry.failed is None and entry.fitted == 64
