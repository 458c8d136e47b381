"""The `toma` namespace: the decorators `toma.batch`, `toma.range`, `toma.chunked`, `toma.accumulate`, the call
`toma.map`, and `toma.execute`, `toma.explicit`, `toma.simple`. Each decorator is two overloads (bare, and
given its options: `toma.core.signatures`) and one `_decorator` call around its form's step."""

import functools
from typing import (
    Any,
    Callable,
    Dict,
    Hashable,
    NamedTuple,
    Optional,
    ParamSpec,
    Tuple,
    Type,
    TypeVar,
    overload,
)

import torch

from toma.accumulation.accumulate import AccumulationStats
from toma.accumulation.options import AccumulationOptions
from toma.accumulation.per_function import learned_about
from toma.batching.splitting import whole
from toma.batching.tokens import check_lengths
from toma.batching.transfer import check_device
from toma.core.arguments import check_dimension, check_function, check_index, check_size, check_tensor_dimension
from toma.core.caches import (
    BatchsizeCache,
    GlobalBatchsizeCache,
    NoBatchsizeCache,
    StacktraceMemoryBatchsizeCache,
)
from toma.core.policy import SizePolicy
from toma.core.runner import Runner
from toma.core.signatures import (
    AccumulateFunction,
    AccumulateOptions,
    Batchable,
    BatchFunction,
    BatchOptions,
    Chunkable,
    ChunkedFunction,
    ChunkedOptions,
    Rangeable,
    RangeFunction,
    RangeOptions,
    Unpack,
)
from toma.core.steps import BatchStep, ChunkStep, RangeStep
from toma.forms.call_runners import CacheType, calls, initial_size, optional_initial_size
from toma.forms.inline import execute
from toma.forms.live_settings import SettingsNamespace
from toma.forms.plain import explicit, simple
from toma.forms.runs import Args, Kwargs, run_accumulate, run_map
from toma.offload.hosted_embedding import HostedEmbedding
from toma.sizing.defaults import ACCUMULATION

__all__ = ["toma"]

P = ParamSpec("P")
R = TypeVar("R")
Bound = Tuple[Callable[..., Any], Dict[str, Any]]  # a decorated function's wrapper, and attributes to set on it


class _Form(NamedTuple):
    name: str  # "toma.batch"
    size: str  # the decorator's size argument; its override per call is `toma_` and this name
    extra: str  # the keywords the wrapper adds, for its docstring
    agreed: bool = True  # whether the decorator takes `distributed=`
    optional: bool = False  # whether a call may go without a size (then its step's own start: `toma.accumulate`)

    def default(self, size: Optional[int]) -> Optional[int]:
        """The decorator's size argument, checked; None when the calls must give it."""
        return None if size is None else check_size(size, self.size)


def _decorator(
    form: _Form,
    func: Any,
    runner: Runner,
    bind: Callable[[Any, Runner], Bound],
    decorator: Callable[..., Any],
    **again: Any,
) -> Any:
    """The skeleton every decorator shares: `@form(...)` without a function returns the decorator with its
    options (`again`, the form's own, and the `runner`'s); with one, checks it and wraps it with its own caches
    (`bind(func, runner)`: the wrapper and attributes to set on it). A staticmethod stays one, so the result works
    through a class and an instance."""
    if func is None:
        return functools.partial(decorator, **again, **runner.as_kwargs(form.agreed))
    check_function(func, form.name, form.size)

    def wrap(target: Callable[..., Any]) -> Callable[..., Any]:
        call, attributes = bind(target, runner.owning())
        wrapped = functools.wraps(target)(call)
        for name, value in attributes.items():
            setattr(wrapped, name, value)
        wrapped.__doc__ = f"Wrapped in {form.name}: also takes {form.extra}.\n\n{target.__doc__ or ''}"
        return wrapped

    return staticmethod(wrap(func.__func__)) if isinstance(func, staticmethod) else wrap(func)


def _sized(form: _Form, default: Optional[int], call: Callable[[Any, Args, Kwargs, Any], Any]) -> Callable[..., Any]:
    """The wrapper of a form called with the function's own arguments (`toma.batch`, `toma.accumulate`): it
    takes out the size override (`toma_initial_*=`) and `toma_context=`, and passes the rest to `call`."""
    size, override = form.size, f"toma_{form.size}"
    start = optional_initial_size if form.optional else initial_size

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        initial = start(default, kwargs.pop(override, None), size, override)
        return call(initial, args, kwargs, kwargs.pop("toma_context", None))

    return wrapped


def _accumulation_start(initial_micro_batch: Optional[int], accumulation: AccumulationOptions) -> Optional[int]:
    """`toma.accumulate`'s `initial_micro_batch`, checked, and refused beside `initial_tokens`: one start only."""
    default = _ACCUMULATE.default(initial_micro_batch)
    if accumulation.initial_tokens is not None and default is not None:
        raise ValueError(
            "give initial_micro_batch (rows of the batch's longest) or initial_tokens (a token budget), not both"
        )
    return default


def _accumulation_binding(
    accumulation: AccumulationOptions, default: Optional[int]
) -> Callable[[Callable[..., Any], Runner], Bound]:
    """`toma.accumulate`'s `bind`: each decorated function's wrapper runs the accumulation with stats of its own
    (its `stats` attribute)."""

    def bind(func: Callable[..., Any], runner: Runner) -> Bound:
        # what is learned about the function is its code's: an inline toma.accumulate(...)(f) wraps it at each call
        learned = learned_about(func, accumulation.reduction, accumulation.weight, accumulation.lengths)
        stats = AccumulationStats(packing=learned.packing, split_check=learned.split_check)

        def call(initial: Optional[int], args: Args, kwargs: Kwargs, context: Optional[Hashable]) -> torch.Tensor:
            return run_accumulate(func, accumulation, runner, initial, args, kwargs, context, stats)

        return _sized(_ACCUMULATE, default, call), {"stats": stats}

    return bind


_BATCH = _Form("toma.batch", "initial_batchsize", "toma_initial_batchsize= and toma_context=")
_RANGE = _Form("toma.range", "initial_step", "toma_initial_step= and toma_context=")
_CHUNKED = _Form("toma.chunked", "initial_step", "toma_initial_step=, toma_dimension= and toma_context=")
_ACCUMULATE = _Form(
    "toma.accumulate", "initial_micro_batch", "toma_initial_micro_batch= and toma_context=", agreed=False, optional=True
)


class toma(metaclass=SettingsNamespace):
    """Decorators that retry a function with a smaller batch or step after an out-of-memory error."""

    DEFAULT_CACHE_TYPE: Type[BatchsizeCache]  # the live setting (see SettingsNamespace), declared for checkers
    DEFAULT_POLICY: SizePolicy
    NoBatchsizeCache = NoBatchsizeCache
    GlobalBatchsizeCache = GlobalBatchsizeCache
    StacktraceMemoryBatchsizeCache = StacktraceMemoryBatchsizeCache
    explicit = explicit
    simple = simple
    execute = execute
    whole = whole
    HostedEmbedding = HostedEmbedding

    @overload
    @staticmethod
    def batch(func: Batchable[P, R], **options: Unpack[BatchOptions]) -> BatchFunction[P, R]: ...

    @overload
    @staticmethod
    def batch(
        func: None = None, **options: Unpack[BatchOptions]
    ) -> Callable[[Batchable[P, R]], BatchFunction[P, R]]: ...

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
        default = _BATCH.default(initial_batchsize)
        runner = calls(cache_type, context, policy, distributed)

        def bind(func: Callable[..., Any], runner: Runner) -> Bound:
            def call(initial: int, args: Args, kwargs: Kwargs, context: Optional[Hashable]) -> Any:
                return runner.perform(BatchStep(func, args, kwargs), initial, context).result

            return _sized(_BATCH, default, call), {}

        return _decorator(_BATCH, func, runner, bind, toma.batch, initial_batchsize=default)

    @overload
    @staticmethod
    def range(func: Rangeable[P], **options: Unpack[RangeOptions]) -> RangeFunction[P]: ...

    @overload
    @staticmethod
    def range(func: None = None, **options: Unpack[RangeOptions]) -> Callable[[Rangeable[P]], RangeFunction[P]]: ...

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
        default = _RANGE.default(initial_step)
        runner = calls(cache_type, context, policy, distributed)

        def bind(func: Callable[..., Any], runner: Runner) -> Bound:
            def wrapped(
                start: int,
                end: int,
                *args: Any,
                toma_initial_step: Optional[int] = None,
                toma_context: Optional[Hashable] = None,
                **kwargs: Any,
            ) -> None:
                start, end = check_index(start, "start"), check_index(end, "end")
                initial = initial_size(default, toma_initial_step, "initial_step", "toma_initial_step")
                runner.perform(RangeStep(func, start, end, args, kwargs), initial, toma_context)

            return wrapped, {}

        return _decorator(_RANGE, func, runner, bind, toma.range, initial_step=default)

    @overload
    @staticmethod
    def chunked(func: Chunkable[P], **options: Unpack[ChunkedOptions]) -> ChunkedFunction[P]: ...

    @overload
    @staticmethod
    def chunked(
        func: None = None, **options: Unpack[ChunkedOptions]
    ) -> Callable[[Chunkable[P]], ChunkedFunction[P]]: ...

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
        default = _CHUNKED.default(initial_step)
        default_dimension = check_dimension(dimension, "dimension")
        runner = calls(cache_type, context, policy, distributed)

        def bind(func: Callable[..., Any], runner: Runner) -> Bound:
            def wrapped(
                tensor: torch.Tensor,
                *args: Any,
                toma_initial_step: Optional[int] = None,
                toma_dimension: Optional[int] = None,
                toma_context: Optional[Hashable] = None,
                **kwargs: Any,
            ) -> None:
                initial = initial_size(default, toma_initial_step, "initial_step", "toma_initial_step")
                if toma_dimension is None:
                    dim = check_tensor_dimension(tensor, default_dimension, "tensor", "dimension")
                else:
                    dim = check_tensor_dimension(
                        tensor, check_index(toma_dimension, "toma_dimension"), "tensor", "toma_dimension"
                    )
                runner.perform(ChunkStep(func, tensor, dim, args, kwargs), initial, toma_context)

            return wrapped, {}

        return _decorator(_CHUNKED, func, runner, bind, toma.chunked, initial_step=default, dimension=default_dimension)

    @overload
    @staticmethod
    def accumulate(func: Callable[P, torch.Tensor], **options: Unpack[AccumulateOptions]) -> AccumulateFunction[P]: ...

    @overload
    @staticmethod
    def accumulate(
        func: None = None, **options: Unpack[AccumulateOptions]
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
        lengths: Any = None,
        initial_tokens: Optional[int] = None,
        gradient_sync: str = "auto",
        groups: Any = None,
        split_for_padding: bool = True,
        levers: bool = True,
    ) -> Any:
        """`@toma.accumulate(model=model, initial_micro_batch=256)` on a function returning a micro-batch's
        loss: each call runs forward and backward over the logical batch in micro-batches that fit. `weight(*args,
        **kwargs)` gives the number of items a micro-batch's mean loss averages over (label tokens, say) when that is
        not its rows. `lengths=` (a 0/1 mask's name, such as "attention_mask", or a function of the arguments giving
        each row's length) sorts the rows by length and packs them under a token budget, each micro-batch trimmed to
        its longest row; the budget starts at `initial_tokens`, or at `initial_micro_batch` rows of the batch's
        longest. `gradient_sync=` (FSDP2 models): "logical_batch" holds
        the unsharded gradients and reduce-scatters once per logical batch, "micro_batch" after every micro-batch
        (less memory, more communication), "sharded" leaves the parameters sharded in FSDP2's own schedule, each
        collective agreed on (FSDP2's memory), "auto" each in turn where memory runs short.
        `lengths="position_ids"` (or "cu_seq_lens_q", "seq_idx"): a padding-free batch, cut between its packed
        sequences. `groups=`: rows that belong together ("pairs": row i with row i + n/2, as DPO's chosen and
        rejected rows; "batch": never split; a function giving each row's group; "rows": each on its own); by
        default each row is its own, which toma checks once, on the first batch it splits. With `lengths=`, a batch
        that fits may still run as several micro-batches where the padding that saves is worth more than a
        micro-batch costs (measured); `split_for_padding=False` runs a batch that fits whole. A row that does not fit
        runs with activation checkpointing for the rest of the call (`levers=False`: the error instead)."""
        accumulation = AccumulationOptions.checked(
            model, reduction=reduction, weight=weight, scaler=scaler, lengths=lengths, initial_tokens=initial_tokens,
            gradient_sync=gradient_sync, groups=groups, split_for_padding=split_for_padding, levers=levers,
        )  # fmt: skip
        default = _accumulation_start(initial_micro_batch, accumulation)
        runner = calls(cache_type, context, policy, False, default=ACCUMULATION)
        bind = _accumulation_binding(accumulation, default)
        again = dict(initial_micro_batch=_ACCUMULATE.default(initial_micro_batch), **accumulation.as_kwargs())
        return _decorator(_ACCUMULATE, func, runner, bind, toma.accumulate, **again)

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
        lengths: Any = None,
    ) -> Any:
        """`func(*chunk)` over row chunks of `inputs` (tensors, also in tuples, lists and dicts, that agree on
        dim 0; usually on the host) on `device`, each chunk's copy overlapping the previous chunk's compute;
        returns the outputs joined along dim 0 on `output_device` (the host by default), detached. The chunk
        size (`initial_step`, default all rows) shrinks on out-of-memory errors, finished chunks are kept, and
        it is cached per call site (or `context`). `lengths=` (a 0/1 mask's name in a dict input, or a function
        of the inputs giving each row's length): rows sorted by length, chunked by a token budget (`initial_step`
        rows of the longest to start), each chunk trimmed to its longest row; outputs as wide as a chunk are
        padded back with zeros, and come back in the inputs' row order."""
        check_function(func, "toma.map")
        checked_lengths = check_lengths(lengths, "lengths")
        target = check_device(device, "device")
        output = check_device(output_device, "output_device")
        initial = None if initial_step is None else check_size(initial_step, "initial_step")
        runner = calls(cache_type, context, policy, distributed, per_call_site=True)
        return run_map(func, inputs, target, output, initial, runner, checked_lengths)
