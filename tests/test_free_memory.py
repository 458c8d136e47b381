"""The throttled free-memory gauge."""

from toma import free_memory
from toma.free_memory import FreeMemoryGauge


def test_readings_are_throttled(monkeypatch):
    reads = []
    monkeypatch.setattr(free_memory, "get_available_cpu_memory", lambda: reads.append(1) or 1000 + len(reads))
    monkeypatch.setattr(free_memory, "get_cuda_free_memory_if_initialized", lambda: None)
    now = [100.0]
    monkeypatch.setattr(free_memory.time, "monotonic", lambda: now[0])
    gauge = FreeMemoryGauge(interval=0.5)
    assert [gauge.read() for _ in range(1000)] == [(1001, None)] * 1000
    assert len(reads) == 1
    now[0] += 0.6
    assert gauge.read() == (1002, None)
    gauge.invalidate()
    assert gauge.read() == (1003, None) and len(reads) == 3


def test_real_reading_is_plausible():
    cpu, gpu = FreeMemoryGauge().read()
    assert cpu > 0
    assert gpu is None or gpu >= 0
