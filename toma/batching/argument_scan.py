"""One walk over a call's arguments: which tensors hold the logical batch's rows (and how many rows they agree on),
which containers hold something to split, and which plain sequences hold one item per row."""

from collections.abc import Mapping
from typing import Any, List, Set, Tuple

import torch

from toma.batching.nested import is_row_sequence_candidate, whole

__all__ = ["ArgumentScan"]


class ArgumentScan:
    """One walk over a call's arguments: the batch tensors (with their paths), and the plain sequences that
    become per-row data once the row count is known."""

    def __init__(self) -> None:
        self.tensors: List[Tuple[str, torch.Tensor]] = []
        self.sequences: List[Tuple[List[Any], Any]] = []  # (containers from the top down, the sequence)
        self.changing: Set[int] = set()  # ids of containers that hold something to split

    def walk(self, obj: Any, path: str, parents: List[Any]) -> bool:
        """True if `obj` changes per micro-batch whatever the row count (a batch tensor or a `whole`)."""
        if isinstance(obj, torch.Tensor):
            if obj.dim() == 0:
                return False
            self.tensors.append((path, obj))
            return True
        if isinstance(obj, whole):
            return True
        if isinstance(obj, (tuple, list)):
            if is_row_sequence_candidate(obj):
                if obj:
                    self.sequences.append((parents, obj))
                return False
            items: Any = enumerate(obj)
        elif isinstance(obj, Mapping):
            items = obj.items()
        else:
            return False
        inner = parents + [obj]
        hits = [
            self.walk(value, f"{path}[{key!r}]" if isinstance(obj, Mapping) else f"{path}[{key}]", inner)
            for key, value in items
        ]
        if any(hits):
            self.changing.add(id(obj))
            return True
        return False

    def batch_size(self) -> int:
        """The rows every batch tensor has (dim 0); a clear error where there are none, they disagree or are 0."""
        if not self.tensors:
            raise ValueError(
                "no tensor argument with a batch dimension to split: pass the logical batch as tensors "
                "(also inside tuples, lists or dicts) whose dim 0 is the batch"
            )
        first_path, first = self.tensors[0]
        size = first.shape[0]
        disagreeing = [(path, tensor.shape[0]) for path, tensor in self.tensors if tensor.shape[0] != size]
        if disagreeing:
            others = ", ".join(f"{path} has {rows}" for path, rows in disagreeing)
            raise ValueError(
                f"tensor arguments disagree on the logical batch size (dim 0): {first_path} has {size} rows, "
                f"{others}; wrap arguments that are not part of the batch in toma.whole(...)"
            )
        if size == 0:
            raise ValueError(f"the logical batch is empty: {first_path} has 0 rows")
        return int(size)

    def per_row(self, size: int) -> Set[int]:
        """The ids of the sequences that hold one item per row of a batch of `size` rows (their containers then
        change per micro-batch too)."""
        per_row: Set[int] = set()
        for parents, sequence in self.sequences:
            _mark_per_row(parents, sequence, size, self.changing, per_row)
        return per_row


def _mark_per_row(parents: List[Any], sequence: Any, size: int, changing: Set[int], per_row: Set[int]) -> None:
    """A sequence of `size` items is the rows' own data (texts, ids): split with them. Inside one of another
    length, sequences of `size` items are looked for further down (a tuple of such lists, like a dict)."""
    if len(sequence) == size:
        per_row.add(id(sequence))
        changing.add(id(sequence))
        changing.update(id(parent) for parent in parents)
        return
    inner = parents + [sequence]
    for item in sequence:
        if isinstance(item, (list, tuple)) and item:
            _mark_per_row(inner, item, size, changing, per_row)
