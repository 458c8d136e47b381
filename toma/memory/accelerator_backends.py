"""The built-in backends of the devices besides the host: CUDA (and ROCm), XPU, MPS and HPU. None starts its
device: a process that has not used CUDA is never made to initialise it here."""

from typing import Any, Dict, Optional

import torch

from toma.memory.cuda import get_cuda_free_memory_if_initialized, is_cuda_out_of_memory, is_cudnn_snafu
from toma.memory.device_backend import DeviceBackend
from toma.memory.meters import CudaMeter, MemoryMeter

__all__ = ["CudaBackend", "XpuBackend", "MpsBackend", "HpuBackend"]


class CudaBackend(DeviceBackend):
    """NVIDIA (and ROCm) GPUs through PyTorch's caching allocator."""

    pins_host_memory = True

    def __init__(self) -> None:
        super().__init__("cuda")

    def available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> Optional[int]:
        return torch.cuda.device_count()

    def in_use(self) -> bool:
        return torch.cuda.is_initialized()

    def current(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def is_out_of_memory(self, exception: BaseException) -> bool:
        return is_cuda_out_of_memory(exception) or is_cudnn_snafu(exception)

    def empty_cache(self) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def rng_state(self, device: torch.device) -> Optional[torch.Tensor]:
        return torch.cuda.get_rng_state(device)

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        torch.cuda.set_rng_state(state, device)

    def free_memory(self, device: Optional[torch.device]) -> Optional[int]:
        return get_cuda_free_memory_if_initialized(device)

    def reset_peak(self, device: torch.device) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats(device)

    def synchronize(self, device: torch.device) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize(device)

    def timestamp(self, device: torch.device) -> Any:
        """An event recorded on the current stream: marks in the device's own timeline, no waiting."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def seconds_between(self, start: Any, end: Any) -> float:
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000.0

    def peak_allocated(self, device: torch.device) -> Optional[int]:
        if torch.cuda.is_initialized():
            return int(torch.cuda.max_memory_allocated(device))
        return None

    def figures(self, device: torch.device) -> Dict[str, int]:
        if not torch.cuda.is_initialized():
            return {}
        free, total = torch.cuda.mem_get_info(device)
        return dict(
            allocated=torch.cuda.memory_allocated(device),
            reserved=torch.cuda.memory_reserved(device),
            peak=torch.cuda.max_memory_allocated(device),
            free=free,
            total=total,
        )

    def meter(self, device: torch.device) -> MemoryMeter:
        return super().meter(self.resolve(device))

    def _new_meter(self, device: torch.device) -> MemoryMeter:
        return CudaMeter(device.index)

    def identity(self, device: torch.device) -> str:
        properties = torch.cuda.get_device_properties(self.resolve(device).index)
        return f"cuda:{properties.name}:{properties.total_memory}"


class XpuBackend(DeviceBackend):
    """Intel GPUs (`torch.xpu`)."""

    def __init__(self) -> None:
        super().__init__("xpu")

    def available(self) -> bool:
        return torch.xpu.is_available()

    def device_count(self) -> Optional[int]:
        return torch.xpu.device_count()

    def in_use(self) -> bool:
        return torch.xpu.is_available() and torch.xpu.is_initialized()

    def current(self) -> torch.device:
        return torch.device("xpu", torch.xpu.current_device())

    def empty_cache(self) -> None:
        if self.in_use():
            torch.xpu.empty_cache()

    def rng_state(self, device: torch.device) -> Optional[torch.Tensor]:
        return torch.xpu.get_rng_state(device)

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        torch.xpu.set_rng_state(state, device)

    def synchronize(self, device: torch.device) -> None:
        if self.in_use():
            torch.xpu.synchronize(device)


class MpsBackend(DeviceBackend):
    """Apple GPUs (`torch.mps`): one device, no index."""

    def __init__(self) -> None:
        super().__init__("mps")

    def available(self) -> bool:
        return torch.backends.mps.is_available()

    def device_count(self) -> Optional[int]:
        return 1 if self.available() else 0

    def in_use(self) -> bool:
        return self.available()  # torch.mps has no "initialised": asking costs nothing once it is there

    def resolve(self, device: torch.device) -> torch.device:
        return device

    def empty_cache(self) -> None:
        if self.available():
            torch.mps.empty_cache()

    def rng_state(self, device: torch.device) -> Optional[torch.Tensor]:
        return torch.mps.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        torch.mps.set_rng_state(state)

    def synchronize(self, device: torch.device) -> None:
        if self.available():
            torch.mps.synchronize()


class HpuBackend(DeviceBackend):
    """Intel Gaudi (`torch.hpu`, from Habana's plugin): its out-of-memory error, which says neither "out of
    memory" nor raises `torch.OutOfMemoryError`. Its allocator reserves the device's memory for the process, so
    there is no cache to empty."""

    OOM_MARKER = "MODULE:PT_DEVMEM Allocation failed"  # "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed ..."

    def __init__(self) -> None:
        super().__init__("hpu")

    def is_out_of_memory(self, exception: BaseException) -> bool:
        return isinstance(exception, RuntimeError) and self.OOM_MARKER in str(exception)
