"""What the decorators take and return, as types a checker can use: each decorator's options (a TypedDict
per form, shared keys in a base), the wrapped function's remaining parameters and its return type, plus the
`toma_*` call-time overrides.

A decorator is used bare (`@toma.batch`) or given its options first (`@toma.batch(initial_batchsize=512)`);
its two overloads take the options as `**options: Unpack[...Options]`, so each list is written once here.
A ParamSpec cannot gain keyword parameters, so each decorated function's `__call__` is overloaded: the first
overload is the function's own signature, checked argument by argument; the others accept a call that passes
one of the overrides (its arguments are then not checked, its return type still is).
"""

import sys
from typing import (
    Any,
    Callable,
    Concatenate,
    Hashable,
    Optional,
    ParamSpec,
    Protocol,
    Type,
    TypedDict,
    TypeVar,
    overload,
)

import torch

from toma.core.caches import BatchsizeCache
from toma.core.policy import SizePolicy

if sys.version_info >= (3, 11):
    from typing import Required, Unpack
else:  # Python 3.10: from typing_extensions, which torch requires
    from typing_extensions import Required, Unpack

__all__ = [
    "BatchFunction",
    "RangeFunction",
    "ChunkedFunction",
    "AccumulateFunction",
    "BatchOptions",
    "RangeOptions",
    "ChunkedOptions",
    "AccumulateOptions",
    "Batchable",
    "Rangeable",
    "Chunkable",
    "Unpack",
]

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)

# The functions each decorator takes: f(batchsize, ...), f(start, end, ...), f(chunk, start, end, ...).
Batchable = Callable[Concatenate[int, P], R]
Rangeable = Callable[Concatenate[int, int, P], Any]
Chunkable = Callable[Concatenate[torch.Tensor, int, int, P], Any]


class _CachedOptions(TypedDict, total=False):
    """The options of every decorator with a cache: which cache, keyed by what, and the sizing policy."""

    cache_type: Optional[Type[BatchsizeCache]]
    context: Optional[Hashable]
    policy: Optional[SizePolicy]


class _AgreedOptions(_CachedOptions, total=False):
    """The options of a decorator whose ranks may agree on every size (`distributed=`)."""

    distributed: Any


class BatchOptions(_AgreedOptions, total=False):
    """`toma.batch`'s options."""

    initial_batchsize: Optional[int]


class RangeOptions(_AgreedOptions, total=False):
    """`toma.range`'s options."""

    initial_step: Optional[int]


class ChunkedOptions(RangeOptions, total=False):
    """`toma.chunked`'s options: `toma.range`'s and the dimension to chunk along."""

    dimension: Optional[int]


class AccumulateOptions(_CachedOptions, total=False):
    """`toma.accumulate`'s options: the model is required."""

    model: Required[torch.nn.Module]
    initial_micro_batch: Optional[int]
    reduction: str
    weight: Optional[Callable[..., Any]]
    scaler: Any
    lengths: Any
    initial_tokens: Optional[int]
    gradient_sync: str
    groups: Any
    split_for_padding: bool
    levers: bool


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
