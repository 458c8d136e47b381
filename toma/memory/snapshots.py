"""Memory snapshots: what a process holds in RAM and, where it uses CUDA, on the GPU; a history of them.

Reading CUDA numbers never initialises CUDA: a process that has not used CUDA gets None for them.
"""

import contextlib
import csv
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Union

import torch

from toma.memory.backends import CUDA
from toma.memory.cpu import get_available_cpu_memory

if TYPE_CHECKING:
    import psutil

__all__ = ["MemorySnapshot", "snapshot", "MemoryHistory"]

Device = Union[None, int, str, Any]

_process: Optional["psutil.Process"] = None


@dataclass(frozen=True)
class MemorySnapshot:
    """Bytes in use and available at one moment. CUDA fields are None where CUDA is not in use."""

    time: float
    rss: int
    available_ram: int
    cuda_allocated: Optional[int] = None
    cuda_reserved: Optional[int] = None
    cuda_peak: Optional[int] = None
    cuda_free: Optional[int] = None
    cuda_total: Optional[int] = None
    label: str = ""

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _cuda_device(device: Device) -> Optional[torch.device]:
    """The CUDA device to read, or None when CUDA is not in use (or `device` is not a CUDA device)."""
    if not CUDA.in_use():
        return None
    if device is None:
        return CUDA.current()
    resolved = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return CUDA.resolve(resolved) if resolved.type == "cuda" else None


def snapshot(device: Device = None, label: str = "") -> MemorySnapshot:
    """The memory of this process now: RSS and available RAM always, CUDA numbers where CUDA is in use."""
    global _process
    if _process is None:
        import psutil  # here, not at `import toma`: psutil's import costs more than toma's own modules

        _process = psutil.Process()
    cuda: Dict[str, int] = {}
    cuda_device = _cuda_device(device)
    if cuda_device is not None:
        cuda = {f"cuda_{name}": value for name, value in CUDA.figures(cuda_device).items()}
    return MemorySnapshot(
        time=time.time(),
        rss=_process.memory_info().rss,
        available_ram=get_available_cpu_memory(),
        label=label,
        **cuda,
    )


class MemoryHistory:
    """Memory snapshots in the order they were taken: `record()` one, or `with history.around("step"):`.
    Not to be confused with `TrainingHistory`, the Trainer's record of losses."""

    def __init__(self, device: Device = None, max_length: Optional[int] = None) -> None:
        self.device = device
        self.max_length = max_length
        self.snapshots: List[MemorySnapshot] = []

    def record(self, label: str = "") -> MemorySnapshot:
        taken = snapshot(self.device, label)
        self.snapshots.append(taken)
        if self.max_length is not None and len(self.snapshots) > self.max_length:
            del self.snapshots[: len(self.snapshots) - self.max_length]
        return taken

    @contextlib.contextmanager
    def around(self, label: str) -> Iterator[None]:
        """Record a snapshot before and after the block (`label + " start"`, `label + " end"`)."""
        self.record(f"{label} start")
        try:
            yield
        finally:
            self.record(f"{label} end")

    def peak(self, field: str = "rss") -> Optional[int]:
        """The largest value of `field` over the snapshots (None if none has it)."""
        values = [getattr(s, field) for s in self.snapshots if getattr(s, field) is not None]
        return max(values) if values else None

    def clear(self) -> None:
        self.snapshots.clear()

    def __len__(self) -> int:
        return len(self.snapshots)

    def save(self, path: str) -> None:
        """Write the snapshots as JSON (a list of objects) or, for a `.csv` path, as CSV."""
        rows = [s.as_dict() for s in self.snapshots]
        with open(path, "w", encoding="utf-8", newline="") as file:
            if str(path).endswith(".csv"):
                writer = csv.DictWriter(file, fieldnames=[f.name for f in dataclasses.fields(MemorySnapshot)])
                writer.writeheader()
                writer.writerows(rows)
            else:
                json.dump(rows, file, indent=1)
