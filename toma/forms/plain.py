"""The plain calls: `explicit.*` (with a cache, options as `toma_*` keywords) and `simple.*` (no cache)."""

from typing import Any, Callable, Concatenate, Hashable, Optional, ParamSpec, TypeVar, cast

import torch

from toma.accumulation.options import AccumulationOptions
from toma.core.arguments import check_dimension, check_function, check_index, check_size, check_tensor_dimension
from toma.core.policy import SizePolicy
from toma.core.steps import BatchStep, ChunkStep, RangeStep
from toma.forms.call_runners import PLAIN, CacheType, calls
from toma.forms.runs import run_accumulate
from toma.sizing.defaults import ACCUMULATION

__all__ = ["explicit", "simple"]

P = ParamSpec("P")
R = TypeVar("R")


class simple:
    """Plain calls without a cache: each call starts at its initial size."""

    @staticmethod
    def batch(func: Callable[Concatenate[int, P], R], initial_batchsize: int, *args: P.args, **kwargs: P.kwargs) -> R:
        """`func(batchsize, *args, **kwargs)`, halving `batchsize` on out-of-memory errors; returns its result."""
        check_function(func, "simple.batch")
        initial = check_size(initial_batchsize, "initial_batchsize")
        return cast(R, PLAIN.perform(BatchStep(func, args, kwargs), initial).result)

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
        PLAIN.perform(RangeStep(func, start, end, args, kwargs), initial)

    @staticmethod
    def chunked(
        func: Callable[[torch.Tensor, int, int], Any], tensor: torch.Tensor, initial_step: int, dimension: int = 0
    ) -> None:
        """`func(chunk, chunk_start, chunk_end)` over chunks of `tensor` along `dimension`, halving on OOM."""
        check_function(func, "simple.chunked")
        initial = check_size(initial_step, "initial_step")
        dim = check_tensor_dimension(tensor, check_dimension(dimension, "dimension"), "tensor", "dimension")
        PLAIN.perform(ChunkStep(func, tensor, dim, (), {}), initial)


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
        runner = calls(toma_cache_type, toma_context, toma_policy, toma_distributed, prefix="toma_")
        return cast(R, runner.perform(BatchStep(func, args, kwargs), initial).result)

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
        runner = calls(toma_cache_type, toma_context, toma_policy, toma_distributed, prefix="toma_")
        runner.perform(RangeStep(func, start, end, args, kwargs), initial)

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
        runner = calls(toma_cache_type, toma_context, toma_policy, toma_distributed, prefix="toma_")
        runner.perform(ChunkStep(func, tensor, dim, args, kwargs), initial)

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
        toma_lengths: Any = None,
        toma_gradient_sync: str = "auto",
        toma_groups: Any = None,
        toma_split_for_padding: bool = True,
        toma_levers: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Forward and backward `func(*args, **kwargs)` over the logical batch in micro-batches that fit,
        gradients as from one full-batch pass; returns the logical batch's loss, detached. `toma_lengths=`: as
        `toma.accumulate`'s `lengths=`, starting from `initial_micro_batch` rows of the batch's longest;
        `toma_groups=`, `toma_split_for_padding=`: as its `groups=`, `split_for_padding=`."""
        check_function(func, "explicit.accumulate")
        accumulation = AccumulationOptions.checked(
            model,
            prefix="toma_",
            reduction=toma_reduction,
            weight=toma_weight,
            scaler=toma_scaler,
            lengths=toma_lengths,
            gradient_sync=toma_gradient_sync,
            groups=toma_groups,
            split_for_padding=toma_split_for_padding,
            levers=toma_levers,
        )
        initial = check_size(initial_micro_batch, "initial_micro_batch")
        runner = calls(toma_cache_type, toma_context, toma_policy, False, "toma_", ACCUMULATION)
        return run_accumulate(func, accumulation, runner, initial, args, kwargs)
