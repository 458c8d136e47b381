"""The one retry loop: attempt, classify, shrink, release, retry.

A form hands the engine a *step* (`toma.core.steps`): one unit of work at a given size, True once all work
is done (a batch call is one step; a range is one step per chunk). When a step runs out of memory the engine
asks the policy for a smaller size, shrinks the cache entry to it, tells the observers (the log, the size
file, the free-memory gauge), releases memory once the failed attempt is unreachable, and runs the same step
again. Completed steps are never repeated. What the run knows is one `CallState`, built only when a run needs
one (a learning policy, ranks that agree, an observer at the start, an out-of-memory error): a plain call that
fits builds none. Forms, trainers and integrations do not call this module: they enter through
`toma.core.runner.Runner`.

Errors other than out-of-memory pass through untouched; KeyboardInterrupt is never caught. An out-of-memory
error at the smallest size the policy allows is re-raised with a note saying so. With an `agreement` the ranks
of a process group start at the same size, and a step raising AgreedRetry is retried at the agreed size.
"""

from typing import Optional, Tuple, TypeVar

from toma.core import call_sites
from toma.core.agreement import AgreedRetry, Agreement
from toma.core.caches import Batchsize
from toma.core.observers import DEFAULT_OBSERVERS, Observers
from toma.core.oom import add_note, release_memory, return_cached_blocks, should_reduce_batch_size
from toma.core.policy import CallState, LearningPolicy, SizePolicy
from toma.core.size_file_observer import SizeFileObserver
from toma.core.steps import BatchStep, ChunkStep, RangeStep, Step, find_device

__all__ = ["Step", "run", "BatchStep", "RangeStep", "ChunkStep", "add_note", "find_device", "OBSERVERS"]

S = TypeVar("S", bound=Step)

OBSERVERS = Observers((SizeFileObserver(), *DEFAULT_OBSERVERS))  # every run's unless a Runner has its own


def _first_line(exception: BaseException) -> str:
    text = str(exception).strip()
    return f"{type(exception).__name__}: {text.splitlines()[0] if text else ''}"


def _start(state: CallState[S], agreement: Optional[Agreement], observers: Observers) -> None:
    """Choose the first attempt's size for a learning policy or ranks that agree: what the policy predicts for
    the entry's (or the size file's) size, and the smallest any rank starts with."""
    step, entry, learner = state.step, state.entry, state.learner
    if learner is not None:
        state.scale = float(step.row_items)
    if state.device is None:
        state.device = step.device
    size = state.size = entry.start(state.initial)
    if learner is not None:
        state.size = learner.start(state)
        if state.size != size:
            for predicted in observers.predicted:
                predicted(state, size)
    if agreement is not None:  # the ranks start at the same size; each proposes its own next size
        agreement.work_on(state.device)
        agreement.propose = state.propose
        state.size = agreement.start(state.size)
        entry.shrink_to(state.size)


def _learned(state: CallState[S], learner: LearningPolicy, observers: Observers) -> None:
    """What a learning policy makes of an attempt that finished."""
    change = learner.succeeded(state)
    if change:
        for changed in observers.changed:
            changed(state, change)
    elif state.confirmed:
        for confirmed in observers.confirmed:
            confirmed(state)


def _because(reason: str) -> str:
    return f": {reason}" if reason else ""


def _own_failure(state: CallState[S], exception: BaseException) -> bool:
    """This rank's attempt ran out of memory: False at the smallest size, else the retry's size is in `state`. A
    broken policy's ValueError propagates with the OOM as its context, not its cause: no outer layer takes it
    for an OOM."""
    failed = state.step.effective(state.size)
    smaller = state.propose(state.size, failed, exception)
    if smaller is None:
        lever = state.step.lighten()
        if lever:  # the same size again, needing less memory: no failure of the size to remember
            state.failures += 1
            state.next_size, state.failed = state.size, None
            state.reason = f"{_first_line(exception)}; the same {state.step.size_name} again with {lever}"
            return True
        add_note(
            exception,
            f"toma: {state.label()} ran out of memory at the smallest {state.step.size_name} ({failed}); "
            f"there is nothing left to reduce{_because(state.step.smallest_reason())}. Called from "
            f"{call_sites.describe_call_site()}.",
        )
        return False
    state.size = state.failed = failed
    state.failures += 1
    state.next_size, state.reason = smaller, _first_line(exception)
    return True


def _agreed(state: CallState[S], retry: AgreedRetry) -> None:
    """The ranks agreed to retry smaller; an attempt that fit here is evidence all the same. Keeps strings only:
    nothing in `state` may hold the cause (this rank's OOM, its frames and tensors) past the except block."""
    state.next_size = retry.size
    state.failed = None  # an agreed retry records no failure at the entry, this rank's own OOM included
    cause = retry.__cause__
    state.reason = retry.reason + (f": {_first_line(cause)}" if cause is not None else "")
    if retry.restart:  # a way to need less memory that makes what was learned without it moot: sizing anew
        _forget_sizes(state.entry)
        state.entry.set(retry.size)
        return
    if state.proposed:  # this rank's own proposal: `state.detail` says why it chose it
        return
    learner = state.learner
    if learner is not None and state.token is not None and state.ran:
        learner.observed(state)


def _levers_changed(state: CallState[S], levers: Tuple[str, ...]) -> None:
    """A memory lever turned on: the entry remembers it with its size, and what was learned without it (the
    sizes that fit, failed, a policy's memory model) no longer holds, so sizing starts again under it."""
    state.entry.levers = levers
    _forget_sizes(state.entry)


def _forget_sizes(entry: Batchsize) -> None:
    """What the entry learned of the sizes that fit and failed, and a policy's memory model of them."""
    entry.fitted = entry.failed = entry.learned = None


def _retry(state: CallState[S], observers: Observers) -> None:
    """After a failed attempt, its traceback gone: the entry's new size and failure, the observers, and the
    memory the attempt left; the next attempt runs at `state.next_size`."""
    next_size = state.next_size
    assert next_size is not None
    levers = state.step.levers
    if levers != state.entry.levers:
        _levers_changed(state, levers)
    state.entry.shrink_to(next_size)
    if state.failed is not None:
        state.entry.record_failure(state.failed)
    for retrying in observers.retrying:
        retrying(state)
    release_memory()
    state.size = next_size
    if state.quick:  # the retry is measured, where its work runs
        state.quick, state.device = False, state.step.device


def _first_failure(
    state: Optional[CallState[S]], step: S, entry: Batchsize, policy: SizePolicy, initial_size: int, size: int, ran: int
) -> CallState[S]:
    """The state of a quick attempt that ran out of memory (built now where the run had none): its size, what it
    ran, one attempt."""
    if state is None:
        state = CallState(step, entry, policy, initial_size)
    state.size, state.attempts, state.ran = size, 1, ran
    return state


def run(
    step: S,
    entry: Batchsize,
    initial_size: int,
    policy: SizePolicy,
    agreement: Optional[Agreement] = None,
    observers: Observers = OBSERVERS,
) -> Optional[CallState[S]]:
    """Run `step` to completion from `entry`, shrinking its size on out-of-memory errors (see the module's docstring);
    the run's state, or None for a run that fit at once with nothing to learn, agree on or tell (no state built)."""
    state: Optional[CallState[S]] = None
    for observer in observers.starters:  # inline, not a helper: the hot path pays no call for it
        if observer.wants_start(entry):
            if state is None:
                state = CallState(step, entry, policy, initial_size)
            observer.starting(state)
    if entry.levers:  # the size was learned with memory levers on: they are on from the start
        step.use_levers(entry.levers)
    if not isinstance(policy, LearningPolicy):
        quick = agreement is None
    elif agreement is None:
        state = state if state is not None else CallState(step, entry, policy, initial_size)
        state.scale = float(step.row_items)
        # a settled call site between measurements: nothing to start, measure, learn or locate
        quick = state.quick = not state.recalled and policy.quick(state)
    else:
        quick = False
    if not quick:
        state = state if state is not None else CallState(step, entry, policy, initial_size)
        _start(state, agreement, observers)
        return _attempts(state, agreement, observers)
    # One attempt at the entry's size, unmeasured, with no state unless it runs out of memory.
    size = entry.start(initial_size)
    fitted = entry.fitted
    ran = step.effective(size) if fitted is None or size > fitted else 0
    try:
        while not step(size):
            pass
    except Exception as exception:
        if not should_reduce_batch_size(exception):
            raise
        state = _first_failure(state, step, entry, policy, initial_size, size, ran)
        if not _own_failure(state, exception):
            raise
    else:
        if ran:
            entry.record_fit(ran)
        return state
    _retry(state, observers)
    return _attempts(state, agreement, observers)


def _attempts(state: CallState[S], agreement: Optional[Agreement], observers: Observers) -> CallState[S]:
    """Attempts from `state.size` until one completes the step."""
    step, entry, learner = state.step, state.entry, state.learner
    while True:
        state.attempts += 1
        if state.proposed:  # the previous attempt's proposal is spent
            state.new_attempt()
        size = state.size
        if learner is not None and not state.quick:
            state.token = learner.begin(state)
        fitted = entry.fitted  # the attempt's first chunk is worth reading only when it may be news to the entry
        news = state.token is not None or fitted is None or size > fitted
        if fitted is not None and size > fitted:
            # Above the largest size that fit: the blocks the allocator cached for smaller sizes would be split
            # for this one's tensors and the rest could not be had (an H200 refused 0.95 of the size that fit
            # from an empty cache, after calls at 0.75). Returned first, the attempt gets the whole budget.
            return_cached_blocks()
        ran = state.ran = step.effective(size) if news else 0
        try:
            while not step(size):
                pass
        except AgreedRetry as retry:
            _agreed(state, retry)
        except Exception as exception:
            if not should_reduce_batch_size(exception) or not _own_failure(state, exception):
                raise
        else:
            if ran:
                entry.record_fit(ran)
            if learner is not None:
                _learned(state, learner, observers)
            return state
        # Only here, with the except block left, is the failed attempt's traceback (and so its frames
        # and tensors) unreachable; collecting inside the block would free nothing.
        _retry(state, observers)
