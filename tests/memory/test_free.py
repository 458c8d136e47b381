"""The throttled free-memory gauge."""

from toma.memory import backends
from toma.memory import free as free_memory
from toma.memory.free import FreeMemoryGauge


def test_readings_are_throttled(monkeypatch):
    reads = []
    monkeypatch.setattr(backends.CPU, "free_memory", lambda device=None: reads.append(1) or 1000 + len(reads))
    monkeypatch.setattr(backends.CUDA, "free_memory", lambda device=None: None)
    now = [100.0]
    monkeypatch.setattr(free_memory, "_clock", lambda: now[0])  # toma's own clock, not time.monotonic
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


def test_the_gauge_reads_the_device_it_is_asked_about_and_nothing_else(monkeypatch):
    import torch

    from fake_cuda_memory import FakeCuda, GiB, MiB

    fake = FakeCuda(monkeypatch, capacities=(8 * GiB, 4 * GiB), current=0)
    fake.allocate(1, 512 * MiB)
    gauge = FreeMemoryGauge()
    _, gpu = gauge.read(torch.device("cuda", 1))
    assert gpu == 4 * GiB - 512 * MiB
    assert fake.indices_asked() == {1}, "a model on cuda:1 is never read as GPU 0"
    fake.asked.clear()
    assert gauge.read(torch.device("cpu"))[1] is None and fake.asked == [], "CPU work reads no GPU"


def test_reading_the_current_device_never_creates_its_context(monkeypatch):
    from fake_cuda_memory import FakeCuda

    fake = FakeCuda(monkeypatch, current=0)
    fake.contexts.clear()  # a rank whose work is on cuda:1 and which never touched GPU 0, its current device
    fake.allocate(1, 1)
    assert FreeMemoryGauge().read()[1] is None
    assert 0 not in fake.contexts and ("mem_get_info", 0) not in fake.asked
    fake.contexts.add(0)
    assert FreeMemoryGauge().read()[1] == fake.devices[0].capacity
