"""What every cached form shares: its Runner (cache type, context, policy, distributed, checked once), built with
the forms' default policy, and a call's initial size."""

from typing import Any, Hashable, Optional

from toma.core.arguments import check_context, check_size
from toma.core.caches import NoBatchsizeCache
from toma.core.call_sites import call_site_key
from toma.core.policy import DefaultPolicy
from toma.core.runner import CacheType, Runner
from toma.sizing.defaults import CALLS

__all__ = ["CacheType", "calls", "PLAIN", "initial_size", "optional_initial_size"]


def calls(
    cache_type: CacheType = None,
    context: Optional[Hashable] = None,
    policy: Any = None,
    distributed: Any = False,
    prefix: str = "",
    default: DefaultPolicy = CALLS,
    per_call_site: bool = False,
) -> Runner:
    """The Runner of a form's calls, its options checked once (`prefix`: `toma_` for the plain calls' names);
    `default`: the capability's policy (`toma.sizing.defaults`), the forms' unless the form accumulates;
    `per_call_site`: no context keys the cache by where toma was called from (the inline forms, `toma.map`)."""
    if context is not None:
        check_context(context, f"{prefix}context")
    elif per_call_site:
        context = call_site_key()
    return Runner(
        default, cache_type=cache_type, context=context, policy=policy, distributed=distributed, prefix=prefix
    )


PLAIN = Runner(CALLS, cache=NoBatchsizeCache())  # `simple.*`: no cache, the default policy


def initial_size(default: Optional[int], override: Any, name: str, override_name: str) -> int:
    """A call's initial size: its `toma_initial_*=` override, else the decorator's."""
    if override is not None:
        return check_size(override, override_name)
    if default is None:
        raise TypeError(f"{name} is required: give it to the decorator or pass {override_name}= to the call")
    return default


def optional_initial_size(default: Optional[int], override: Any, name: str, override_name: str) -> Optional[int]:
    """The same for a form with a start of its own where neither is given (None: `toma.accumulate` starts at the
    whole logical batch). `name` is unused: the signature is `initial_size`'s, so a decorator picks either once."""
    return check_size(override, override_name) if override is not None else default
