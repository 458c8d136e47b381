"""The host's device backend: Python's and PyTorch's CPU allocator, the global generator, the address-space
limit."""

from typing import Optional

import torch

from toma.memory.cpu import address_space_limit, get_available_cpu_memory, is_out_of_cpu_memory
from toma.memory.device_backend import DeviceBackend
from toma.memory.meters import CpuMeter, MemoryMeter

__all__ = ["CpuBackend"]


class CpuBackend(DeviceBackend):
    """The host: Python's and PyTorch's CPU allocator, the global generator, the address-space limit."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self._cpu_meter = CpuMeter()

    def available(self) -> bool:
        return True

    def device_count(self) -> Optional[int]:
        return 1

    def in_use(self) -> bool:
        return True

    def resolve(self, device: torch.device) -> torch.device:
        return device

    def is_out_of_memory(self, exception: BaseException) -> bool:
        return is_out_of_cpu_memory(exception)

    def rng_state(self, device: torch.device) -> Optional[torch.Tensor]:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        torch.set_rng_state(state)

    def free_memory(self, device: Optional[torch.device] = None) -> int:
        return get_available_cpu_memory()

    def meter(self, device: torch.device) -> MemoryMeter:
        return self._cpu_meter  # one process, one resident size: every CPU device shares it

    def identity(self, device: torch.device) -> str:
        limit = address_space_limit()  # in 64 MiB steps: a cap set from the settled address space moves a little
        return f"cpu:limit={'none' if limit is None else f'{limit >> 26} x 64MiB'}"
