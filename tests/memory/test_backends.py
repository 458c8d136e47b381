"""Device backends: one list that every device-dependent place asks, so that a new kind of device is one class."""

import pytest
import torch

from toma.accumulation.rollback import RandomState
from toma.batching.transfer import check_device, uses_cuda
from toma.core.oom import release_memory, should_reduce_batch_size
from toma.core.size_file import device_key
from toma.memory import backends
from toma.memory.backends import CPU, CUDA, DeviceBackend, HpuBackend, backend_for, default_meter, register_backend
from toma.memory.free import FreeMemoryGauge
from toma.memory.meters import CpuMeter, Mark, MemoryMeter


class _FixedMeter(MemoryMeter):
    def begin(self):
        return Mark(0, 1 << 20)

    def used(self, mark):
        return 7


class Gaudi(DeviceBackend):
    """A device kind toma has no code for, described by one class."""

    def __init__(self):
        super().__init__("hpu")
        self.emptied = 0

    def available(self):
        return True

    def device_count(self):
        return 2

    def in_use(self):
        return True

    def current(self):
        return torch.device("hpu", 0)

    def is_out_of_memory(self, exception):
        return "synStatus 26" in str(exception)

    def empty_cache(self):
        self.emptied += 1

    def free_memory(self, device):
        return 123

    def _new_meter(self, device):
        return _FixedMeter()

    def identity(self, device):
        return f"hpu:Gaudi3:{device.index}"


@pytest.fixture
def gaudi(monkeypatch):
    monkeypatch.setattr(backends, "_backends", dict(backends._backends))
    monkeypatch.setattr(backends, "_accelerators", backends._accelerators)
    return register_backend(Gaudi())


def test_a_new_device_kind_is_one_class_that_every_place_asks(gaudi):
    error = RuntimeError("Device allocation failed: synStatus 26")
    device = torch.device("hpu", 1)
    assert should_reduce_batch_size(error), "its out-of-memory error is recognised"
    release_memory()
    assert gaudi.emptied == 1, "its cache is emptied after an OOM"
    assert device_key(device) == "hpu:Gaudi3:1:world=1", "sizes are remembered under its name"
    meter = default_meter(device)
    assert isinstance(meter, _FixedMeter) and meter is default_meter(device), "its meter, kept per device"
    assert FreeMemoryGauge().read(device)[1] == 123, "its free memory"
    assert check_device("hpu:1", "device") == device
    with pytest.raises(ValueError, match="device is 'hpu:2', but this machine has 2 HPU device"):
        check_device("hpu:2", "device")
    assert gaudi in backends.accelerators_in_use()


def test_without_its_backend_the_same_error_is_not_out_of_memory():
    assert not should_reduce_batch_size(RuntimeError("Device allocation failed: synStatus 26"))


def test_intel_gaudis_out_of_memory_text_is_recognised_by_its_backend_without_a_device():
    # what Habana's allocator raises (and accelerate's should_reduce_batch_size lists): no "out of memory" in it
    error = RuntimeError("[Rank:0] FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed for size::1073741824 (1024)MB")
    assert isinstance(backend_for("hpu"), HpuBackend) and backend_for("hpu:0").is_out_of_memory(error)
    assert should_reduce_batch_size(error)
    assert not should_reduce_batch_size(ValueError(str(error))), "a RuntimeError, as the plugin raises it"


def test_a_kind_no_backend_knows_is_measured_by_nothing_and_never_pinned():
    meta = torch.device("meta")
    backend = backend_for(meta)
    assert type(backend) is DeviceBackend and backend.kind == "meta"
    assert backend.rng_state(meta) is None and backend.free_memory(meta) is None and backend.figures(meta) == {}
    assert default_meter(meta).begin() is None
    assert not uses_cuda(meta) and not uses_cuda(torch.device("cpu")) and uses_cuda(torch.device("cuda", 0))
    assert device_key(meta) == "meta:world=1"


def test_the_host_backend_owns_the_cpu_generator_meter_and_key():
    state = CPU.rng_state(torch.device("cpu"))
    first = torch.rand(3)
    CPU.set_rng_state(state, torch.device("cpu"))
    assert torch.equal(torch.rand(3), first)
    assert isinstance(default_meter(torch.device("cpu")), CpuMeter)
    assert device_key(torch.device("cpu")).startswith("cpu:limit=")
    assert CPU.free_memory() > 0
    assert backends.default_device() == torch.device("cpu"), "CUDA never used here: the CPU"
    assert backends.accelerators_in_use() == [] or torch.cuda.is_initialized()


def test_register_backend_names_its_argument():
    with pytest.raises(TypeError, match="backend must be a DeviceBackend"):
        register_backend("hpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend.kind"):
        register_backend(DeviceBackend("cpu"))


def test_random_state_asks_the_backend_of_each_device_the_tensors_are_on(monkeypatch):
    """The CUDA generator is read and put back through CUDA's backend (shown on the CPU with a recording one)."""
    saved = []
    monkeypatch.setattr(CUDA, "rng_state", lambda device: saved.append(("get", device)) or torch.tensor([1]))
    monkeypatch.setattr(CUDA, "set_rng_state", lambda state, device: saved.append(("set", device)))
    fake_cuda_tensor = torch.empty(0, device="meta")
    monkeypatch.setattr("toma.accumulation.rollback._accelerator_devices", lambda tensors: [torch.device("cuda", 1)])
    state = RandomState([fake_cuda_tensor])
    state.restore()
    assert saved == [("get", torch.device("cuda", 1)), ("set", torch.device("cuda", 1))]
