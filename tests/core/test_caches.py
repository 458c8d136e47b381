"""Cache entries and caches: semantics, keys, bounds and thread safety."""

import random
import sys
import threading

import pytest
import torch

from toma import GlobalBatchsizeCache, NoBatchsizeCache, StacktraceMemoryBatchsizeCache, get_cache_for_context, toma
from toma.core.caches import Batchsize, BatchsizeCache, BoundedDict

from helpers import raise_fake_oom


@pytest.fixture
def busy_switching():
    """Switch threads as often as CPython allows, so races show up."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def run_threads(target, count=8):
    errors = []

    def guarded(index):
        try:
            target(index)
        except BaseException as error:  # noqa: BLE001 - reported to the test below
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    return errors


def test_batchsize_keeps_toma_1_1_semantics():
    entry = Batchsize()
    entry.set_initial_batchsize(64)
    entry.set_initial_batchsize(128)
    assert entry.get() == 64, "the first initial size sticks"
    entry.decrease_batchsize()
    assert entry.get() == 32
    assert Batchsize(4) == Batchsize(4) and Batchsize(4) != Batchsize(8)
    one = Batchsize(1)
    one.decrease_batchsize()
    assert one.get() == 1, "never below 1"


def test_batchsize_only_shrinks():
    entry = Batchsize(16)
    entry.shrink_to(32)
    assert entry.value == 16
    entry.shrink_to(4)
    assert entry.value == 4
    with pytest.raises(ValueError, match="size"):
        entry.shrink_to(0)


def test_start_is_capped_by_the_request():
    entry = Batchsize(16)
    assert entry.start(64) == 16
    assert entry.start(8) == 8
    assert entry.value == 16, "asking for less is not evidence of running out of memory"
    fresh = Batchsize()
    assert fresh.start(32) == 32 and fresh.value == 32


def test_concurrent_shrinks_keep_the_minimum(busy_switching):
    entry = Batchsize(1 << 20)
    asked = [[random.randint(1, 1 << 20) for _ in range(2000)] for _ in range(8)]

    def worker(index):
        for size in asked[index]:
            entry.shrink_to(size)
            assert entry.start(1 << 20) >= 1

    assert run_threads(worker) == []
    assert entry.value == min(min(sizes) for sizes in asked)


def test_threads_sharing_a_global_cache_never_see_a_size_below_one(busy_switching):
    limits = [random.Random(i).randint(1, 64) for i in range(8)]
    seen = []

    @toma.batch(initial_batchsize=1024, cache_type=GlobalBatchsizeCache, context="threads")
    def work(batchsize, limit):
        seen.append(batchsize)
        if batchsize > limit:
            raise_fake_oom()
        return batchsize

    def worker(index):
        for _ in range(50):
            assert 1 <= work(limits[index]) <= limits[index]

    assert run_threads(worker) == []
    assert min(seen) >= 1
    assert get_cache_for_context(GlobalBatchsizeCache, "threads").get_batchsize(1024).value == min(limits)


def test_threads_that_never_fit_all_fail_cleanly(busy_switching):
    @toma.batch(initial_batchsize=64, cache_type=GlobalBatchsizeCache)
    def never_fits(batchsize):
        raise_fake_oom()

    def worker(index):
        for _ in range(5):
            with pytest.raises(torch.OutOfMemoryError, match="smallest batch size \\(1\\)"):
                never_fits()

    assert run_threads(worker) == []


def test_stacktrace_cache_threads_each_get_their_own_call_site(busy_switching):
    seen = {}

    @toma.batch(initial_batchsize=32)
    def work(batchsize, name):
        seen.setdefault(name, []).append(batchsize)
        if batchsize > 4:
            raise_fake_oom()

    def worker(index):
        for _ in range(3):
            work(index)

    assert run_threads(worker) == []
    # Every thread calls from the same line: after the first success the cached 4 is used.
    assert all(sizes[-2:] == [4, 4] for sizes in seen.values())


def test_no_cache_hands_out_fresh_entries():
    cache = NoBatchsizeCache()
    entry = cache.get_batchsize(8)
    entry.shrink_to(2)
    assert cache.get_batchsize(8).value == 8


def test_global_cache_hands_out_one_entry():
    cache = GlobalBatchsizeCache()
    assert cache.get_batchsize(8) is cache.get_batchsize(16)


def lookups(cache, gauge, readings):
    """One lookup per (free CPU, free GPU) reading, all from one call site."""
    entries = []
    for cpu, gpu in readings:
        gauge.cpu, gauge.gpu = cpu, gpu
        entries.append(cache.get_batchsize(8))
    return entries


def test_stacktrace_cache_keys_on_call_site_and_free_memory(fresh_toma_state):
    gauge, cache = fresh_toma_state, StacktraceMemoryBatchsizeCache()
    bucket = StacktraceMemoryBatchsizeCache.MEMORY_GRANULARITY
    readings = [(0, None), (0, None), (bucket, None), (bucket + 1, 3 * bucket), (bucket, 4 * bucket - 1)]
    a, same, more_ram, gpu, same_gpu_bucket = lookups(cache, gauge, readings)
    assert same is a, "same call site, same memory level"
    assert more_ram is not a, "another free-memory level"
    assert gpu is not more_ram
    assert same_gpu_bucket is gpu, "within one 256 MiB bucket"
    (elsewhere,) = lookups(cache, gauge, [(0, None)])
    assert elsewhere is not a, "another call site"


def test_stacktrace_cache_can_ignore_ram(fresh_toma_state, monkeypatch):
    monkeypatch.setattr(StacktraceMemoryBatchsizeCache, "TRACK_RAM", False)
    a, b = lookups(StacktraceMemoryBatchsizeCache(), fresh_toma_state, [(2**33, None), (2**30, None)])
    assert a is b


def test_stacktrace_cache_is_bounded(fresh_toma_state):
    bucket = StacktraceMemoryBatchsizeCache.MEMORY_GRANULARITY
    cache = StacktraceMemoryBatchsizeCache(lru_cache_size=3)
    entries = lookups(cache, fresh_toma_state, [(level * bucket, None) for level in (0, 1, 2, 3, 3, 0)])
    assert len(cache._entries.entries) == 3
    assert entries[4] is entries[3]
    assert entries[5] is not entries[0], "the oldest entry was forgotten"


def test_bounded_dict_forgets_the_oldest():
    bounded = BoundedDict(2)
    for key in "abc":
        bounded.get_or_create(key, lambda key=key: key.upper())
    assert list(bounded.entries) == ["b", "c"]


def test_cache_for_context_is_one_instance_per_type_and_context():
    a = get_cache_for_context(GlobalBatchsizeCache, "ctx")
    assert get_cache_for_context(GlobalBatchsizeCache, "ctx") is a
    assert get_cache_for_context(GlobalBatchsizeCache, "other") is not a
    assert isinstance(get_cache_for_context(NoBatchsizeCache, "ctx"), NoBatchsizeCache)


def test_all_instances_registry():
    cache = GlobalBatchsizeCache()
    assert cache in BatchsizeCache.all_instances.values()


class LayeredCache(BatchsizeCache):
    """A cache class built on another cache: its constructor asks toma for a cache itself."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = get_cache_for_context(GlobalBatchsizeCache, ("layered", id(self)))

    def get_batchsize(self, initial_batchsize: int) -> Batchsize:
        return self.inner.get_batchsize(initial_batchsize)


def test_a_cache_class_built_on_another_cache_does_not_deadlock():
    calls = []

    def work():
        @toma.batch(initial_batchsize=16, cache_type=LayeredCache)
        def f(batchsize):
            calls.append(batchsize)
            if batchsize > 4:
                raise_fake_oom()

        f()
        f()
        explicit_cache = get_cache_for_context(LayeredCache, "ctx")
        assert isinstance(explicit_cache.inner, GlobalBatchsizeCache)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "constructing a cache that uses get_cache_for_context deadlocked"
    assert calls == [16, 8, 4, 4]


def test_racing_creators_all_get_the_one_value(busy_switching):
    bounded = BoundedDict(8)
    got = []
    barrier = threading.Barrier(8)

    def worker(index):
        barrier.wait()
        got.append(bounded.get_or_create("key", lambda: object()))

    assert run_threads(worker) == []
    assert len({id(value) for value in got}) == 1 and len(got) == 8


def drifting_calls(gauge, levels, fits_up_to=4, initial=64):
    """One call per free-RAM reading from one call site; the OOM retries of each."""
    retries = []
    attempts = []

    @toma.batch(initial_batchsize=initial)
    def work(batchsize):
        attempts.append(batchsize)
        if batchsize > fits_up_to:
            raise_fake_oom()
        return batchsize

    for level in levels:
        gauge.cpu = level
        before = len(attempts)
        assert work() == min(initial, fits_up_to) or work.__wrapped__ is None
        retries.append(len(attempts) - before - 1)
    return retries, attempts


def test_free_ram_falling_step_after_step_keeps_the_size_found(fresh_toma_state):
    bucket = StacktraceMemoryBatchsizeCache.MEMORY_GRANULARITY
    retries, attempts = drifting_calls(fresh_toma_state, [(20 - i) * bucket for i in range(6)])
    assert retries == [4, 0, 0, 0, 0, 0], "a new level starts from what the call site learned, not from 64"
    assert attempts[5:] == [4] * 5


def test_a_new_level_never_starts_at_a_size_that_failed_with_more_memory_free(fresh_toma_state):
    bucket = StacktraceMemoryBatchsizeCache.MEMORY_GRANULARITY
    cache = StacktraceMemoryBatchsizeCache()
    cache.STACK_DEPTH = 1  # the call site is the line in lookup(), wherever the test calls it from
    gauge = fresh_toma_state

    def lookup(level):
        gauge.cpu = level * bucket
        return cache.get_batchsize(64)

    rich = lookup(10)
    rich.start(64)
    rich.shrink_to(8)
    rich.record_failure(16)
    rich.record_fit(8)
    poor = lookup(2)  # less free memory: 16 failed with more, so 16 and above fail now
    assert poor.start(64) == 8
    poorer = lookup(1)
    poorer.shrink_to(2)
    poorer.record_fit(2)
    middle = lookup(5)  # nearest is level 2 (8); a fit at level 1 (2) is a floor, 16 failed above
    assert middle.start(64) == 8
    richer = lookup(12)  # more free memory: the nearest (level 10) says 8, a size that ran through with less
    assert richer.start(64) == 8
    assert lookup(30).start(4) == 4, "never above what the call asks for"


def test_a_cache_and_its_entries_pickle_and_copy_with_what_they_learned_and_a_lock_of_their_own():
    import copy
    import pickle

    cache = GlobalBatchsizeCache()
    entry = cache.get_batchsize(16)
    entry.shrink_to(4)
    entry.record_fit(4)
    for twin in (pickle.loads(pickle.dumps(cache)), copy.deepcopy(cache)):
        assert (twin.batchsize.value, twin.batchsize.fitted) == (4, 4)
        assert twin.batchsize._lock is not entry._lock and twin._lock is not cache._lock
        twin.get_batchsize(16).shrink_to(2)
        assert entry.value == 4, "the copy learns on its own"


def test_a_new_level_keeps_the_levers_with_less_memory_free_and_starts_without_them_with_more(fresh_toma_state):
    """Memory levers (`toma.levers`) go with the size they were learned with: a level with no more memory free
    than the nearest one starts with them (and that size); one with more starts without them (the cheaper state
    first) from the sizes learned without them."""
    bucket = StacktraceMemoryBatchsizeCache.MEMORY_GRANULARITY
    cache = StacktraceMemoryBatchsizeCache()
    cache.STACK_DEPTH = 1
    gauge = fresh_toma_state

    def lookup(level):
        gauge.cpu = level * bucket
        return cache.get_batchsize(64)

    plain = lookup(10)
    plain.start(64)
    plain.shrink_to(6)
    tight = lookup(5)
    assert tight.start(64) == 6 and tight.levers == ()
    tight.shrink_to(2)
    tight.levers = ("activation checkpointing",)  # as the engine leaves it once a lever turned on
    tighter = lookup(4)
    assert tighter.levers == ("activation checkpointing",) and tighter.start(64) == 2
    freer = lookup(7)  # more memory free than the nearest level (5): without levers, seeded from level 10's 6
    assert freer.levers == () and freer.start(64) == 6
