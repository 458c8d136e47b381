import pytest

from toma import batchsize_cache, oom, policy
from toma.core.caches import StacktraceMemoryBatchsizeCache

from helpers import FixedGauge


@pytest.fixture(autouse=True)
def fresh_toma_state(monkeypatch):
    """Each test starts with empty caches, the stock default cache type and policy, and a fixed free-memory
    reading."""
    batchsize_cache._caches_by_context.entries.clear()
    monkeypatch.setattr(batchsize_cache, "_default_cache_type", StacktraceMemoryBatchsizeCache)
    monkeypatch.setattr(oom, "_extra_predicates", ())
    monkeypatch.setattr(policy, "_default_policy", policy.DEFAULT_POLICY)
    gauge = FixedGauge()
    monkeypatch.setattr(StacktraceMemoryBatchsizeCache, "gauge", gauge)
    yield gauge
