"""The one retry loop every form drives: attempt, classify, shrink, release, retry.

A form hands the engine a *step* (`toma.core.steps`): one unit of work at a given size, True once all work
is done (a batch call is one step; a range is one step per chunk). When a step
runs out of memory the engine shrinks the size with the policy, remembers it in the cache entry,
releases memory once the failed attempt is unreachable, and runs the same step again. Completed
steps are never repeated. A call that never runs out of memory pays for nothing but the loop itself.
"""

import logging
from typing import Optional, Tuple, TypeVar, Union

import torch

from toma.core import call_sites
from toma.core.agreement import AgreedRetry, Agreement
from toma.core.caches import Batchsize, BatchsizeCache
from toma.core.oom import release_memory, should_reduce_batch_size
from toma.core.policy import LearningPolicy, SizePolicy, Token, shrink_below
from toma.core.size_file import SizeStore, active_store, describe_model, device_key
from toma.core.steps import BatchStep, ChunkStep, RangeStep, Step, find_device
from toma.memory.free import GAUGE

__all__ = ["Step", "run", "drive", "BatchStep", "RangeStep", "ChunkStep", "add_note", "find_device"]

log = logging.getLogger("toma")


def add_note(exception: BaseException, note: str) -> None:
    """`exception.add_note(note)`, also on Python 3.10."""
    if hasattr(exception, "add_note"):
        exception.add_note(note)
    else:  # Python 3.10: keep the note where 3.11's traceback printer would look.
        setattr(exception, "__notes__", [*getattr(exception, "__notes__", ()), note])


def _recall(
    entry: Batchsize, step: Step, store: SizeStore, learner: Optional[LearningPolicy], device: Optional[torch.device]
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
        if model is not None and learner is not None:
            learner.restore(entry, model)
        log.info("%s starts at %s %d, remembered in %s", step.label(), step.size_name, size, store.path)


def _remember(entry: Batchsize, store: SizeStore) -> None:
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

    def __init__(self, policy: LearningPolicy, entry: Batchsize, token: Optional[Token]) -> None:
        self.policy, self.entry, self.token = policy, entry, token
        self.asked, self.detail = False, ""
        self.outcome: Union[int, None, ValueError] = None

    def __call__(self, size: int, failed: int, error: BaseException) -> Optional[int]:
        if not self.asked:
            self.asked = True
            policy = self.policy
            try:
                self.outcome = _checked(policy, policy.after_oom(self.entry, self.token, size, failed, error), failed)
            except ValueError as broken:
                self.outcome = broken
            self.detail = policy.explain(self.entry)
        if isinstance(self.outcome, ValueError):
            raise self.outcome
        return self.outcome


def _first_line(exception: BaseException) -> str:
    text = str(exception).strip()
    return f"{type(exception).__name__}: {text.splitlines()[0] if text else ''}"


def _starting_size(
    step: Step,
    entry: Batchsize,
    size: int,
    initial_size: int,
    learner: LearningPolicy,
    scale: float,
    device: Optional[torch.device],
    recalled: bool,
) -> int:
    """The size a learning policy begins with instead of the entry's `size` (what it predicts for it)."""
    predicted = learner.start(entry, size, initial_size, scale, device)
    if predicted != size:  # a remembered model under another budget (INFO), rows of another width
        log.log(
            logging.INFO if recalled else logging.DEBUG,
            "%s starts at %s %d instead of %d (%s)",
            step.label(),
            step.size_name,
            predicted,
            size,
            learner.explain(entry),
        )
    return predicted


def _succeeded(
    step: Step,
    entry: Batchsize,
    learner: Optional[LearningPolicy],
    token: Optional[Token],
    ran: int,
    store: Optional[SizeStore],
) -> None:
    """Note an attempt that finished: the entry's largest fit, and what a learning policy makes of it."""
    if ran:
        entry.record_fit(ran)
    if learner is not None:
        change = learner.succeeded(entry, token, ran)
        if change:
            log.info("%s: %s %s", step.label(), step.size_name, change)
            if store is not None:
                _remember(entry, store)


def _shrunk(
    policy: SizePolicy,
    learner: Optional[LearningPolicy],
    proposal: Optional[_Proposal],
    entry: Batchsize,
    token: Optional[Token],
    size: int,
    failed: int,
    error: BaseException,
) -> Tuple[Optional[int], str]:
    """The size after an out-of-memory error at `size` (`failed` rows), and why (for the log line). A broken
    policy's ValueError propagates with the OOM as its context, not its cause: no outer layer takes it for an OOM."""
    if learner is None:
        return shrink_below(policy, size, failed), ""
    proposal = proposal or _Proposal(learner, entry, token)
    smaller = proposal(size, failed, error)
    return smaller, proposal.detail


def _note_smallest(exception: BaseException, step: Step, failed: int) -> None:
    """Say on an out-of-memory error that the engine re-raises why: the size was already the smallest."""
    add_note(
        exception,
        f"toma: {step.label()} ran out of memory at the smallest {step.size_name} ({failed}); "
        f"there is nothing left to reduce. Called from {call_sites.describe_call_site()}.",
    )


def _agreed_start(agreement: Agreement, entry: Batchsize, size: int, device: Optional[torch.device]) -> int:
    """The size the ranks agree to start at from this rank's `size`, on `device`; the entry shrinks to it."""
    agreement.work_on(device)
    size = agreement.start(size)
    entry.shrink_to(size)
    return size


def _retrying(
    step: Step,
    entry: Batchsize,
    store: Optional[SizeStore],
    size: int,
    next_size: int,
    own_failure: Optional[int],
    reason: str,
    detail: str,
) -> int:
    """After a failed attempt, its traceback gone: the entry's new size, the size file, the log line, and the
    memory the attempt left; returns the size to retry at (`next_size`)."""
    entry.shrink_to(next_size)
    if own_failure is not None:
        entry.record_failure(own_failure)
    if store is not None:
        _remember(entry, store)
    log.info(
        "%s ran out of memory at %s %d; retrying with %d%s (called from %s): %s",
        step.label(),
        step.size_name,
        size,
        next_size,
        f" ({detail})" if detail else "",
        call_sites.describe_call_site(),
        reason,
    )
    release_memory()
    GAUGE.invalidate()
    return next_size


def _agreed(
    retry: AgreedRetry,
    proposal: Optional[_Proposal],
    learner: Optional[LearningPolicy],
    entry: Batchsize,
    token: Optional[Token],
    ran: int,
) -> Tuple[str, str]:
    """An agreed retry's reason and detail for the log line; an attempt that fit here is evidence all the same.
    Returns strings only: no name may keep the cause (this rank's OOM, its frames and tensors) past the block."""
    reason = retry.reason + (f": {_first_line(retry.__cause__)}" if retry.__cause__ is not None else "")
    if proposal is not None and proposal.asked:  # this rank's own proposal: say why it chose it
        return reason, proposal.detail
    if learner is not None and token is not None and ran:
        learner.observed(entry, token, ran)
    return reason, ""


def run(
    step: Step, entry: Batchsize, initial_size: int, policy: SizePolicy, agreement: Optional[Agreement] = None
) -> None:
    """Run `step` to completion, shrinking its size on out-of-memory errors.

    Errors other than out-of-memory pass through untouched; KeyboardInterrupt is never caught. An out-of-memory
    error at the smallest size the policy allows is re-raised with a note saying so. With an `agreement` the
    ranks of a process group start at the same size, and a step raising AgreedRetry is retried at the agreed size.
    """
    learner = policy if isinstance(policy, LearningPolicy) else None
    store = active_store()
    recalled = store is not None and entry.store_key is None
    scale = float(step.row_items) if learner is not None else 1.0
    # a settled call site between measurements: nothing to start, measure or locate
    quick = learner is not None and not recalled and agreement is None and learner.quick(entry, scale)
    device = step.device if (learner is not None and not quick) or recalled or agreement is not None else None
    if store is not None and recalled:
        _recall(entry, step, store, learner, device)
    size = entry.start(initial_size)
    if learner is not None and not quick:
        size = _starting_size(step, entry, size, initial_size, learner, scale, device, recalled)
    if agreement is not None:  # the ranks start at the same size
        size = _agreed_start(agreement, entry, size, device)
    while True:
        token = learner.begin(entry, size, scale, device) if learner is not None and not quick else None
        proposal = None
        if agreement is not None:  # each rank proposes its policy's next size; the smallest is agreed
            proposal = agreement.propose = _Proposal(learner, entry, token) if learner is not None else None
        fitted = entry.fitted  # the attempt's first chunk is worth reading only when it may be news to the entry
        ran = step.effective(size) if token is not None or fitted is None or size > fitted else 0
        try:
            while not step(size):
                pass
        except AgreedRetry as retry:
            next_size, own_failure = retry.size, None
            reason, detail = _agreed(retry, proposal, learner, entry, token, ran)
        except Exception as exception:
            if not should_reduce_batch_size(exception):
                raise
            failed = step.effective(size)
            smaller, detail = _shrunk(policy, learner, proposal, entry, token, size, failed, exception)
            if smaller is None:
                _note_smallest(exception, step, failed)
                raise
            size = own_failure = failed
            reason = _first_line(exception)
            next_size = smaller
        else:
            _succeeded(step, entry, learner, token, ran, store)
            return
        # Only here, with the except block left, is the failed attempt's traceback (and so its frames
        # and tensors) unreachable; collecting inside the block would free nothing.
        size = _retrying(step, entry, store, size, next_size, own_failure, reason, detail)
        if quick:  # the retry is measured, where its work runs
            quick, device = False, step.device


S = TypeVar("S", bound=Step)


def drive(
    step: S, cache: BatchsizeCache, initial_size: int, policy: SizePolicy, agreement: Optional[Agreement] = None
) -> S:
    """Run `step` with the cache's entry; returns the step. An empty range never touches the cache."""
    if not step.finished:
        run(step, cache.get_batchsize(initial_size), initial_size, policy, agreement)
    return step
