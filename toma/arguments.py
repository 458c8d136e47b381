"""Early, clear errors for bad arguments, each naming the argument at fault."""

import operator
from typing import Any, Optional

import torch

from toma.policy import DEFAULT_POLICY, SizePolicy

__all__ = ["check_size", "check_index", "check_tensor_dimension", "check_dimension", "check_policy"]


def check_size(value: Any, name: str) -> int:
    """A batch or step size: a positive int (bools, floats and strings are refused)."""
    if value is None:
        raise TypeError(f"{name} is required: pass a positive int")
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a positive int, got the bool {value!r}")
    try:
        size = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}") from None
    if size < 1:
        raise ValueError(f"{name} must be a positive int, got {size!r}")
    return size


def check_index(value: Any, name: str) -> int:
    """A range bound: any int-like value."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def check_dimension(value: Any, name: str) -> int:
    """A dimension before the tensor is known: an int, 0 when None."""
    return 0 if value is None else check_index(value, name)


def check_tensor_dimension(tensor: Any, dimension: int, tensor_name: str, dimension_name: str) -> int:
    """The tensor to chunk and the (possibly negative) dimension to chunk it along; returns it non-negative."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{tensor_name} must be a torch.Tensor to chunk, got {type(tensor).__name__}")
    ndim = tensor.dim()
    if ndim == 0:
        raise ValueError(f"{tensor_name} is a 0-dimensional tensor; there is nothing to chunk")
    if not -ndim <= dimension < ndim:
        raise ValueError(
            f"{dimension_name}={dimension} is out of range for a tensor with {ndim} dimensions "
            f"(expected {-ndim} to {ndim - 1})"
        )
    return dimension % ndim


def check_policy(policy: Optional[SizePolicy], name: str) -> SizePolicy:
    """A sizing policy (DEFAULT_POLICY, halving, when None)."""
    if policy is None:
        return DEFAULT_POLICY
    if not callable(getattr(policy, "shrink", None)):
        raise TypeError(f"{name} must be a sizing policy such as toma.policy.ShrinkByFactor(0.8), got {policy!r}")
    return policy
