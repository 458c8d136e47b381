"""The public forms, thin drivers of the one engine.

- `toma.batch` / `toma.range` / `toma.chunked`: decorators with a per-function cache.
- `toma.execute.*`: run the decorated block at once, cached per call site.
- `explicit.*`: the same as plain calls, with `toma_*` keyword options.
- `simple.*`: plain calls without a cache.
"""

import functools
import types
from typing import Any, Callable, Concatenate, Dict, Hashable, Optional, ParamSpec, Type, TypeVar, cast, overload

import torch

from toma.core import engine
from toma.accumulation.accumulate import (
    AccumulationStats,
    accumulate,
    check_model,
    check_reduction,
    check_scaler,
    check_weight,
)
from toma.core.arguments import (
    check_dimension,
    check_function,
    check_index,
    check_size,
    check_tensor_dimension,
    innermost_function,
)
from toma.core.caches import (
    BatchsizeCache,
    BoundedDict,
    GlobalBatchsizeCache,
    NoBatchsizeCache,
    StacktraceMemoryBatchsizeCache,
    check_cache_type,
    get_cache_for_context,
    get_default_cache_type,
    set_default_cache_type,
)
from toma.core.agreement import AgreedStep, agreement_for
from toma.offload.host_map import MapStep
from toma.offload.hosted_embedding import HostedEmbedding
from toma.sizing.policies import SizePolicy, check_policy, get_default_policy, set_default_policy
from toma.core.signatures import AccumulateFunction, BatchFunction, ChunkedFunction, RangeFunction
from toma.batching.splitting import BatchSplit, whole
from toma.core.call_sites import call_site_key
from toma.batching.transfer import Transfers, check_device

__all__ = ["toma", "explicit", "simple", "PackageModule"]

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", bound=engine.Step)
CacheType = Optional[Type[BatchsizeCache]]

_NO_CACHE = NoBatchsizeCache()


def _drive(step: S, cache: BatchsizeCache, initial: int, policy: SizePolicy, distributed: Any) -> S:
    """The engine, with the ranks' agreement at every attempt when `distributed` asks for it and a process
    group of several ranks exists (checked per call: the group may start after decoration)."""
    agreement = agreement_for(distributed) if distributed else None
    if agreement is None:
        return engine.drive(step, cache, initial, policy)
    engine.drive(AgreedStep(step, agreement, policy), cache, initial, policy, agreement)
    return step


def _leaf_values(obj: Any) -> Any:
    """The values inside tuples, lists and dicts, depth first."""
    if isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _leaf_values(item)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _leaf_values(value)
    else:
        yield obj


# --- choosing the cache --------------------------------------------------------------------------------


def _function_context(func: Callable[..., Any]) -> Hashable:
    """Identify a function by its code, so that closures, lambdas and bound methods created anew share
    one cache entry and the cache keeps none of them (nor what they capture) alive."""
    target = innermost_function(func)
    code = getattr(target, "__code__", None)
    if code is not None:
        return code
    if isinstance(target, (types.BuiltinFunctionType, type)):
        return target  # lives as long as the program anyway
    return cast(Hashable, type(target))  # a callable object: identified by its class, keeping no instance alive


def _cache_for(
    cache_type: CacheType, context: Optional[Hashable], own_caches: Optional[BoundedDict], func: Callable[..., Any]
) -> BatchsizeCache:
    """The cache for a call: by context if one is given, else the decorated function's own."""
    resolved = cache_type if cache_type is not None else get_default_cache_type()
    if context is None:
        if own_caches is not None:
            cache: BatchsizeCache = own_caches.get_or_create(resolved, resolved)  # type: ignore[arg-type]
            return cache
        context = _function_context(func)
    return get_cache_for_context(resolved, context)


def _optional_cache_type(cache_type: CacheType, name: str) -> CacheType:
    return None if cache_type is None else check_cache_type(cache_type, name)


def _initial(default: Optional[int], override: Any, name: str, override_name: str) -> int:
    if override is not None:
        return check_size(override, override_name)
    if default is None:
        raise TypeError(f"{name} is required: give it to the decorator or pass {override_name}= to the call")
    return default


def _describe(wrapped: Callable[..., Any], form: str, extra: str) -> None:
    wrapped.__doc__ = f"Wrapped in {form}: also takes {extra}.\n\n{wrapped.__doc__ or ''}"


def _decorate(func: Any, form: str, size_name: str, wrap: Callable[[Callable[..., Any]], Any]) -> Any:
    """Check `func` and wrap it; a staticmethod stays one (wrapping the function inside), so the result
    works through the class and through an instance alike."""
    check_function(func, form, size_name)
    if isinstance(func, staticmethod):
        return staticmethod(wrap(func.__func__))
    return wrap(func)


class _Options:
    """The options every cached form takes (cache type, context, policy, distributed), checked once and used
    by each call: which cache entry the call gets, and the engine run with the policy and the agreement."""

    __slots__ = ("cache_type", "context", "policy", "distributed", "own_caches")

    def __init__(
        self, cache_type: CacheType, context: Optional[Hashable], policy: Any, distributed: Any, prefix: str = ""
    ) -> None:
        self.cache_type = _optional_cache_type(cache_type, f"{prefix}cache_type")
        self.policy = check_policy(policy, f"{prefix}policy")
        self.context, self.distributed = context, distributed
        self.own_caches: Optional[BoundedDict] = None  # a decorated function's own caches, one per cache type

    def as_kwargs(self) -> Dict[str, Any]:
        return dict(cache_type=self.cache_type, context=self.context, policy=self.policy, distributed=self.distributed)

    def cache(self, func: Callable[..., Any], toma_context: Optional[Hashable] = None) -> BatchsizeCache:
        return _cache_for(
            self.cache_type, self.context if toma_context is None else toma_context, self.own_caches, func
        )

    def call(self, step: S, initial: int, toma_context: Optional[Hashable] = None) -> S:
        policy = self.policy or get_default_policy()
        return _drive(step, self.cache(step.func, toma_context), initial, policy, self.distributed)


def _call_batch(func: Callable[..., R], options: _Options, initial: int, args: Any, kwargs: Any) -> R:
    return cast(R, options.call(engine.BatchStep(func, args, kwargs), initial).result)


# --- simple --------------------------------------------------------------------------------------------


class simple:
    """Plain calls without a cache: each call starts at its initial size."""

    @staticmethod
    def batch(func: Callable[Concatenate[int, P], R], initial_batchsize: int, *args: P.args, **kwargs: P.kwargs) -> R:
        """`func(batchsize, *args, **kwargs)`, halving `batchsize` on out-of-memory errors; returns its result."""
        check_function(func, "simple.batch")
        initial = check_size(initial_batchsize, "initial_batchsize")
        step = engine.BatchStep(func, args, kwargs)
        return cast(R, engine.drive(step, _NO_CACHE, initial, get_default_policy()).result)

    @staticmethod
    def range(
        func: Callable[Concatenate[int, int, P], Any],
        start: int,
        end: int,
        initial_step: int,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> None:
        """`func(chunk_start, chunk_end, *args, **kwargs)` over `[start, end)`, halving the step on OOM."""
        check_function(func, "simple.range")
        start, end = check_index(start, "start"), check_index(end, "end")
        initial = check_size(initial_step, "initial_step")
        engine.drive(engine.RangeStep(func, start, end, args, kwargs), _NO_CACHE, initial, get_default_policy())

    @staticmethod
    def chunked(
        func: Callable[[torch.Tensor, int, int], Any], tensor: torch.Tensor, initial_step: int, dimension: int = 0
    ) -> None:
        """`func(chunk, chunk_start, chunk_end)` over chunks of `tensor` along `dimension`, halving on OOM."""
        check_function(func, "simple.chunked")
        initial = check_size(initial_step, "initial_step")
        dim = check_tensor_dimension(tensor, check_dimension(dimension, "dimension"), "tensor", "dimension")
        engine.drive(engine.ChunkStep(func, tensor, dim, (), {}), _NO_CACHE, initial, get_default_policy())


# --- explicit ------------------------------------------------------------------------------------------


class explicit:
    """Plain calls with a cache (`toma_cache_type`, keyed by `toma_context` or the function)."""

    @staticmethod
    def batch(
        func: Callable[..., R],
        initial_batchsize: int,
        *args: Any,
        toma_context: Optional[Hashable] = None,
        toma_cache_type: CacheType = None,
        toma_policy: Optional[SizePolicy] = None,
        toma_distributed: Any = False,
        **kwargs: Any,
    ) -> R:
        """`func(batchsize, *args, **kwargs)`, shrinking `batchsize` on out-of-memory errors; returns its result."""
        check_function(func, "explicit.batch")
        initial = check_size(initial_batchsize, "initial_batchsize")
        options = _Options(toma_cache_type, toma_context, toma_policy, toma_distributed, prefix="toma_")
        return _call_batch(func, options, initial, args, kwargs)

    @staticmethod
    def range(
        func: Callable[..., Any],
        start: int,
        end: int,
        initial_step: int,
        *args: Any,
        toma_context: Optional[Hashable] = None,
        toma_cache_type: CacheType = None,
        toma_policy: Optional[SizePolicy] = None,
        toma_distributed: Any = False,
        **kwargs: Any,
    ) -> None:
        """`func(chunk_start, chunk_end, *args, **kwargs)` over `[start, end)`, shrinking the step on OOM."""
        check_function(func, "explicit.range")
        start, end = check_index(start, "start"), check_index(end, "end")
        initial = check_size(initial_step, "initial_step")
        options = _Options(toma_cache_type, toma_context, toma_policy, toma_distributed, prefix="toma_")
        options.call(engine.RangeStep(func, start, end, args, kwargs), initial)

    @staticmethod
    def chunked(
        func: Callable[..., Any],
        tensor: torch.Tensor,
        initial_step: int,
        *args: Any,
        toma_dimension: Optional[int] = None,
        toma_context: Optional[Hashable] = None,
        toma_cache_type: CacheType = None,
        toma_policy: Optional[SizePolicy] = None,
        toma_distributed: Any = False,
        **kwargs: Any,
    ) -> None:
        """`func(chunk, chunk_start, chunk_end, *args, **kwargs)` over chunks of `tensor`, shrinking on OOM."""
        check_function(func, "explicit.chunked")
        initial = check_size(initial_step, "initial_step")
        dim = check_tensor_dimension(
            tensor, check_dimension(toma_dimension, "toma_dimension"), "tensor", "toma_dimension"
        )
        options = _Options(toma_cache_type, toma_context, toma_policy, toma_distributed, prefix="toma_")
        options.call(engine.ChunkStep(func, tensor, dim, args, kwargs), initial)

    @staticmethod
    def accumulate(
        func: Callable[..., torch.Tensor],
        model: torch.nn.Module,
        initial_micro_batch: int,
        *args: Any,
        toma_reduction: str = "mean",
        toma_weight: Optional[Callable[..., Any]] = None,
        toma_scaler: Any = None,
        toma_context: Optional[Hashable] = None,
        toma_cache_type: CacheType = None,
        toma_policy: Optional[SizePolicy] = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Forward and backward `func(*args, **kwargs)` over the logical batch in micro-batches that fit,
        gradients as from one full-batch pass; returns the logical batch's loss, detached."""
        check_function(func, "explicit.accumulate")
        model = check_model(model, "model")
        initial = check_size(initial_micro_batch, "initial_micro_batch")
        reduction = check_reduction(toma_reduction, "toma_reduction")
        weight = check_weight(toma_weight, "toma_weight", reduction)
        scaler = check_scaler(toma_scaler, "toma_scaler")
        options = _Options(toma_cache_type, toma_context, toma_policy, False, prefix="toma_")
        return accumulate(
            func,
            model,
            initial,
            BatchSplit(args, kwargs),
            reduction=reduction,
            weight=weight,
            scaler=scaler,
            cache=options.cache(func),
            policy=options.policy,
        )


# --- toma ----------------------------------------------------------------------------------------------


class _DefaultCacheType:
    """`DEFAULT_CACHE_TYPE` as a live attribute: reading and assigning it go to one shared setting."""

    def __get__(self, instance: Any, owner: Any = None) -> Type[BatchsizeCache]:
        return get_default_cache_type()

    def __set__(self, instance: Any, value: Type[BatchsizeCache]) -> None:
        set_default_cache_type(value)


class _DefaultPolicy:
    """`DEFAULT_POLICY` as a live attribute, like `DEFAULT_CACHE_TYPE`."""

    def __get__(self, instance: Any, owner: Any = None) -> SizePolicy:
        return get_default_policy()

    def __set__(self, instance: Any, value: SizePolicy) -> None:
        set_default_policy(value)


class _TomaNamespace(type):
    DEFAULT_CACHE_TYPE = _DefaultCacheType()
    DEFAULT_POLICY = _DefaultPolicy()


class PackageModule(types.ModuleType):
    """The class of the `toma` package module, so that `toma.DEFAULT_CACHE_TYPE = ...` (and
    `toma.DEFAULT_POLICY = ...`) take effect."""

    DEFAULT_CACHE_TYPE = _DefaultCacheType()
    DEFAULT_POLICY = _DefaultPolicy()


class toma(metaclass=_TomaNamespace):
    """Decorators that retry a function with a smaller batch or step after an out-of-memory error."""

    DEFAULT_CACHE_TYPE: Type[BatchsizeCache]  # the live setting (see _TomaNamespace), declared for checkers
    DEFAULT_POLICY: SizePolicy
    NoBatchsizeCache = NoBatchsizeCache
    GlobalBatchsizeCache = GlobalBatchsizeCache
    StacktraceMemoryBatchsizeCache = StacktraceMemoryBatchsizeCache
    explicit = explicit
    simple = simple
    whole = whole
    HostedEmbedding = HostedEmbedding

    @overload
    @staticmethod
    def batch(
        func: Callable[Concatenate[int, P], R],
        *,
        initial_batchsize: Optional[int] = None,
        cache_type: CacheType = None,
        context: Optional[Hashable] = None,
        policy: Optional[SizePolicy] = None,
        distributed: Any = False,
    ) -> BatchFunction[P, R]: ...

    @overload
    @staticmethod
    def batch(
        func: None = None,
        *,
        initial_batchsize: Optional[int] = None,
        cache_type: CacheType = None,
        context: Optional[Hashable] = None,
        policy: Optional[SizePolicy] = None,
        distributed: Any = False,
    ) -> Callable[[Callable[Concatenate[int, P], R]], BatchFunction[P, R]]: ...

    @staticmethod
    def batch(
        func: Any = None,
        *,
        initial_batchsize: Optional[int] = None,
        cache_type: CacheType = None,
        context: Optional[Hashable] = None,
        policy: Optional[SizePolicy] = None,
        distributed: Any = False,
    ) -> Any:
        """`@toma.batch(initial_batchsize=512)`: the function's first argument becomes the batch size."""
        default = None if initial_batchsize is None else check_size(initial_batchsize, "initial_batchsize")
        options = _Options(cache_type, context, policy, distributed)
        if func is None:
            return functools.partial(toma.batch, initial_batchsize=default, **options.as_kwargs())

        def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
            options.own_caches = BoundedDict(16)

            @functools.wraps(func)
            def wrapped(
                *args: Any,
                toma_initial_batchsize: Optional[int] = None,
                toma_context: Optional[Hashable] = None,
                **kwargs: Any,
            ) -> Any:
                initial = _initial(default, toma_initial_batchsize, "initial_batchsize", "toma_initial_batchsize")
                return options.call(engine.BatchStep(func, args, kwargs), initial, toma_context).result

            _describe(wrapped, "toma.batch", "toma_initial_batchsize= and toma_context=")
            return wrapped

        return _decorate(func, "toma.batch", "initial_batchsize", wrap)

    @overload
    @staticmethod
    def range(
        func: Callable[Concatenate[int, int, P], Any],
        *,
        initial_step: Optional[int] = None,
        cache_type: CacheType = None,
        context: Optional[Hashable] = None,
        policy: Optional[SizePolicy] = None,
        distributed: Any = False,
    ) -> RangeFunction[P]: ...

    @overload
    @staticmethod
    def range(
        func: None = None,
        *,
        initial_step: Optional[int] = None,
        cache_type: CacheType = None,
        context: Optional[Hashable] = None,
        policy: Optional[SizePolicy] = None,
        distributed: Any = False,
    ) -> Callable[[Callable[Concatenate[int, int, P], Any]], RangeFunction[P]]: ...

    @staticmethod
    def range(
        func: Any = None,
        *,
        initial_step: Optional[int] = None,
        cache_type: CacheType = None,
        context: Optional[Hashable] = None,
        policy: Optional[SizePolicy] = None,
        distributed: Any = False,
    ) -> Any:
        """`@toma.range(initial_step=32)`: `f(start, end, ...)` runs over `[start, end)` chunk by chunk."""
        default = None if initial_step is None else check_size(initial_step, "initial_step")
        options = _Options(cache_type, context, policy, distributed)
        if func is None:
            return functools.partial(toma.range, initial_step=default, **options.as_kwargs())

        def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
            options.own_caches = BoundedDict(16)

            @functools.wraps(func)
            def wrapped(
                start: int,
                end: int,
                *args: Any,
                toma_initial_step: Optional[int] = None,
                toma_context: Optional[Hashable] = None,
                **kwargs: Any,
            ) -> None:
                start, end = check_index(start, "start"), check_index(end, "end")
                initial = _initial(default, toma_initial_step, "initial_step", "toma_initial_step")
                options.call(engine.RangeStep(func, start, end, args, kwargs), initial, toma_context)

            _describe(wrapped, "toma.range", "toma_initial_step= and toma_context=")
            return wrapped

        return _decorate(func, "toma.range", "initial_step", wrap)

    @overload
    @staticmethod
    def chunked(
        func: Callable[Concatenate[torch.Tensor, int, int, P], Any],
        *,
        initial_step: Optional[int] = None,
        dimension: Optional[int] = None,
        cache_type: CacheType = None,
        context: Optional[Hashable] = None,
        policy: Optional[SizePolicy] = None,
        distributed: Any = False,
    ) -> ChunkedFunction[P]: ...

    @overload
    @staticmethod
    def chunked(
        func: None = None,
        *,
        initial_step: Optional[int] = None,
        dimension: Optional[int] = None,
        cache_type: CacheType = None,
        context: Optional[Hashable] = None,
        policy: Optional[SizePolicy] = None,
        distributed: Any = False,
    ) -> Callable[[Callable[Concatenate[torch.Tensor, int, int, P], Any]], ChunkedFunction[P]]: ...

    @staticmethod
    def chunked(
        func: Any = None,
        *,
        initial_step: Optional[int] = None,
        dimension: Optional[int] = None,
        cache_type: CacheType = None,
        context: Optional[Hashable] = None,
        policy: Optional[SizePolicy] = None,
        distributed: Any = False,
    ) -> Any:
        """`@toma.chunked(initial_step=512)`: `f(chunk, start, end, ...)` runs over chunks of a tensor."""
        default = None if initial_step is None else check_size(initial_step, "initial_step")
        default_dimension = check_dimension(dimension, "dimension")
        options = _Options(cache_type, context, policy, distributed)
        if func is None:
            return functools.partial(
                toma.chunked, initial_step=default, dimension=default_dimension, **options.as_kwargs()
            )

        def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
            options.own_caches = BoundedDict(16)

            @functools.wraps(func)
            def wrapped(
                tensor: torch.Tensor,
                *args: Any,
                toma_initial_step: Optional[int] = None,
                toma_dimension: Optional[int] = None,
                toma_context: Optional[Hashable] = None,
                **kwargs: Any,
            ) -> None:
                initial = _initial(default, toma_initial_step, "initial_step", "toma_initial_step")
                if toma_dimension is None:
                    dim = check_tensor_dimension(tensor, default_dimension, "tensor", "dimension")
                else:
                    dim = check_tensor_dimension(
                        tensor, check_index(toma_dimension, "toma_dimension"), "tensor", "toma_dimension"
                    )
                options.call(engine.ChunkStep(func, tensor, dim, args, kwargs), initial, toma_context)

            _describe(wrapped, "toma.chunked", "toma_initial_step=, toma_dimension= and toma_context=")
            return wrapped

        return _decorate(func, "toma.chunked", "initial_step", wrap)

    @overload
    @staticmethod
    def accumulate(
        func: Callable[P, torch.Tensor],
        *,
        model: torch.nn.Module,
        initial_micro_batch: Optional[int] = None,
        reduction: str = "mean",
        weight: Optional[Callable[..., Any]] = None,
        scaler: Any = None,
        cache_type: CacheType = None,
        context: Optional[Hashable] = None,
        policy: Optional[SizePolicy] = None,
    ) -> AccumulateFunction[P]: ...

    @overload
    @staticmethod
    def accumulate(
        func: None = None,
        *,
        model: torch.nn.Module,
        initial_micro_batch: Optional[int] = None,
        reduction: str = "mean",
        weight: Optional[Callable[..., Any]] = None,
        scaler: Any = None,
        cache_type: CacheType = None,
        context: Optional[Hashable] = None,
        policy: Optional[SizePolicy] = None,
    ) -> Callable[[Callable[P, torch.Tensor]], AccumulateFunction[P]]: ...

    @staticmethod
    def accumulate(
        func: Any = None,
        *,
        model: Optional[torch.nn.Module] = None,
        initial_micro_batch: Optional[int] = None,
        reduction: str = "mean",
        weight: Optional[Callable[..., Any]] = None,
        scaler: Any = None,
        cache_type: CacheType = None,
        context: Optional[Hashable] = None,
        policy: Optional[SizePolicy] = None,
    ) -> Any:
        """`@toma.accumulate(model=model, initial_micro_batch=256)` on a function returning a micro-batch's
        loss: each call runs forward and backward over the logical batch in micro-batches that fit.
        `weight(*args, **kwargs)` gives the number of items a micro-batch's mean loss averages over (label
        tokens, say) when that is not its rows."""
        checked_model = check_model(model, "model")
        default = None if initial_micro_batch is None else check_size(initial_micro_batch, "initial_micro_batch")
        reduction = check_reduction(reduction, "reduction")
        checked_weight = check_weight(weight, "weight", reduction)
        scaler = check_scaler(scaler, "scaler")
        options = _Options(cache_type, context, policy, False)
        if func is None:
            return functools.partial(
                toma.accumulate,
                model=checked_model,
                initial_micro_batch=default,
                reduction=reduction,
                weight=checked_weight,
                scaler=scaler,
                cache_type=options.cache_type,
                context=context,
                policy=options.policy,
            )

        def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
            options.own_caches = BoundedDict(16)
            stats = AccumulationStats()

            @functools.wraps(func)
            def wrapped(
                *args: Any,
                toma_initial_micro_batch: Optional[int] = None,
                toma_context: Optional[Hashable] = None,
                **kwargs: Any,
            ) -> torch.Tensor:
                initial = _initial(
                    default, toma_initial_micro_batch, "initial_micro_batch", "toma_initial_micro_batch"
                )
                return accumulate(
                    func,
                    checked_model,
                    initial,
                    BatchSplit(args, kwargs),
                    reduction=reduction,
                    weight=checked_weight,
                    scaler=scaler,
                    cache=options.cache(func, toma_context),
                    policy=options.policy,
                    stats=stats,
                )

            wrapped.stats = stats  # type: ignore[attr-defined]
            _describe(wrapped, "toma.accumulate", "toma_initial_micro_batch= and toma_context=")
            return wrapped

        return _decorate(func, "toma.accumulate", "initial_micro_batch", wrap)

    @staticmethod
    def map(
        func: Callable[..., Any],
        *inputs: Any,
        device: Any = None,
        initial_step: Optional[int] = None,
        output_device: Any = "cpu",
        cache_type: CacheType = None,
        context: Optional[Hashable] = None,
        policy: Optional[SizePolicy] = None,
        distributed: Any = False,
    ) -> Any:
        """`func(*chunk)` over row chunks of `inputs` (tensors, also in tuples, lists and dicts, that agree on
        dim 0; usually on the host) on `device`, each chunk's copy overlapping the previous chunk's compute;
        returns the outputs joined along dim 0 on `output_device` (the host by default), detached. The chunk
        size (`initial_step`, default all rows) shrinks on out-of-memory errors, finished chunks are kept, and
        it is cached per call site (or `context`)."""
        check_function(func, "toma.map")
        target = check_device(device, "device")
        output = check_device(output_device, "output_device")
        if not any(isinstance(t, torch.Tensor) and t.dim() > 0 for t in _leaf_values(inputs)):
            raise ValueError(
                "toma.map needs inputs: tensors (also inside tuples, lists or dicts) whose dim 0 holds the rows "
                f"to map over; got {len(inputs)} input(s) with none"
            )
        split = BatchSplit(inputs, {}, name="inputs")
        initial = split.size if initial_step is None else check_size(initial_step, "initial_step")
        options = _Options(cache_type, call_site_key() if context is None else context, policy, distributed)
        transfers = Transfers(target)
        split = split.placed(transfers.place)  # toma.whole values move once per call, not once per chunk
        step = options.call(MapStep(func, split, transfers, output), initial)
        return step.result()

    class execute:
        """Run the decorated block at once (`@toma.execute.batch(512)` above a `def`); cached per call site."""

        @staticmethod
        def batch(
            initial_batchsize: int,
            cache_type: CacheType = None,
            context: Optional[Hashable] = None,
            policy: Optional[SizePolicy] = None,
            distributed: Any = False,
        ) -> Callable[[Callable[[int], R]], R]:
            initial = check_size(initial_batchsize, "initial_batchsize")
            options = _Options(cache_type, call_site_key() if context is None else context, policy, distributed)

            def execute_batch(func: Callable[[int], R]) -> R:
                check_function(func, "toma.execute.batch")
                return _call_batch(func, options, initial, (), {})

            return execute_batch

        @staticmethod
        def range(
            start: int,
            end: int,
            initial_step: int,
            cache_type: CacheType = None,
            context: Optional[Hashable] = None,
            policy: Optional[SizePolicy] = None,
            distributed: Any = False,
        ) -> Callable[[Callable[[int, int], Any]], None]:
            start, end = check_index(start, "start"), check_index(end, "end")
            initial = check_size(initial_step, "initial_step")
            options = _Options(cache_type, call_site_key() if context is None else context, policy, distributed)

            def execute_range(func: Callable[[int, int], Any]) -> None:
                check_function(func, "toma.execute.range")
                options.call(engine.RangeStep(func, start, end, (), {}), initial)

            return execute_range

        @staticmethod
        def chunked(
            tensor: torch.Tensor,
            initial_step: Optional[int] = None,
            dimension: Optional[int] = None,
            cache_type: CacheType = None,
            context: Optional[Hashable] = None,
            policy: Optional[SizePolicy] = None,
            distributed: Any = False,
        ) -> Callable[[Callable[[torch.Tensor, int, int], Any]], None]:
            initial = check_size(initial_step, "initial_step")
            dim = check_tensor_dimension(tensor, check_dimension(dimension, "dimension"), "tensor", "dimension")
            options = _Options(cache_type, call_site_key() if context is None else context, policy, distributed)

            def execute_chunked(func: Callable[[torch.Tensor, int, int], Any]) -> None:
                check_function(func, "toma.execute.chunked")
                options.call(engine.ChunkStep(func, tensor, dim, (), {}), initial)

            return execute_chunked
