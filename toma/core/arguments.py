"""Early, clear errors for bad arguments, each naming the argument at fault."""

import functools
import inspect
import operator
from typing import Any, Hashable, Optional

import torch

__all__ = [
    "check_context",
    "check_size",
    "check_index",
    "check_tensor_dimension",
    "check_dimension",
    "check_function",
    "innermost_function",
]


def _is_bool(value: Any) -> bool:
    """True for bools, including a boolean tensor (which `operator.index` would turn into 0 or 1)."""
    return isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool)


def check_context(context: Any, name: str) -> Optional[Hashable]:
    """A `context=` the user gave, or a TypeError naming it where it cannot key a cache (a list, a dict)."""
    try:
        hash(context)
    except TypeError:
        raise TypeError(f"{name} must be hashable (it keys the size cache), got {context!r}") from None
    return context  # type: ignore[no-any-return]


def check_size(value: Any, name: str) -> int:
    """A batch or step size: a positive int or int-like value such as `numpy.int64(4)` (bools, floats and
    strings are refused)."""
    if value is None:
        raise TypeError(f"{name} is required: pass a positive int")
    if _is_bool(value):
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
    if _is_bool(value):
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


# Code flags of functions whose body does not run when they are called: it runs later, outside any retry.
_DEFERRED = (
    (inspect.CO_COROUTINE | inspect.CO_ITERABLE_COROUTINE, "async function", "a coroutine"),
    (inspect.CO_ASYNC_GENERATOR, "async generator function", "an async generator"),
    (inspect.CO_GENERATOR, "generator function", "a generator"),
)


def innermost_function(func: Any) -> Any:
    """The function inside staticmethods, bound methods and partials, however deeply nested."""
    target = func
    while True:
        inner = getattr(target, "__func__", None)
        if inner is None and isinstance(target, functools.partial):
            inner = target.func
        if inner is None:
            return target
        target = inner


def _code_of(func: Any) -> Any:
    target = innermost_function(func)
    code = getattr(target, "__code__", None)
    if code is None:  # a callable object: its class's __call__
        code = getattr(getattr(type(target), "__call__", None), "__code__", None)
    return code


def check_function(func: Any, form: str, size_name: Optional[str] = None) -> None:
    """The function a form runs: callable, and one whose body runs when it is called (not an async or
    generator function, whose out-of-memory errors would happen later, outside the retry)."""
    if not callable(func) and not isinstance(func, staticmethod):
        hint = f" Did you mean @{form}({size_name}={func!r})?" if size_name else ""
        raise TypeError(f"{form} runs a function; got {func!r}.{hint}")
    code = _code_of(func)
    if code is None:
        return
    for flags, kind, made in _DEFERRED:
        if code.co_flags & flags:
            name = getattr(func, "__qualname__", None) or code.co_name
            raise TypeError(
                f"{form} cannot retry the {kind} {name!r}: calling it only creates {made}, and its body (with "
                f"any out-of-memory error) runs later, outside toma. Wrap a plain function that runs it to the "
                f"end instead"
                + (" (asyncio.run(...) for a coroutine)" if "coroutine" in made else " (list(...) for a generator)")
            )
