"""Caches that remember which batch size worked, so a call does not fail over again every time.

A cache hands out `Batchsize` entries: thread-safe cells that only ever shrink and never go below 1.
Which entry a call gets decides what is shared: none (`NoBatchsizeCache`), one per function
(`GlobalBatchsizeCache`), or one per call site and free-memory level (`StacktraceMemoryBatchsizeCache`,
where a level the call site has not met starts from what its other levels learned).
"""

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, Optional, Tuple, Type

from toma.core import call_sites
from toma.core.halving import halved
from toma.memory.free import GAUGE, FreeMemoryGauge

__all__ = [
    "LearnedState",
    "Batchsize",
    "BatchsizeCache",
    "NoBatchsizeCache",
    "GlobalBatchsizeCache",
    "StacktraceMemoryBatchsizeCache",
    "get_default_cache_type",
    "set_default_cache_type",
    "get_cache_for_context",
    "CONTEXT_CACHE_SIZE",
    "BoundedDict",
]


class LearnedState:
    """What a learning policy keeps on a cache entry (`Batchsize.learned`): the caches fork it for a new
    free-memory level of the call site, and the size file keeps its description across runs."""

    def fork(self) -> "LearnedState":
        """A copy for a free-memory level the call site has not met."""
        raise NotImplementedError

    def describe(self) -> Optional[str]:
        """The text the size file keeps, which the policy's `restore` reads back (None: nothing to keep)."""
        return None

    def model(self) -> Any:
        """The memory model learned so far, for reports (None: none)."""
        return None


class _Unlocked:
    """Copied and pickled without its lock (a lock cannot be: a callback pickled for `ddp_spawn`, a deep-copied
    trainer), and given a new one: the copy keeps what was learned."""

    _lock: threading.Lock

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


@dataclass
class Batchsize(_Unlocked):
    """A remembered batch (or step) size. Shrinks only, never below 1, safe to share between threads."""

    value: Optional[int] = None
    # What calls saw at this entry: the largest size that ran through, the smallest that ran out of memory.
    fitted: Optional[int] = field(default=None, init=False, compare=False)
    failed: Optional[int] = field(default=None, init=False, compare=False)
    learned: Optional[LearnedState] = field(default=None, init=False, repr=False, compare=False)
    # The memory levers (`toma.levers`) the size needs, on from a call's start: what the value was learned with
    levers: Tuple[str, ...] = field(default=(), init=False, compare=False)
    # Where the size is remembered across runs (toma.core.size_file): None until first used; "" for never.
    store_key: Optional[str] = field(default=None, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def set_initial_batchsize(self, initial_batchsize: int) -> None:
        """Set the value unless one is already remembered."""
        with self._lock:
            if not self.value:
                self.value = initial_batchsize

    def get(self) -> Optional[int]:
        return self.value

    def start(self, initial_batchsize: int) -> int:
        """The size a call asking for `initial_batchsize` begins with: the remembered one, capped by the ask."""
        value = self.value
        if not value:
            self.set_initial_batchsize(initial_batchsize)
            value = self.value or initial_batchsize
        return value if value < initial_batchsize else initial_batchsize

    def shrink_to(self, size: int) -> None:
        """Remember `size` if it is smaller than the current value (another thread may have gone lower)."""
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size!r}")
        with self._lock:
            if self.value is None or size < self.value:
                self.value = size

    def set(self, size: int) -> None:
        """Remember `size`, larger or smaller: for policies that grow a size after measuring room for it."""
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size!r}")
        with self._lock:
            self.value = size

    def record_fit(self, size: int) -> None:
        """A call ran `size` through (unlocked: a lost race only loses a little knowledge)."""
        fitted = self.fitted
        if fitted is None or size > fitted:
            self.fitted = size

    def record_failure(self, size: int) -> None:
        """A call ran out of memory at `size`."""
        failed = self.failed
        if failed is None or size < failed:
            self.failed = size

    def decrease_batchsize(self) -> None:
        """Halve the value, as toma 1.1.0 did; stays at 1 once there."""
        value = self.value
        if value is None:
            raise ValueError("decrease_batchsize: no batch size has been set yet")
        self.shrink_to(halved(value) or 1)


class BatchsizeCache:
    """Base class: `get_batchsize(initial_batchsize)` returns the `Batchsize` entry a call should use."""

    all_instances: "weakref.WeakValueDictionary[Hashable, BatchsizeCache]" = weakref.WeakValueDictionary()

    def __init__(self) -> None:
        BatchsizeCache.all_instances[call_sites.call_site_key()] = self

    def get_batchsize(self, initial_batchsize: int) -> Batchsize:
        raise NotImplementedError


class NoBatchsizeCache(BatchsizeCache):
    """Remembers nothing: every call starts at its initial size."""

    def get_batchsize(self, initial_batchsize: int) -> Batchsize:
        entry = Batchsize(initial_batchsize)
        entry.store_key = ""  # remembers nothing, across runs neither
        return entry


class GlobalBatchsizeCache(_Unlocked, BatchsizeCache):
    """One size per function (or context), wherever it is called from."""

    def __init__(self) -> None:
        super().__init__()
        self.batchsize: Optional[Batchsize] = None
        self._lock = threading.Lock()

    def get_batchsize(self, initial_batchsize: int) -> Batchsize:
        batchsize = self.batchsize
        if batchsize is None:
            with self._lock:
                if self.batchsize is None:
                    self.batchsize = Batchsize(initial_batchsize)
                batchsize = self.batchsize
        return batchsize


class BoundedDict(_Unlocked):
    """A dict that forgets its oldest entries beyond `max_size`; lookups lock-free, inserts locked."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self.entries: Dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def get_or_create(self, key: Hashable, create: Any) -> Any:
        """The value for `key`, made by `create()` on first use. `create` runs outside the lock, so it may
        itself use this dict (a cache class built on another cache); if two threads race, one value wins."""
        value = self.entries.get(key)
        if value is not None:
            return value
        created = create()
        with self._lock:
            value = self.entries.get(key)
            if value is None:
                value = self.entries[key] = created
                while len(self.entries) > self.max_size:
                    del self.entries[next(iter(self.entries))]
        return value


class StacktraceMemoryBatchsizeCache(BatchsizeCache):
    """One size per call site (the innermost `STACK_DEPTH` frames) and free CPU/GPU memory level.

    Free memory is counted in `MEMORY_GRANULARITY` buckets (256 MiB) and read through a throttled gauge,
    so a cached call costs a few microseconds. The assumption, as in toma 1.1.0, is that memory use
    settles after a few iterations, after which each call site finds its size in the cache.
    """

    LRU_CACHE_SIZE: int = 2**16
    MEMORY_GRANULARITY: int = 2**28
    TRACK_RAM: bool = True
    STACK_DEPTH: int = 16
    gauge: FreeMemoryGauge = GAUGE

    LEVELS_PER_SITE: int = 64

    def __init__(self, lru_cache_size: Optional[int] = None) -> None:
        super().__init__()
        self._entries = BoundedDict(lru_cache_size or self.LRU_CACHE_SIZE)
        # call site -> {memory level: entry}: what a new level of a known call site starts from
        self._levels = BoundedDict(lru_cache_size or self.LRU_CACHE_SIZE)
        self._last: Tuple[Any, Tuple[int, int], Any] = (None, (-1, -1), None)  # the last (site, level, entry)

    def memory_key(self) -> Tuple[int, int]:
        cpu, gpu = self.gauge.read()
        granularity = self.MEMORY_GRANULARITY
        return (cpu // granularity if self.TRACK_RAM else -1, -1 if gpu is None else gpu // granularity)

    def get_batchsize(self, initial_batchsize: int) -> Batchsize:
        site, level = call_sites.call_site_key(self.STACK_DEPTH), self.memory_key()
        last = self._last  # a loop asks again with the very same key (a frame keeps it): no hashing of its ints
        if last[0] is site and last[1] == level:
            return last[2]
        entry: Optional[Batchsize] = self._entries.entries.get((site, level))
        if entry is None:
            entry = self._entries.get_or_create((site, level), lambda: self._new_level(site, level))
        self._last = (site, level, entry)
        return entry  # type: ignore[return-value]

    def _new_level(self, site: Hashable, level: Tuple[int, int]) -> Batchsize:
        """An entry for a free-memory level the call site has not met, seeded from the levels it has."""
        levels: Dict[Tuple[int, int], Batchsize] = self._levels.get_or_create(site, dict)
        levers = _levers_for(levels, level)
        if levers:
            levels_alike = {other: e for other, e in levels.items() if e.levers == levers}
        else:
            levels_alike = {other: e for other, e in levels.items() if not e.levers}
        entry = Batchsize(_seed(levels_alike, level))
        entry.levers = levers
        # A learning policy's state goes with it: its model predicts the size for this level's memory (and levers).
        learned = [e.learned for _, e in sorted(levels_alike.items(), key=lambda item: _distance(item[0], level))]
        state = next((state for state in learned if state is not None), None)
        if state is not None:
            entry.learned = state.fork()
        levels[level] = entry
        while len(levels) > self.LEVELS_PER_SITE:
            levels.pop(next(iter(levels)), None)
        return entry


def _levers_for(levels: Dict[Tuple[int, int], Batchsize], level: Tuple[int, int]) -> Tuple[str, ...]:
    """The memory levers a new level starts with: the nearest known level's where this one has no more memory
    free; none where it has more (memory freed: the cheaper state first, the levers turn on again if needed)."""
    if not levels:
        return ()
    nearest, entry = min(levels.items(), key=lambda item: _distance(item[0], level))
    return entry.levers if _at_most(level, nearest) else ()


def _at_most(a: Tuple[int, int], b: Tuple[int, int]) -> bool:
    """Level `a` has no more free memory than level `b`, of every kind."""
    return a[0] <= b[0] and a[1] <= b[1]


def _distance(a: Tuple[int, int], b: Tuple[int, int]) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def _seed(levels: Dict[Tuple[int, int], Batchsize], level: Tuple[int, int]) -> Optional[int]:
    """The size a new level starts from: the nearest known level's, no smaller than a size that ran through
    with less memory free (it fits now), and below any size that ran out of memory with more free (it fails
    now). None (the caller's initial size) when the call site has no other level yet."""
    known = [(other, entry) for other, entry in list(levels.items()) if entry.value]
    if not known:
        return None
    _, nearest = min(known, key=lambda item: _distance(item[0], level))
    size: int = nearest.value  # type: ignore[assignment]
    failures = [e.failed for other, e in known if e.failed is not None and _at_most(level, other)]
    if failures:
        size = min(size, max(1, min(failures) - 1))
    fits = [e.fitted for other, e in known if e.fitted is not None and _at_most(other, level)]
    if fits:
        size = max(size, max(fits))
    return size


_default_cache_type: Type[BatchsizeCache] = StacktraceMemoryBatchsizeCache


def get_default_cache_type() -> Type[BatchsizeCache]:
    """The cache type used where none is given (what `toma.DEFAULT_CACHE_TYPE` reads)."""
    return _default_cache_type


def check_cache_type(cache_type: Any, name: str = "cache_type") -> Type[BatchsizeCache]:
    """Raise early unless `cache_type` is a cache class (something whose instances have `get_batchsize`)."""
    if not (isinstance(cache_type, type) and callable(getattr(cache_type, "get_batchsize", None))):
        raise TypeError(f"{name} must be a cache class such as toma.GlobalBatchsizeCache, got {cache_type!r}")
    return cache_type


def set_default_cache_type(cache_type: Type[BatchsizeCache]) -> None:
    """Change the cache type used where none is given (what assigning `toma.DEFAULT_CACHE_TYPE` does)."""
    global _default_cache_type
    _default_cache_type = check_cache_type(cache_type, "DEFAULT_CACHE_TYPE")


CONTEXT_CACHE_SIZE = 2**14
_caches_by_context = BoundedDict(CONTEXT_CACHE_SIZE)


def get_cache_for_context(batchsize_cache_type: Type[BatchsizeCache], context: Hashable) -> BatchsizeCache:
    """The one cache instance of `batchsize_cache_type` for `context`, created on first use."""
    return _caches_by_context.get_or_create((batchsize_cache_type, context), batchsize_cache_type)
