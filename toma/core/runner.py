"""Runner: the one door into the engine. Every form, `toma.accumulate`, the Trainer, `toma.map`, `HostedEmbedding`
and the integrations build a Runner once, from options checked as they enter, and run their steps through it.

A Runner resolves, per run: the sizing policy (the one given, else its capability's default, `toma.sizing.defaults`:
the policy assigned to `toma.DEFAULT_POLICY`, else the capability's own), the cache entry (a fixed cache, or one per cache type
and context or decorated function), the ranks' agreement (`distributed=`, or the one a step that reports to it
brings) and the observers. Nothing but this module calls `toma.core.engine.run`.
"""

import copy
import types
from typing import Any, Callable, Dict, Hashable, Optional, Sequence, Type, TypeVar, cast

from toma.core import engine
from toma.core.agreement import AgreedStep, Agreement, agreement_for, check_distributed
from toma.core.arguments import check_context, innermost_function
from toma.core.caches import (
    BatchsizeCache,
    BoundedDict,
    check_cache_type,
    get_cache_for_context,
    get_default_cache_type,
)
from toma.core.observers import Observer, Observers
from toma.core.policy import CallState, DefaultPolicy, SizePolicy, check_policy
from toma.core.steps import TOKEN_BUDGET, Step

__all__ = ["Runner", "CacheType"]

S = TypeVar("S", bound=Step)
CacheType = Optional[Type[BatchsizeCache]]


class _TokenSizes:
    """The mark of a token-budget step's caches beside a context: private, so no context of a user's equals it."""


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


class Runner:
    """Runs steps through the engine with options checked once (`prefix`: `toma_` for the plain calls' names).

    `default`: the capability's default policy (`toma.sizing.defaults`), resolved per run where none is given.
    `cache`: one cache for every call (else `cache_type` and `context`, or the function's `own_caches` when a
    decorator made the Runner). `distributed`: False, True (the default process group) or a process group whose
    ranks agree on every size. `observers`: the engine's (the log, the size file, the gauge) when None.
    A Runner is not changed after it is built.
    """

    __slots__ = ("default", "cache_type", "context", "policy", "distributed", "observers", "_fixed", "_own")

    def __init__(
        self,
        default: DefaultPolicy,
        *,
        cache_type: CacheType = None,
        context: Optional[Hashable] = None,
        policy: Any = None,
        distributed: Any = False,
        cache: Optional[BatchsizeCache] = None,
        own_caches: bool = False,
        observers: Optional[Sequence[Observer]] = None,
        prefix: str = "",
    ) -> None:
        self.default = default
        self.cache_type = None if cache_type is None else check_cache_type(cache_type, f"{prefix}cache_type")
        self.policy: Optional[SizePolicy] = check_policy(policy, f"{prefix}policy")
        self.context = context  # checked where the user gave it (`toma.forms.call_runners.calls`)
        self.distributed = check_distributed(distributed, f"{prefix}distributed")
        self.observers = engine.OBSERVERS if observers is None else Observers(observers)
        self._fixed = cache
        self._own: Optional[BoundedDict] = BoundedDict(16) if own_caches and cache is None else None

    def owning(self) -> "Runner":
        """The same options with caches of its own: a decorated function's, one per cache type."""
        return Runner(
            self.default,
            cache_type=self.cache_type,
            context=self.context,
            policy=self.policy,
            distributed=self.distributed,
            cache=self._fixed,
            own_caches=True,
            observers=self.observers.observers,
        )

    def with_policy(self, policy: Any) -> "Runner":
        """The same options and caches with another policy (checked; None: the default): what assigning an
        owner's `policy` attribute builds, so the assignment is honoured from the next run on."""
        runner: Runner = copy.copy(self)
        runner.policy = check_policy(policy, "policy")
        return runner

    def as_kwargs(self, agreed: bool = True) -> Dict[str, Any]:
        """The options as the decorators' keywords (without `distributed` for a form that does not take it)."""
        kwargs: Dict[str, Any] = dict(cache_type=self.cache_type, context=self.context, policy=self.policy)
        if agreed:
            kwargs["distributed"] = self.distributed
        return kwargs

    def resolved_policy(self) -> SizePolicy:
        """The policy of a run starting now (`toma.DEFAULT_POLICY` is read at call time)."""
        return self.policy or self.default.current

    def cache(self, func: Callable[..., Any], context: Optional[Hashable] = None, unit: str = "") -> BatchsizeCache:
        """The cache for a call of `func`: the fixed one, else by context if one is given, else the function's.
        `unit`: `TOKEN_BUDGET` for a step sized in tokens, whose sizes are kept apart from sizes in rows where a
        context (or a function) is shared: 8 rows are no budget of 8 tokens, and 4 tokens no size in rows."""
        if self._fixed is not None:
            return self._fixed
        resolved = self.cache_type if self.cache_type is not None else get_default_cache_type()
        context = self.context if context is None else context
        if context is None:
            own = self._own
            if own is not None:  # read before the locked path, with no call: the hot path
                key: Hashable = (resolved, _TokenSizes) if unit else resolved  # type: ignore[assignment]
                cache = own.entries.get(key)
                return cache if cache is not None else own.get_or_create(key, resolved)  # type: ignore[no-any-return]
            context = _function_context(func)
        return get_cache_for_context(resolved, (_TokenSizes, context) if unit else context)

    def drive(
        self, step: Step, initial: int, context: Optional[Hashable] = None, agreement: Optional[Agreement] = None
    ) -> Optional[CallState[Step]]:
        """Run `step` to completion from `initial`; returns the run's state (its entry, attempts, last size), None
        for a run that fit at once with nothing to learn, agree on or tell.
        `agreement`: the one a step reports to itself (accumulation's gradient sync); else `distributed=` wraps
        the step so that every attempt ends in the ranks' agreement (checked per call: the group may start after
        the Runner was built)."""
        policy = self.policy or self.default.current  # resolved_policy(), on the hot path
        if context is not None:  # a call's own `toma_context=`, checked where it is given
            check_context(context, "toma_context")
        entry = self.cache(step.func, context, TOKEN_BUDGET if step.size_name == TOKEN_BUDGET else "").get_batchsize(
            initial
        )
        if agreement is None and self.distributed:
            agreement = agreement_for(self.distributed)
            if agreement is not None:
                step = AgreedStep(step, agreement, policy)
        return engine.run(step, entry, initial, policy, agreement, self.observers)

    def perform(self, step: S, initial: int, context: Optional[Hashable] = None) -> S:
        """`drive`, returning the step (its result); a step with nothing to do (an empty range) never touches a cache."""
        if not step.finished:
            self.drive(step, initial, context)
        return step
