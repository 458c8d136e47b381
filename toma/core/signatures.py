"""What the decorators return, as types a checker can use: the wrapped function's remaining parameters and
its return type, plus the `toma_*` call-time overrides.

A ParamSpec cannot gain keyword parameters, so each type's `__call__` is overloaded: the first overload is
the function's own signature, checked argument by argument; the others accept a call that passes one of
the overrides (its arguments are then not checked, its return type still is).
"""

from typing import Any, Callable, Hashable, Optional, ParamSpec, Protocol, TypeVar, overload

import torch

__all__ = ["BatchFunction", "RangeFunction", "ChunkedFunction", "AccumulateFunction"]

P = ParamSpec("P")
R_co = TypeVar("R_co", covariant=True)


class _Wrapper(Protocol):
    """What functools.wraps gives every decorated function: its name and the function itself."""

    __name__: str
    __qualname__: str
    __wrapped__: Callable[..., Any]


class BatchFunction(_Wrapper, Protocol[P, R_co]):
    """`toma.batch` applied to `f(batchsize, *args, **kwargs) -> R`: called as `f(*args, **kwargs) -> R`."""

    @overload
    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    @overload
    def __call__(
        self, *args: Any, toma_initial_batchsize: int, toma_context: Optional[Hashable] = None, **kwargs: Any
    ) -> R_co: ...

    @overload
    def __call__(self, *args: Any, toma_context: Hashable, **kwargs: Any) -> R_co: ...


class RangeFunction(_Wrapper, Protocol[P]):
    """`toma.range` applied to `f(start, end, *args, **kwargs)`: called as `f(start, end, *args, **kwargs)`."""

    @overload
    def __call__(self, start: int, end: int, *args: P.args, **kwargs: P.kwargs) -> None: ...

    @overload
    def __call__(
        self,
        start: int,
        end: int,
        *args: Any,
        toma_initial_step: int,
        toma_context: Optional[Hashable] = None,
        **kwargs: Any,
    ) -> None: ...

    @overload
    def __call__(self, start: int, end: int, *args: Any, toma_context: Hashable, **kwargs: Any) -> None: ...


class ChunkedFunction(_Wrapper, Protocol[P]):
    """`toma.chunked` applied to `f(chunk, start, end, *args, **kwargs)`: called as `f(tensor, *args, **kwargs)`."""

    @overload
    def __call__(self, tensor: torch.Tensor, *args: P.args, **kwargs: P.kwargs) -> None: ...

    @overload
    def __call__(
        self,
        tensor: torch.Tensor,
        *args: Any,
        toma_initial_step: int,
        toma_dimension: Optional[int] = None,
        toma_context: Optional[Hashable] = None,
        **kwargs: Any,
    ) -> None: ...

    @overload
    def __call__(
        self,
        tensor: torch.Tensor,
        *args: Any,
        toma_dimension: int,
        toma_context: Optional[Hashable] = None,
        **kwargs: Any,
    ) -> None: ...

    @overload
    def __call__(self, tensor: torch.Tensor, *args: Any, toma_context: Hashable, **kwargs: Any) -> None: ...


class AccumulateFunction(_Wrapper, Protocol[P]):
    """`toma.accumulate` applied to `loss(*args, **kwargs) -> Tensor`: the same call, over the logical batch,
    returning its loss. `stats` says what the calls went through."""

    stats: Any

    @overload
    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> torch.Tensor: ...

    @overload
    def __call__(
        self, *args: Any, toma_initial_micro_batch: int, toma_context: Optional[Hashable] = None, **kwargs: Any
    ) -> torch.Tensor: ...

    @overload
    def __call__(self, *args: Any, toma_context: Hashable, **kwargs: Any) -> torch.Tensor: ...
