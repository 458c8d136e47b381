"""The one retry loop every form drives: attempt, classify, shrink, release, retry.

A form hands the engine a *step*: a callable that does one unit of work at a given size and returns
True once all work is done (a batch call is one step; a range is one step per chunk). When a step
runs out of memory the engine shrinks the size with the policy, remembers it in the cache entry,
releases memory once the failed attempt is unreachable, and runs the same step again. Completed
steps are never repeated. A call that never runs out of memory pays for nothing but the loop itself.
"""

import logging
from itertools import islice
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, TypeVar, Union

import torch

from toma.core import call_sites
from toma.core.caches import Batchsize, BatchsizeCache
from toma.core.agreement import AgreedRetry, Agreement
from toma.memory.free import GAUGE
from toma.core.oom import release_memory, should_reduce_batch_size
from toma.core.policy import SizePolicy, shrink_below
from toma.core.size_file import SizeStore, active_store, describe_model, device_key

__all__ = ["Step", "run", "drive", "BatchStep", "RangeStep", "ChunkStep", "add_note", "step_device", "find_device"]

log = logging.getLogger("toma")


class Step(Protocol):
    """One unit of work at a given size; True when there is nothing left to do.

    `effective(size)` is how much work an attempt at `size` really does (the rows left in a range, the rows of
    a short batch): after an out-of-memory error the engine shrinks from it, not from `size`, so a chunk is
    never retried unchanged. `name` (None: the function's name) and `size_name` say what a log line names.
    `row_items` (1 when left out) is how many items a row holds, for a policy that sizes by items (the
    elements of a padded row in accumulation). `device` is where the work runs (a CUDA device, the CPU), so
    that a learning policy measures that device, the size file keys it, and ranks agree on it; None when
    not known (then the current CUDA device in a process that uses CUDA, else the CPU). Only a learning
    policy, a size file or an agreement reads it, once per call. `effective`, `name`, `row_items` and
    `device` may be left out.
    """

    func: Callable[..., Any]
    size_name: str
    name: Optional[str]

    @property
    def finished(self) -> bool: ...

    def effective(self, size: int) -> int: ...

    def __call__(self, size: int) -> bool: ...


def add_note(exception: BaseException, note: str) -> None:
    """`exception.add_note(note)`, also on Python 3.10."""
    if hasattr(exception, "add_note"):
        exception.add_note(note)
    else:  # Python 3.10: keep the note where 3.11's traceback printer would look.
        exception.__notes__ = [*getattr(exception, "__notes__", ()), note]  # type: ignore[attr-defined]


def step_device(step: Step) -> Optional[torch.device]:
    """Where `step`'s work runs (None: not known, or a step written before `device` existed)."""
    return getattr(step, "device", None)


_LOOKED_AT = 32  # arguments find_device looks at, at most: a long list of host tensors costs nothing


def find_device(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[torch.device]:
    """The device of the first tensor among a call's arguments (also in tuples, lists and dicts) that is not
    on the CPU; None when there is none: host tensors are often moved inside the function, so they say
    nothing about where the work runs."""
    if not kwargs:
        if not args:
            return None
        queue: List[Any] = list(args)
    else:
        queue = [*args, *kwargs.values()]
    index = 0
    while index < len(queue) and index < _LOOKED_AT:
        value = queue[index]
        index += 1
        if isinstance(value, torch.Tensor):
            if not (value.is_cpu or value.is_meta):  # cheaper than reading `.device.type`
                return value.device
        elif isinstance(value, (tuple, list)):
            queue.extend(value[:_LOOKED_AT])
        elif isinstance(value, dict):
            queue.extend(islice(value.values(), _LOOKED_AT))
    return None


def _name(step: Step) -> str:
    return getattr(step, "name", None) or getattr(step.func, "__qualname__", None) or repr(step.func)


def _effective(step: Step, size: int) -> int:
    """How much work the failed attempt at `size` did (steps written before `effective` existed: `size`)."""
    effective = getattr(step, "effective", None)
    return size if effective is None else int(effective(size))


def _recall(
    entry: Batchsize, step: Step, store: SizeStore, policy: SizePolicy, device: Optional[torch.device]
) -> None:
    """Give a cache entry used for the first time its key in the size file, the size stored there, and
    to a learning policy the model stored with it."""
    func = step.func
    function = f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"
    site = f"{function} called from {call_sites.describe_call_site().rsplit(' in ', 1)[0]}"
    entry.store_key = f"{site} | {device_key(device)}"
    remembered = store.recall(entry.store_key)
    if remembered is not None:
        size, model = remembered
        entry.set(size)
        restore = getattr(policy, "restore", None)
        if model is not None and getattr(policy, "learns", False) and callable(restore):
            restore(entry, model)
        log.info("%s starts at %s %d, remembered in %s", _name(step), step.size_name, size, store.path)


def _remember(entry: Batchsize, store: SizeStore, policy: SizePolicy) -> None:
    key, size = entry.store_key, entry.value
    if key and size:
        site, device = key.split(" | ", 1)
        store.put(key, site, device, size, describe_model(entry.learned))


def _checked(policy: SizePolicy, smaller: Optional[int], failed: int) -> Optional[int]:
    if smaller is not None and not 1 <= smaller < failed:
        raise ValueError(
            f"{policy!r}.after_oom returned {smaller!r} after {failed} ran out of memory: a policy must return a "
            "smaller size of at least 1, or None when there is none"
        )
    return smaller


class _Proposal:
    """A learning policy's next size after one attempt's out-of-memory error, worked out once: by the ranks'
    agreement (which proposes it to the others) or by the engine, whichever asks first."""

    __slots__ = ("policy", "entry", "token", "asked", "outcome", "detail")

    def __init__(self, policy: SizePolicy, entry: Batchsize, token: Any) -> None:
        self.policy, self.entry, self.token = policy, entry, token
        self.asked, self.detail = False, ""
        self.outcome: Union[int, None, ValueError] = None

    def __call__(self, size: int, failed: int, error: BaseException) -> Optional[int]:
        if not self.asked:
            self.asked = True
            policy = self.policy
            try:
                self.outcome = _checked(policy, policy.after_oom(self.entry, self.token, size, failed, error), failed)  # type: ignore[attr-defined]
            except ValueError as broken:
                self.outcome = broken
            self.detail = policy.explain(self.entry)  # type: ignore[attr-defined]
        if isinstance(self.outcome, ValueError):
            raise self.outcome
        return self.outcome


def _first_line(exception: BaseException) -> str:
    text = str(exception).strip()
    return f"{type(exception).__name__}: {text.splitlines()[0] if text else ''}"


def run(
    step: Step, entry: Batchsize, initial_size: int, policy: SizePolicy, agreement: Optional[Agreement] = None
) -> None:
    """Run `step` to completion, shrinking its size on out-of-memory errors.

    Errors that are not out-of-memory pass through untouched; KeyboardInterrupt is never caught. An
    out-of-memory error at the smallest size the policy allows is re-raised with a note saying so. With an
    `agreement` the ranks of a process group start at the same size, and a step that raises AgreedRetry
    (see `toma.core.agreement`) is retried at the size they agreed on.
    """
    store = active_store()
    recalled = store is not None and entry.store_key is None
    learns = getattr(policy, "learns", False)
    scale = float(getattr(step, "row_items", 1.0)) if learns else 1.0
    # a settled call site between measurements: nothing to start, measure or locate
    quick = learns and not recalled and agreement is None and policy.quick(entry, scale)  # type: ignore[attr-defined]
    device = step_device(step) if (learns and not quick) or recalled or agreement is not None else None
    if recalled:
        _recall(entry, step, store, policy, device)  # type: ignore[arg-type]
    size = entry.start(initial_size)
    if learns and not quick:
        predicted = policy.start(entry, size, initial_size, scale, device)  # type: ignore[attr-defined]
        if predicted != size:  # a remembered model under another budget (INFO), rows of another width
            log.log(
                logging.INFO if recalled else logging.DEBUG,
                "%s starts at %s %d instead of %d (%s)",
                _name(step),
                step.size_name,
                predicted,
                size,
                policy.explain(entry),  # type: ignore[attr-defined]
            )
            size = predicted
    if agreement is not None:
        agreement.work_on(device)
        size = agreement.start(size)
        entry.shrink_to(size)
    detail = ""
    while True:
        token = policy.begin(entry, size, scale, device) if learns and not quick else None  # type: ignore[attr-defined]
        proposal = None
        if agreement is not None:  # each rank proposes its policy's next size; the smallest is agreed
            proposal = agreement.propose = _Proposal(policy, entry, token) if learns else None
        fitted = entry.fitted
        # The first chunk of this attempt, worth reading only when it may be news to the entry.
        ran = _effective(step, size) if token is not None or fitted is None or size > fitted else 0
        try:
            while not step(size):
                pass
            if ran:
                entry.record_fit(ran)
            if learns:
                change = policy.succeeded(entry, token, ran)  # type: ignore[attr-defined]
                if change:
                    log.info("%s: %s %s", _name(step), step.size_name, change)
                    if store is not None:
                        _remember(entry, store, policy)
            return
        except AgreedRetry as retry:
            next_size, own_failure = retry.size, None
            # No local name may keep the cause (this rank's OOM, its frames and tensors) past the block.
            reason = retry.reason + (f": {_first_line(retry.__cause__)}" if retry.__cause__ is not None else "")
            if proposal is not None and proposal.asked:  # this rank's own proposal: say why it chose it
                detail = proposal.detail
            elif learns and token is not None and ran:  # this rank's attempt fit: evidence all the same
                observed = getattr(policy, "observed", None)
                if callable(observed):
                    observed(entry, token, ran)
        except Exception as exception:
            if not should_reduce_batch_size(exception):
                raise
            failed = _effective(step, size)
            try:
                if learns:
                    proposal = proposal or _Proposal(policy, entry, token)
                    smaller = proposal(size, failed, exception)
                    detail = proposal.detail
                else:
                    smaller = shrink_below(policy, size, failed)
            except ValueError:
                raise  # the OOM stays its context, not its cause: no outer layer takes this for an OOM
            if smaller is None:
                add_note(
                    exception,
                    f"toma: {_name(step)} ran out of memory at the smallest {step.size_name} ({failed}); "
                    f"there is nothing left to reduce. Called from {call_sites.describe_call_site()}.",
                )
                raise
            size = own_failure = failed
            reason = _first_line(exception)
            next_size = smaller
        # Only here, with the except block left, is the failed attempt's traceback (and so its frames
        # and tensors) unreachable; collecting inside the block would free nothing.
        entry.shrink_to(next_size)
        if own_failure is not None:
            entry.record_failure(own_failure)
        if store is not None:
            _remember(entry, store, policy)
        log.info(
            "%s ran out of memory at %s %d; retrying with %d%s (called from %s): %s",
            _name(step),
            step.size_name,
            size,
            next_size,
            f" ({detail})" if detail else "",
            call_sites.describe_call_site(),
            reason,
        )
        detail = ""
        if quick:  # the retry is measured, where its work runs
            quick, device = False, step_device(step)
        release_memory()
        GAUGE.invalidate()
        size = next_size


S = TypeVar("S", bound=Step)


def drive(
    step: S, cache: BatchsizeCache, initial_size: int, policy: SizePolicy, agreement: Optional[Agreement] = None
) -> S:
    """Run `step` with the cache's entry; returns the step. An empty range never touches the cache."""
    if not step.finished:
        run(step, cache.get_batchsize(initial_size), initial_size, policy, agreement)
    return step


class BatchStep:
    """`func(batchsize, *args, **kwargs)` once; keeps the result."""

    size_name = "batch size"
    finished = False  # a batch call always has its one attempt to make
    __slots__ = ("func", "args", "kwargs", "result", "name")

    def __init__(
        self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any], name: Optional[str] = None
    ) -> None:
        self.func, self.args, self.kwargs, self.name = func, args, kwargs, name
        self.result: Any = None

    @property
    def device(self) -> Optional[torch.device]:
        """The device of the first tensor argument not on the CPU (None: none)."""
        return find_device(self.args, self.kwargs)

    def effective(self, size: int) -> int:
        return size

    def __call__(self, size: int) -> bool:
        self.result = self.func(size, *self.args, **self.kwargs)
        return True

    def mark(self) -> None:
        return None

    def rewind(self, mark: None) -> None:
        pass  # a retry overwrites the result


class RangeStep:
    """`func(start, stop, *args, **kwargs)` for consecutive chunks of `[start, end)`; resumes after an OOM.
    `device`: where the work runs, when the caller knows (else the tensor arguments say)."""

    size_name = "step"
    __slots__ = ("func", "args", "kwargs", "current", "end", "name", "_device")

    def __init__(
        self,
        func: Callable[..., Any],
        start: int,
        end: int,
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
        name: Optional[str] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        self.func, self.args, self.kwargs, self.name = func, args, kwargs, name
        self.current, self.end = start, end
        self._device = device

    @property
    def finished(self) -> bool:
        return self.current >= self.end

    @property
    def device(self) -> Optional[torch.device]:
        """The device given, else that of the first tensor argument not on the CPU (None: none)."""
        return self._device if self._device is not None else find_device(self.args, self.kwargs)

    def effective(self, size: int) -> int:
        """The length of the chunk an attempt at `size` covers: less than `size` near the end."""
        return min(size, self.end - self.current)

    def call(self, start: int, stop: int) -> None:
        self.func(start, stop, *self.args, **self.kwargs)

    def mark(self) -> int:
        return self.current

    def rewind(self, mark: int) -> None:
        """Go back to `mark`, so that an agreed retry redoes the chunk done since."""
        self.current = mark

    def __call__(self, size: int) -> bool:
        start = self.current
        stop = min(start + size, self.end)
        self.call(start, stop)
        self.current = stop
        return stop >= self.end


class ChunkStep(RangeStep):
    """`func(tensor.narrow(dimension, start, length), start, stop, *args, **kwargs)` chunk by chunk."""

    __slots__ = ("tensor", "dimension")

    def __init__(
        self,
        func: Callable[..., Any],
        tensor: Any,
        dimension: int,
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
    ) -> None:
        super().__init__(func, 0, tensor.shape[dimension], args, kwargs)
        self.tensor, self.dimension = tensor, dimension

    @property
    def device(self) -> Optional[torch.device]:
        """The chunked tensor's device, or another tensor argument's, when not on the CPU (None: none)."""
        return find_device((self.tensor, *self.args), self.kwargs)

    def call(self, start: int, stop: int) -> None:
        self.func(self.tensor.narrow(self.dimension, start, stop - start), start, stop, *self.args, **self.kwargs)
