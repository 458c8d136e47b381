"""Splitting a call's arguments into micro-batches along the batch dimension (dim 0).

Every tensor with at least one dimension is part of the batch, also inside tuples, lists and dicts, and
all of them must agree on its size. Everything else (numbers, strings, modules, 0-dim tensors, and
tensors wrapped in `whole`) goes to every micro-batch as it is. Micro-batches are views: no copies.
"""

import copy
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Tuple

import torch

__all__ = ["whole", "BatchSplit", "map_tensors"]


class whole:
    """Marks an argument that goes to every micro-batch unsplit: `compute_loss(x, y, toma.whole(weights))`."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"whole({self.value!r})"


def _find_batch_tensors(obj: Any, path: str, found: List[Tuple[str, torch.Tensor]]) -> bool:
    """Collect (path, tensor) for the batch tensors in `obj`; True if `obj` changes per micro-batch."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            return False
        found.append((path, obj))
        return True
    if isinstance(obj, whole):
        return True
    if isinstance(obj, (tuple, list)):
        hits = [_find_batch_tensors(item, f"{path}[{i}]", found) for i, item in enumerate(obj)]
        return any(hits)
    if isinstance(obj, Mapping):
        hits = [_find_batch_tensors(value, f"{path}[{key!r}]", found) for key, value in obj.items()]
        return any(hits)
    return False


def _rebuild_mapping(obj: Mapping, items: Dict[Any, Any]) -> Any:
    if type(obj) is dict:
        return items
    try:  # OrderedDict, defaultdict, a tokenizer's BatchEncoding: keep the type and its extra state
        rebuilt = copy.copy(obj)
        for key, value in items.items():
            rebuilt[key] = value  # type: ignore[index]
        return rebuilt
    except Exception:
        return items


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`obj` with `fn` applied to every tensor inside tuples, lists and mappings (types kept), and every
    `whole` unwrapped."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, whole):
        return obj.value
    if isinstance(obj, tuple):
        items = [map_tensors(item, fn) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [map_tensors(item, fn) for item in obj]
    if isinstance(obj, Mapping):
        return _rebuild_mapping(obj, {key: map_tensors(value, fn) for key, value in obj.items()})
    return obj


def _slice(obj: Any, start: int, stop: int) -> Any:
    return map_tensors(obj, lambda tensor: tensor if tensor.dim() == 0 else tensor[start:stop])


def _fill(container: Any, slots: List[Tuple[Any, bool]], start: int, stop: int, full: bool) -> Any:
    """Replace `container[slot]` by its micro-batch for each slot (a plain tensor needs no slicing when full)."""
    for slot, is_tensor in slots:
        if not is_tensor:
            container[slot] = _slice(container[slot], start, stop)
        elif not full:
            container[slot] = container[slot][start:stop]
    return container


class BatchSplit:
    """A call's `(args, kwargs)`, split into micro-batches `[start, stop)` of the logical batch."""

    __slots__ = ("args", "kwargs", "size", "_arg_slots", "_kwarg_slots", "_plain")

    def __init__(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        found: List[Tuple[str, torch.Tensor]] = []
        # Which top-level arguments change per micro-batch, and whether each is a plain tensor (a fast slice).
        self._arg_slots = [
            (i, isinstance(arg, torch.Tensor))
            for i, arg in enumerate(args)
            if _find_batch_tensors(arg, f"args[{i}]", found)
        ]
        self._kwarg_slots = [
            (key, isinstance(value, torch.Tensor))
            for key, value in kwargs.items()
            if _find_batch_tensors(value, f"kwargs[{key!r}]", found)
        ]
        if not found:
            raise ValueError(
                "no tensor argument with a batch dimension to split: pass the logical batch as tensors "
                "(also inside tuples, lists or dicts) whose dim 0 is the batch"
            )
        first_path, first = found[0]
        size = first.shape[0]
        disagreeing = [(path, tensor.shape[0]) for path, tensor in found if tensor.shape[0] != size]
        if disagreeing:
            others = ", ".join(f"{path} has {rows}" for path, rows in disagreeing)
            raise ValueError(
                f"tensor arguments disagree on the logical batch size (dim 0): {first_path} has {size} rows, "
                f"{others}; wrap arguments that are not part of the batch in toma.whole(...)"
            )
        if size == 0:
            raise ValueError(f"the logical batch is empty: {first_path} has 0 rows")
        self.args, self.kwargs, self.size = args, kwargs, size
        self._plain = all(is_tensor for _, is_tensor in self._arg_slots + self._kwarg_slots)

    def micro_batch(self, start: int, stop: int) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """The arguments for rows `[start, stop)`; the call's own arguments when that is all of them."""
        args, kwargs = self.args, self.kwargs
        full = start == 0 and stop >= self.size
        if full and self._plain:
            return args, kwargs
        if self._arg_slots:
            args = tuple(_fill(list(args), self._arg_slots, start, stop, full))
        if self._kwarg_slots:
            kwargs = _fill(dict(kwargs), self._kwarg_slots, start, stop, full)
        return args, kwargs
