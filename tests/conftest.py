import gc

import pytest

from toma import batchsize_cache
from toma.core import oom
from toma.core.caches import StacktraceMemoryBatchsizeCache
from toma.sizing.defaults import DEFAULTS

from helpers import FixedGauge


@pytest.fixture(autouse=True)
def fresh_toma_state(monkeypatch):
    """Each test starts with empty caches, the stock default cache type and policy, and a fixed free-memory
    reading."""
    batchsize_cache._caches_by_context.entries.clear()
    monkeypatch.setattr(batchsize_cache, "_default_cache_type", StacktraceMemoryBatchsizeCache)
    monkeypatch.setattr(oom, "_extra_predicates", ())
    monkeypatch.setattr(DEFAULTS, "assigned", None)
    gauge = FixedGauge()
    monkeypatch.setattr(StacktraceMemoryBatchsizeCache, "gauge", gauge)
    yield gauge


def pytest_collection_finish(session):
    """Freeze what is alive once the tests are collected (torch, toma, the test modules): toma collects garbage
    after every out-of-memory error, and a full collection over torch's hundreds of thousands of objects costs
    a quarter of a second, most of the time of a simulated search. Frozen objects are never freed, and everything
    a test creates afterwards is collected as before."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def frozen_between_modules():
    """Freeze again as each test module starts: what earlier modules left alive (a framework's trainers, caches
    and registries) would otherwise be scanned by every collection of the modules after them."""
    gc.collect()
    gc.freeze()
    yield
