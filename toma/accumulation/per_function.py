"""What toma learns about a loss function, kept per the function's code and the settings that decide it: whether
its loss is what its parts add up to (`SplitCheck`) and what one more micro-batch costs (`MicroBatchCost`). The
forms that wrap a function anew at every call (`explicit.accumulate`, an inline `toma.accumulate(model=m)(f)(...)`)
would otherwise check the loss and time the micro-batches again at every call; a decorated function's stats hold
the same objects."""

import dataclasses
import weakref
from types import CodeType
from typing import Any, Callable, Dict, Optional, Tuple

from toma.accumulation.coupling import SplitCheck
from toma.batching.micro_batch_cost import MicroBatchCost
from toma.core.arguments import innermost_function

__all__ = ["Learned", "learned_about"]


@dataclasses.dataclass
class Learned:
    """A loss function's split check and micro-batch cost, under one set of settings."""

    split_check: SplitCheck = dataclasses.field(default_factory=SplitCheck)
    packing: MicroBatchCost = dataclasses.field(default_factory=MicroBatchCost)


# per function code (freed with it), per settings
_learned: "weakref.WeakKeyDictionary[CodeType, Dict[Tuple[Any, ...], Learned]]" = weakref.WeakKeyDictionary()


def _code_of(func: Any) -> Optional[CodeType]:
    """The code that computes `func`'s result (a function's, a bound method's, a partial's function's); None for a
    callable object, learned about per wrapper."""
    code = getattr(innermost_function(func), "__code__", None)
    return code if isinstance(code, CodeType) else None


def _setting_key(setting: Any) -> Any:
    """A setting as a key: a plain value as it is, a function by its code (a lambda made anew at each call is the
    same weight), another object by its identity."""
    if setting is None or isinstance(setting, (str, bool, int, float)):
        return setting
    code = _code_of(setting)
    return code if code is not None else (type(setting), id(setting))


def learned_about(func: Callable[..., Any], *settings: Any) -> Learned:
    """What is kept for `func`'s code under `settings` (the reduction, `weight=`, `lengths=`: what its parts must
    add up to, and how it packs); new for a callable without code."""
    code = _code_of(func)
    if code is None:
        return Learned()
    key = tuple(_setting_key(setting) for setting in settings)
    by_settings = _learned.get(code)
    if by_settings is None:
        by_settings = _learned[code] = {}
    learned = by_settings.get(key)
    if learned is None:
        learned = by_settings[key] = Learned()
    return learned
