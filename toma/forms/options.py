"""What every cached form shares: its options (cache type, context, policy, distributed) checked once, which
cache entry a call gets, and the engine run with the policy and the ranks' agreement."""

import types
from typing import Any, Callable, Dict, Hashable, Optional, Type, TypeVar, cast

from toma.core import engine
from toma.core.agreement import AgreedStep, agreement_for
from toma.core.arguments import check_size, innermost_function
from toma.core.caches import (
    BatchsizeCache,
    BoundedDict,
    NoBatchsizeCache,
    check_cache_type,
    get_cache_for_context,
    get_default_cache_type,
)
from toma.core.policy import SizePolicy, check_policy
from toma.core.steps import Step
from toma.sizing.policies import get_default_policy

__all__ = ["CacheType", "CallOptions", "PLAIN", "initial_size"]

S = TypeVar("S", bound=Step)
CacheType = Optional[Type[BatchsizeCache]]


def _function_context(func: Callable[..., Any]) -> Hashable:
    """Identify a function by its code, so that closures, lambdas and bound methods created anew share
    one cache entry and the cache keeps none of them (nor what they capture) alive."""
    target = innermost_function(func)
    code = getattr(target, "__code__", None)
    if code is not None:
        return cast(Hashable, code)
    if isinstance(target, (types.BuiltinFunctionType, type)):
        return target  # lives as long as the program anyway
    return cast(Hashable, type(target))  # a callable object: identified by its class, keeping no instance alive


class CallOptions:
    """The options every cached form takes, checked once (`prefix`: `toma_` for the plain calls' names) and
    used by each call. `own_caches`: a decorated function's own caches, one per cache type."""

    __slots__ = ("cache_type", "context", "policy", "distributed", "own_caches", "fixed_cache")

    def __init__(
        self,
        cache_type: CacheType = None,
        context: Optional[Hashable] = None,
        policy: Any = None,
        distributed: Any = False,
        prefix: str = "",
        fixed_cache: Optional[BatchsizeCache] = None,
    ) -> None:
        self.cache_type = None if cache_type is None else check_cache_type(cache_type, f"{prefix}cache_type")
        self.policy: Optional[SizePolicy] = check_policy(policy, f"{prefix}policy")
        self.context, self.distributed = context, distributed
        self.own_caches: Optional[BoundedDict] = None
        self.fixed_cache = fixed_cache

    def as_kwargs(self, agreed: bool = True) -> Dict[str, Any]:
        """The options as the decorators' keywords (without `distributed` for a form that does not take it)."""
        kwargs: Dict[str, Any] = dict(cache_type=self.cache_type, context=self.context, policy=self.policy)
        if agreed:
            kwargs["distributed"] = self.distributed
        return kwargs

    def cache(self, func: Callable[..., Any], context: Optional[Hashable] = None) -> BatchsizeCache:
        """The cache for a call: by context if one is given, else the decorated function's own."""
        if self.fixed_cache is not None:
            return self.fixed_cache
        resolved = self.cache_type if self.cache_type is not None else get_default_cache_type()
        context = self.context if context is None else context
        if context is None:
            if self.own_caches is not None:
                cache: BatchsizeCache = self.own_caches.get_or_create(cast(Hashable, resolved), resolved)
                return cache
            context = _function_context(func)
        return get_cache_for_context(resolved, context)

    def perform(self, step: S, initial: int, context: Optional[Hashable] = None) -> S:
        """The engine over `step`, with the ranks' agreement at every attempt when `distributed` asks for it
        and a process group of several ranks exists (checked per call: the group may start after decoration)."""
        policy = self.policy or get_default_policy()
        cache = self.cache(step.func, context)
        agreement = agreement_for(self.distributed) if self.distributed else None
        if agreement is None:
            return engine.drive(step, cache, initial, policy)
        engine.drive(AgreedStep(step, agreement, policy), cache, initial, policy, agreement)
        return step


PLAIN = CallOptions(fixed_cache=NoBatchsizeCache())  # `simple.*`: no cache, the default policy


def initial_size(default: Optional[int], override: Any, name: str, override_name: str) -> int:
    """A call's initial size: its `toma_initial_*=` override, else the decorator's."""
    if override is not None:
        return check_size(override, override_name)
    if default is None:
        raise TypeError(f"{name} is required: give it to the decorator or pass {override_name}= to the call")
    return default
