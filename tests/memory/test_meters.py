"""Memory meters: they measure the device the work runs on, never reset the statistics the user (or an enclosing
measurement) reads, and say "not measured" rather than guess. CUDA is faked on the CPU (`fake_cuda`); the
`cuda` tests show the same on a GPU."""

import mmap
import os

import pytest
import torch

from toma.memory.backends import default_meter
from toma.memory.meters import CpuMeter, CudaMeter, Mark, MemoryMeter

from fake_cuda_memory import FakeCuda, GiB, MiB
from helpers import requires_cuda, run_python


@pytest.fixture
def fake(monkeypatch):
    return FakeCuda(monkeypatch, capacities=(8 * GiB, 4 * GiB), current=0)


def test_the_cuda_meter_never_resets_the_peak_and_measures_an_attempt_that_raises_it(fake):
    gpu = fake.devices[1]
    fake.allocate(1, 100 * MiB)  # the model
    fake.allocate(1, 900 * MiB)  # the user's own work: a peak of 1000 MiB
    fake.free(1, 900 * MiB)
    meter = CudaMeter("cuda:1")
    mark = meter.begin()
    fake.allocate(1, 1200 * MiB)  # an attempt above the user's peak
    fake.free(1, 1200 * MiB)
    assert meter.used(mark) == 1200 * MiB
    assert fake.resets == [], "the meter never resets the peak"
    assert gpu.peak == 1300 * MiB, "the user's max_memory_allocated() is the true peak"
    assert fake.indices_asked() == {1}, "only the meter's device is read"


def test_an_attempt_below_an_earlier_peak_is_not_measured_while_the_cache_hides_it(fake):
    fake.allocate(1, 900 * MiB)
    fake.free(1, 900 * MiB)  # a peak of 900 MiB, and 900 MiB cached
    meter = CudaMeter("cuda:1")
    mark = meter.begin()
    fake.allocate(1, 300 * MiB)
    fake.free(1, 300 * MiB)
    assert meter.used(mark) is None, "below the earlier peak, with the cache full: the meter cannot tell"
    assert fake.resets == []


def test_with_the_cache_emptied_an_attempt_below_an_earlier_peak_is_measured_by_what_it_reserved(fake):
    fake.allocate(1, 900 * MiB)
    fake.free(1, 900 * MiB)
    torch.cuda.empty_cache()  # what the engine does after an out-of-memory error
    meter = CudaMeter("cuda:1")
    mark = meter.begin()
    fake.allocate(1, 200 * MiB)
    fake.allocate(1, 100 * MiB)
    fake.free(1, 300 * MiB)
    assert meter.used(mark) == 300 * MiB
    # A release during the attempt (a cudaMalloc retry freed the cache) makes the reserved bytes no bound.
    mark = meter.begin()
    fake.allocate(1, 250 * MiB)
    fake.free(1, 250 * MiB)
    torch.cuda.empty_cache()
    fake.allocate(1, 50 * MiB)
    fake.free(1, 50 * MiB)
    assert meter.used(mark) is None


def test_a_nested_measurement_leaves_the_outer_one_whole(fake):
    meter = CudaMeter("cuda:1")
    outer = meter.begin()
    fake.allocate(1, 500 * MiB)  # the outer attempt's peak, before the nested call
    fake.free(1, 500 * MiB)
    inner = meter.begin()  # a toma call inside the outer attempt
    fake.allocate(1, 100 * MiB)
    fake.free(1, 100 * MiB)
    assert meter.used(inner) is None  # below the outer's peak and 500 MiB cached: not measured
    assert meter.used(outer) == 500 * MiB
    assert fake.resets == []


def test_after_an_oom_the_lower_bound_is_the_new_peak_or_what_the_attempt_still_holds(fake):
    meter = CudaMeter("cuda:1")
    fake.allocate(1, 2 * GiB)
    fake.free(1, 2 * GiB)  # an earlier peak the failed attempt stays below
    mark = meter.begin()
    fake.allocate(1, 300 * MiB)  # still referenced by the failed attempt's traceback
    with pytest.raises(torch.OutOfMemoryError) as caught:
        fake.allocate(1, 5 * GiB)
    assert meter.at_least(mark) == 300 * MiB
    assert meter.failed_bytes(caught.value) == 5 * GiB
    fake.free(1, 300 * MiB)
    mark = meter.begin()
    fake.allocate(1, 3 * GiB)  # above the earlier peak: the attempt's own
    fake.free(1, 2 * GiB)
    assert meter.at_least(mark) == 3 * GiB


def test_the_default_meter_is_the_one_of_the_device_the_work_runs_on(fake):
    meter = default_meter(torch.device("cuda", 1))  # a model on cuda:1, the current device 0
    assert isinstance(meter, CudaMeter) and meter.device == torch.device("cuda", 1)
    fake.asked.clear()
    mark = meter.begin()
    meter.used(mark)
    assert fake.indices_asked() == {1}
    cpu = default_meter(torch.device("cpu"))  # CPU work in a process that uses CUDA
    assert isinstance(cpu, CpuMeter)
    assert default_meter(torch.device("meta")).begin() is None  # a device no meter reads: nothing measured
    assert default_meter(None).device == torch.device("cuda", 0)  # not known: the current device, as before


def test_without_cuda_initialised_the_default_meter_is_the_cpu_one_and_cuda_stays_untouched():
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is in use in this process")
    assert isinstance(default_meter(None), CpuMeter)
    assert isinstance(default_meter(torch.device("cpu")), CpuMeter)
    assert not torch.cuda.is_initialized()


def _touch(size):
    """Map `size` bytes and write every page, so that the resident size really grows; returns the map."""
    buffer = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        buffer[offset] = 1
    return buffer


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's procfs")
def test_a_nested_cpu_measurement_leaves_the_outer_one_whole():
    meter = CpuMeter()
    outer = meter.begin()
    if outer is None:
        pytest.skip("this kernel does not let the process reset its peak resident size")
    _touch(64 * MiB).close()  # the outer attempt's peak, gone (unmapped) before the nested call
    inner = meter.begin()  # a toma call inside the outer attempt resets the peak for itself
    # 24 MiB, not less: Linux 6.2+ reads the resident size from per-CPU counters, off by up to a few MiB on a
    # machine of many cores (8 MiB read as 6.6 on 16 cores).
    _touch(24 * MiB).close()
    assert 24 * MiB * 0.9 <= meter.used(inner) < 48 * MiB
    assert meter.used(outer) >= 64 * MiB * 0.9, "the peak before the nested call still counts"


def test_fit_to_memory_takes_a_memory_meter_and_refuses_anything_else():
    from toma import FitToMemory

    class Duck:
        def begin(self):
            return None

    with pytest.raises(TypeError, match="meter must be a toma.memory.meters.MemoryMeter"):
        FitToMemory(meter=Duck())


@pytest.mark.cuda
@requires_cuda
def test_a_sized_call_leaves_the_users_peak_statistics_alone():
    out = run_python(
        """
import torch
from toma import FitToMemory, NoBatchsizeCache, toma

torch.cuda.init()
big = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")  # the user's peak: 512 MiB above the start
del big
user_peak = torch.cuda.max_memory_allocated()
x = torch.randn(4096, 256, device="cuda")

@toma.batch(initial_batchsize=4096, policy=FitToMemory(), cache_type=NoBatchsizeCache)
def work(batchsize):
    return torch.cat([(x[s:s + batchsize] @ x.T).sum(1) for s in range(0, 4096, batchsize)])

work()
assert torch.cuda.max_memory_allocated() >= user_peak, (torch.cuda.max_memory_allocated(), user_peak)
print("ok")
"""
    )
    assert "ok" in out.stdout


class _Fixed(MemoryMeter):
    """A meter whose readings after a failed attempt are given."""

    def __init__(self, peak, held):
        self.peak, self.now = peak, held

    def at_least(self, mark):
        return self.peak

    def held(self, mark):
        return self.now


def test_an_errors_bound_is_what_the_attempt_held_plus_the_failed_allocation_not_its_peak_plus_it():
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")
    mark = Mark(0, 256 * MiB)
    assert _Fixed(peak=150 * MiB, held=130 * MiB).bound(mark, error) == 194 * MiB, "the peak passed before it"
    assert _Fixed(peak=200 * MiB, held=130 * MiB).bound(mark, error) == 200 * MiB, "the peak is a bound too"
    assert _Fixed(peak=200 * MiB, held=None).bound(mark, error) == 200 * MiB, "unknown: the peak alone"
    assert _Fixed(peak=10 * MiB, held=None).bound(mark, error) == 64 * MiB, "at least the allocation"
    assert _Fixed(peak=200 * MiB, held=190 * MiB).bound(mark, RuntimeError("CUDA error: out of memory")) == 200 * MiB


def test_the_cpu_meter_sees_what_a_failed_attempt_still_maps():
    meter = CpuMeter()
    mark = meter.begin()
    if mark is None:
        pytest.skip("no /proc/self/status (not Linux)")
    # 32 MiB newly mapped, as a failed attempt's traceback keeps its tensors (an anonymous mapping: a tensor
    # could reuse address space an earlier test freed but the C library kept)
    held = mmap.mmap(-1, 32 * MiB)
    assert meter.held(mark) >= 32 * MiB
    held.close()


def test_the_cuda_meter_holds_what_is_allocated_now(fake):
    meter = CudaMeter("cuda:1")
    fake.allocate(1, 2 * GiB)
    fake.free(1, 2 * GiB)
    mark = meter.begin()
    fake.allocate(1, 300 * MiB)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        fake.allocate(1, 5 * GiB)
    assert meter.held(mark) == 300 * MiB
    assert meter.bound(mark, caught.value) == 300 * MiB + 5 * GiB
