"""Observers: the jobs around the engine's retry loop that are not the loop (the log, the size file, the
free-memory gauge), each a small object the engine tells what happened, as tenacity keeps `before`, `after`
and `before_sleep` out of its loop. A new job is a new `Observer` subclass handed to the `Runner`."""

import logging
from typing import Any, Callable, Sequence, Tuple

from toma.core import call_sites
from toma.core.caches import Batchsize
from toma.core.policy import CallState
from toma.memory.free import GAUGE

__all__ = ["Observer", "Observers", "LogLines", "FreeMemoryRefresh", "DEFAULT_OBSERVERS"]

log = logging.getLogger("toma")


class Observer:
    """Base class: every hook does nothing, so an observer overrides the events it needs. None is called on
    the hot path except `starting`, which must stay cheap (no file access, no stack inspection)."""

    def wants_start(self, entry: Batchsize) -> bool:
        """Whether `starting` has work for a run from `entry`: asked first, without a state, so that a run nobody
        needs to hear about builds none."""
        return True

    def starting(self, state: CallState[Any]) -> None:
        """A run begins, before its first size is chosen: the entry's size may still be set (`state.recalled`)."""

    def predicted(self, state: CallState[Any], asked: int) -> None:
        """A learning policy starts the run at `state.size` instead of the entry's `asked`."""

    def changed(self, state: CallState[Any], change: str) -> None:
        """A learning policy changed the entry's size after an attempt fit (`change` says how, for a log line)."""

    def confirmed(self, state: CallState[Any]) -> None:
        """A learning policy kept the entry's size after an attempt whose measurement was news (`state.confirmed`)."""

    def retrying(self, state: CallState[Any]) -> None:
        """An attempt at `state.size` ran out of memory (here or, agreed, on another rank), its traceback gone;
        the entry is at `state.next_size`, the size of the retry, and `state.reason`/`state.detail` say why."""


class LogLines(Observer):
    """The INFO lines on the `toma` logger: a size a learning policy chose, and every retry."""

    def predicted(self, state: CallState[Any], asked: int) -> None:
        step = state.step
        level = logging.INFO if state.recalled else logging.DEBUG  # a remembered model under another budget
        if log.isEnabledFor(level):
            explained = state.learner.explain(state) if state.learner is not None else ""
            log.log(
                level,
                "%s starts at %s %d instead of %d (%s)",
                step.label(),
                step.size_name,
                state.size,
                asked,
                explained,
            )

    def changed(self, state: CallState[Any], change: str) -> None:
        log.info("%s: %s %s", state.label(), state.step.size_name, change)

    def retrying(self, state: CallState[Any]) -> None:
        log.info(
            "%s ran out of memory at %s %d; retrying with %d%s (called from %s): %s",
            state.label(),
            state.step.size_name,
            state.size,
            state.next_size,
            f" ({state.detail})" if state.detail else "",
            call_sites.describe_call_site(),
            state.reason,
        )


class FreeMemoryRefresh(Observer):
    """After an out-of-memory error the free-memory gauge reads anew: the caches' level is stale."""

    def retrying(self, state: CallState[Any]) -> None:
        GAUGE.invalidate()


Hook = Callable[..., None]


def _overrides(observer: Observer, event: str) -> bool:
    return getattr(type(observer), event) is not getattr(Observer, event)


def _overriding(observers: Sequence[Observer], event: str) -> Tuple[Hook, ...]:
    return tuple(getattr(o, event) for o in observers if _overrides(o, event))


class Observers:
    """The observers of a run as the hooks each event calls: only those an observer overrides, found once (when a
    Runner is built), so an event nobody listens to costs the hot path nothing."""

    __slots__ = ("observers", "starters", "predicted", "changed", "confirmed", "retrying")

    def __init__(self, observers: Sequence[Observer]) -> None:
        for observer in observers:
            if not isinstance(observer, Observer):
                raise TypeError(f"observers must be toma.core.observers.Observer instances, got {observer!r}")
        self.observers = tuple(observers)
        self.starters = tuple(o for o in observers if _overrides(o, "starting"))  # asked `wants_start` first
        self.predicted = _overriding(observers, "predicted")
        self.changed = _overriding(observers, "changed")
        self.confirmed = _overriding(observers, "confirmed")
        self.retrying = _overriding(observers, "retrying")


DEFAULT_OBSERVERS: Tuple[Observer, ...] = (LogLines(), FreeMemoryRefresh())
