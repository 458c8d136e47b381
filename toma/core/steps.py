"""Steps: one unit of a form's work at a given size, which the engine runs and retries.

A form hands the engine a step: a callable that does one unit of work at a given size and returns True once
all work is done (a batch call is one step; a range is one step per chunk). `Step` is the base class with
every member the engine, a learning policy, the size file and the ranks' agreement read; a new form's step
is a subclass that overrides what it knows.
"""

from abc import ABC, abstractmethod
from itertools import islice
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["Step", "BatchStep", "RangeStep", "ChunkStep", "find_device", "TOKEN_BUDGET"]


TOKEN_BUDGET = "token budget"  # the size name of a step whose size counts tokens (rows sorted and packed by length)


class Step(ABC):
    """One unit of work at a given size; `step(size)` is True when there is nothing left to do (the one abstract
    member; the others have the defaults of a step that knows nothing more).

    `effective(size)` is how much work an attempt at `size` really does (the rows left in a range, the rows of
    a short batch): after an out-of-memory error the engine shrinks from it, not from `size`, so a chunk is
    never retried unchanged. `name` (None: the function's name) and `size_name` say what a log line names.
    `row_items` is how many items a row holds, for a policy that sizes by items (the elements of a padded row
    in accumulation). `device` is where the work runs (a CUDA device, the CPU), so that a learning policy
    measures that device, the size file keys it, and ranks agree on it; None when not known (then the current
    CUDA device in a process that uses CUDA, else the CPU). `mark()` and `rewind(mark)` let the ranks'
    agreement redo an attempt that finished here while another rank's ran out of memory. `layout` says how the
    work is spread over ranks where that changes which sizes fit (FSDP2's shards), for the size file's key.
    """

    __slots__ = ()
    func: Callable[..., Any]
    size_name: str = "batch size"
    name: Optional[str] = None
    layout: str = ""

    @property
    def finished(self) -> bool:
        return False

    @property
    def device(self) -> Optional[torch.device]:
        return None

    @property
    def row_items(self) -> float:
        return 1.0

    def effective(self, size: int) -> int:
        return size

    def at_smallest(self, size: int) -> bool:
        """True when no smaller size would change what an attempt at `size` does (an out-of-memory error there
        is final, whatever the policy could still propose)."""
        return False

    def smallest_reason(self) -> str:
        """Why the size at which the work failed cannot shrink, in a clause for the note an out-of-memory error
        gets there ("" where the size says it all)."""
        return ""

    def lighten(self) -> str:
        """After an out-of-memory error at the smallest size: turn on a way to need less memory at the same size
        (a memory lever); its name, or "" where the step has none left (then the error is final)."""
        return ""

    @property
    def levers(self) -> Tuple[str, ...]:
        """The memory levers on for this step (see `lighten`), which the cache entry remembers with its size."""
        return ()

    def use_levers(self, names: Tuple[str, ...]) -> None:
        """Turn on, from the start, the levers the cache entry's size was learned with (those the step has)."""

    def mark(self) -> Any:
        return None

    def rewind(self, mark: Any) -> None:
        """Undo what the attempts since `mark` did (nothing, for a step whose retry overwrites its result)."""

    def label(self) -> str:
        """What a log line calls the step's function."""
        return self.name or getattr(self.func, "__qualname__", None) or repr(self.func)

    @abstractmethod
    def __call__(self, size: int) -> bool:
        """One attempt at `size`: True once all work is done."""


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


class BatchStep(Step):
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


class RangeStep(Step):
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
