"""The size file as an observer of the engine: a cache entry used for the first time in this process starts
from the size (and a learning policy's model) stored for its call site, and every size that changes is
written at once. The hot path reads one attribute of the entry and one module global."""

import logging
from typing import Any

from toma.core import call_sites
from toma.core.caches import Batchsize
from toma.core.observers import Observer
from toma.core.policy import CallState
from toma.core.size_file import active_store, describe_model, device_key
from toma.core.steps import TOKEN_BUDGET

__all__ = ["SizeFileObserver"]

log = logging.getLogger("toma")


def _site(state: CallState[Any]) -> str:
    """The call site's key: the function, where it is called from, a token budget's unit (not rows') and how the
    work is spread over the ranks (FSDP2's shards)."""
    step = state.step
    func = step.func
    function = f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"
    unit = f" [{TOKEN_BUDGET}]" if step.size_name == TOKEN_BUDGET else ""
    layout = f" [{step.layout}]" if step.layout else ""
    return f"{function} called from {call_sites.describe_call_site().rsplit(' in ', 1)[0]}{unit}{layout}"


class SizeFileObserver(Observer):
    """Recalls an entry's size when a run first uses it, and remembers every change (`toma.remember_sizes`)."""

    def wants_start(self, entry: Batchsize) -> bool:
        return entry.store_key is None and active_store() is not None

    def starting(self, state: CallState[Any]) -> None:
        entry = state.entry
        store = active_store()
        if entry.store_key is not None or store is None:
            return
        state.recalled = True
        state.device = state.step.device
        entry.store_key = f"{_site(state)} | {device_key(state.device)}"
        remembered = store.recall(entry.store_key)
        if remembered is None:
            return
        size, model, levers = remembered
        entry.set(size)
        entry.levers = levers
        if model is not None and state.learner is not None:
            state.learner.restore(entry, model)
        log.info(
            "%s starts at %s %d%s, remembered in %s",
            state.label(),
            state.step.size_name,
            size,
            f" with {', '.join(levers)}" if levers else "",
            store.path,
        )

    def changed(self, state: CallState[Any], change: str) -> None:
        self._remember(state)

    def confirmed(self, state: CallState[Any]) -> None:
        """The size stayed, measured for the first time: the file keeps that evidence (a restart under a little
        more memory then knows this size fit, not only the sizes that led to it)."""
        self._remember(state)

    def retrying(self, state: CallState[Any]) -> None:
        self._remember(state)

    @staticmethod
    def _remember(state: CallState[Any]) -> None:
        store = active_store()
        entry = state.entry
        key, size = entry.store_key, entry.value
        if store is not None and key and size:
            site, device = key.split(" | ", 1)
            store.put(key, site, device, size, describe_model(entry.learned), entry.levers)
