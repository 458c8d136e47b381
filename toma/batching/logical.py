"""Which kind of logical batch a call's arguments make: rows on their own (`ArgumentBatch`), rows in groups
(`toma.batching.groups.GroupedBatch`), or packed sequences (`toma.batching.packed.PackedBatch`, where `lengths=`
names a padding-free batch's `position_ids`, `cu_seq_lens_*` or `seq_idx`)."""

from typing import Any, Dict, Optional, Tuple, Union

from toma.batching.groups import GroupedBatch, Groups, group_label, grouped_batch
from toma.batching.packed import PACKED_KEYS, PackedBatch
from toma.batching.splitting import ArgumentBatch, ArgumentPieces

__all__ = ["Piece", "LogicalBatch", "logical_batch_of", "check_packing", "is_packed_lengths"]

Piece = Union[ArgumentBatch, GroupedBatch, PackedBatch]
"""One piece of a logical batch: rows on their own, rows in groups, or packed sequences."""

LogicalBatch = Union[Piece, ArgumentPieces]
"""What `toma.accumulate` works through: a call's arguments, or several loader batches' in pieces."""


def is_packed_lengths(lengths: Any) -> bool:
    """Whether `lengths=` names a padding-free batch's sequence marks."""
    return isinstance(lengths, str) and lengths in PACKED_KEYS


def check_packing(lengths: Any, groups: Optional[Groups], prefix: str = "") -> None:
    """Packed sequences are their own units: they cannot also be grouped."""
    if is_packed_lengths(lengths) and groups not in (None, "rows"):
        raise ValueError(
            f"{prefix}lengths={lengths!r} cuts a padding-free batch between its packed sequences; {prefix}groups="
            f"{group_label(groups)} groups rows of a padded batch. Give one of them"
        )


def logical_batch_of(
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    lengths: Any = None,
    groups: Optional[Groups] = None,
    name: str = "args",
) -> Piece:
    """The logical batch of a call's arguments, by `lengths=` and `groups=` (checked by the caller)."""
    if is_packed_lengths(lengths):
        return PackedBatch(args, kwargs, lengths, name)
    return grouped_batch(args, kwargs, groups, name)
