"""accelerate's gathers and reductions made local to this rank while a logical batch runs in micro-batches.

A Trainer's `compute_loss` may gather its metrics across ranks on every call (TRL's trainers call
`accelerator.gather_for_metrics`, `gather` and `reduce` there). Split into micro-batches, the ranks call it a
different number of times (a rank's rows pack into more micro-batches; a rank that runs out of memory stops
half-way), and a collective one rank enters while another does not waits for ever. Inside `local_collectives`
each of these returns what it would for a single process: this rank's own values. The ranks' values are put
together once per logical batch afterwards (`toma.integrations.trainer_records`), where every rank takes part.
"""

import contextlib
from typing import Any, Callable, Dict, Iterator

import torch

from toma.batching.splitting import map_tensors

__all__ = ["local_collectives", "LOCALISED"]


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    """What gathering one rank's tensor gives with one rank: a scalar becomes one element, rows stay rows."""
    return tensor.reshape(1) if tensor.dim() == 0 else tensor


def _gather(tensor: Any) -> Any:
    return map_tensors(tensor, _gathered)


def _holds_only_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (list, tuple)):
        return all(_holds_only_tensors(item) for item in data)
    if isinstance(data, dict):
        return all(_holds_only_tensors(item) for item in data.values())
    return False


def _gather_for_metrics(input_data: Any, use_gather_object: bool = False) -> Any:
    if use_gather_object or not _holds_only_tensors(input_data):
        return input_data  # accelerate's gather_object on one process: the object itself
    return _gather(input_data)


def _reduce(tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    return map_tensors(tensor, lambda value: value * scale if scale != 1.0 else value)


def _pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    return tensor


LOCALISED: Dict[str, Callable[..., Any]] = {
    "gather": _gather,
    "gather_for_metrics": _gather_for_metrics,
    "reduce": _reduce,
    "pad_across_processes": _pad_across_processes,
}
"""The accelerator's methods made local, by name."""


@contextlib.contextmanager
def local_collectives(accelerator: Any) -> Iterator[None]:
    """While inside, `accelerator.gather`, `gather_for_metrics`, `reduce` and `pad_across_processes` act as on a
    single process (this rank's values); afterwards they are the accelerator's own again."""
    before = {name: accelerator.__dict__[name] for name in LOCALISED if name in accelerator.__dict__}
    for name, local in LOCALISED.items():
        setattr(accelerator, name, local)
    try:
        yield
    finally:
        for name in LOCALISED:
            if name in before:
                setattr(accelerator, name, before[name])
            else:
                accelerator.__dict__.pop(name, None)
