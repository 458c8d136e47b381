"""`toma.execute.*`: run the decorated block at once (`@toma.execute.batch(512)` above a `def`), cached per
call site."""

from typing import Any, Callable, Hashable, Optional, TypeVar, cast

import torch

from toma.core.arguments import check_dimension, check_function, check_index, check_size, check_tensor_dimension
from toma.core.policy import SizePolicy
from toma.core.runner import Runner
from toma.core.steps import BatchStep, ChunkStep, RangeStep
from toma.forms.call_runners import CacheType, calls

__all__ = ["execute"]

R = TypeVar("R")


def _runner(cache_type: CacheType, context: Optional[Hashable], policy: Any, distributed: Any) -> Runner:
    return calls(cache_type, context, policy, distributed, per_call_site=True)


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
        runner = _runner(cache_type, context, policy, distributed)

        def execute_batch(func: Callable[[int], R]) -> R:
            check_function(func, "toma.execute.batch")
            return cast(R, runner.perform(BatchStep(func, (), {}), initial).result)

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
        runner = _runner(cache_type, context, policy, distributed)

        def execute_range(func: Callable[[int, int], Any]) -> None:
            check_function(func, "toma.execute.range")
            runner.perform(RangeStep(func, start, end, (), {}), initial)

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
        runner = _runner(cache_type, context, policy, distributed)

        def execute_chunked(func: Callable[[torch.Tensor, int, int], Any]) -> None:
            check_function(func, "toma.execute.chunked")
            runner.perform(ChunkStep(func, tensor, dim, (), {}), initial)

        return execute_chunked
