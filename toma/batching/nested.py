"""Values nested in tuples, lists and dicts, as a call's arguments hold them: `whole` (a value every micro-batch
gets unsplit), which plain sequences may hold one item per row, containers rebuilt with their own types, and every
tensor inside mapped or moved."""

import copy
from collections.abc import Mapping
from typing import Any, Callable, Dict, List

import torch

__all__ = [
    "whole",
    "is_row_sequence_candidate",
    "rebuild_mapping",
    "rebuild_sequence",
    "leaves",
    "map_tensors",
    "place_whole",
    "returned_per_row",
]


class whole:
    """Marks an argument that goes to every micro-batch unsplit: `compute_loss(x, y, toma.whole(weights))`."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"whole({self.value!r})"


def _is_record(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _holds_batch_tensors(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.dim() > 0
    if isinstance(obj, whole):
        return True
    if isinstance(obj, (tuple, list)):
        return any(_holds_batch_tensors(item) for item in obj)
    if isinstance(obj, Mapping):
        return any(_holds_batch_tensors(value) for value in obj.values())
    return False


def is_row_sequence_candidate(obj: Any) -> bool:
    """A list or tuple of plain values (no batch tensor inside, 0-dim tensors count as values; not a
    namedtuple): one item per row when its length is the batch's row count."""
    return isinstance(obj, (list, tuple)) and not _is_record(obj) and not _holds_batch_tensors(obj)


def rebuild_mapping(obj: Mapping, items: Dict[Any, Any]) -> Any:
    """A mapping like `obj` (its type and extra state kept where it can be copied) holding `items`."""
    if type(obj) is dict:
        return items
    try:  # OrderedDict, defaultdict, a tokenizer's BatchEncoding: keep the type and its extra state
        rebuilt = copy.copy(obj)
        for key, value in items.items():
            rebuilt[key] = value  # type: ignore[index]
        return rebuilt
    except Exception:
        return items


def rebuild_sequence(obj: Any, items: List[Any]) -> Any:
    """A list, tuple or namedtuple like `obj` holding `items`."""
    if isinstance(obj, list):
        return items
    return type(obj)(*items) if _is_record(obj) else tuple(items)


def leaves(obj: Any) -> List[Any]:
    """The values at the leaves of tuples, lists and dicts, in order (depth first)."""
    found: List[Any] = []
    if isinstance(obj, (tuple, list)):
        for item in obj:
            found.extend(leaves(item))
    elif isinstance(obj, dict):
        for value in obj.values():
            found.extend(leaves(value))
    else:
        found.append(obj)
    return found


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`obj` with `fn` applied to every tensor inside tuples, lists and mappings (types kept), and every
    `whole` unwrapped."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, whole):
        return obj.value
    if isinstance(obj, (tuple, list)):
        return rebuild_sequence(obj, [map_tensors(item, fn) for item in obj])
    if isinstance(obj, Mapping):
        return rebuild_mapping(obj, {key: map_tensors(value, fn) for key, value in obj.items()})
    return obj


def place_whole(obj: Any, move: Callable[[torch.Tensor], torch.Tensor], inside: bool) -> Any:
    """`obj` with `move` applied to the tensors inside `whole` values; containers rebuilt only where
    something changed (types such as `torch.Size` stay as they are)."""
    if isinstance(obj, torch.Tensor):
        return move(obj) if inside else obj
    if isinstance(obj, whole):
        value = place_whole(obj.value, move, True)
        return obj if value is obj.value else whole(value)
    if isinstance(obj, (tuple, list)):
        items = [place_whole(item, move, inside) for item in obj]
        return obj if all(new is old for new, old in zip(items, obj)) else rebuild_sequence(obj, items)
    if isinstance(obj, Mapping):
        values = {key: place_whole(value, move, inside) for key, value in obj.items()}
        return obj if all(values[key] is value for key, value in obj.items()) else rebuild_mapping(obj, values)
    return obj


def returned_per_row(found: Any, name: str, item: str) -> List[Any]:
    """What a user's function returned for each row (`lengths=`, `groups=`): a tensor or a sequence, as a list; a
    TypeError naming the function otherwise (a None, a number or a string is no value per row)."""
    if isinstance(found, torch.Tensor):
        return found.detach().to("cpu").reshape(-1).tolist()  # type: ignore[no-any-return]
    if isinstance(found, (str, bytes)) or not hasattr(found, "__len__") or not hasattr(found, "__iter__"):
        raise TypeError(f"{name} must return {item} for each row (a tensor or a list), got {type(found).__name__}")
    return list(found)
