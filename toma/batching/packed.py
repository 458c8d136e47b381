"""Padding-free batches: rows of packed sequences, cut between sequences into micro-batches within a token budget.

A padding-free batch (Hugging Face's `DataCollatorWithFlattening`, TRL's `padding_free=True` and its default BFD
packing) holds its sequences one after another in one row, with no attention mask: `position_ids` restart at 0
where a sequence starts, and for the varlen kernels `cu_seq_lens_q`/`cu_seq_lens_k` (the sequences' cumulative
lengths), `max_length_q`/`max_length_k` and `seq_idx` say the same. The model attends within each sequence only
(eager and SDPA attention build the block-diagonal mask from `position_ids`), and the labels of each sequence's
first position are -100, so the row's summed loss is the sum of its sequences'. One such row is exactly what runs
out of memory, and no split by rows can cut it.

`PackedBatch` cuts between sequences: a micro-batch is consecutive sequences of one row, as many as a token budget
holds (a sequence longer than the budget alone), and it is a padding-free row of its own: the per-token tensors
sliced (views), `cu_seq_lens_*`, `max_length_*` and `seq_idx` rebuilt for its sequences. Sequences end where the
model's mask ends them: where `position_ids` do not go on by one (Hugging Face's rule), else at `cu_seq_lens`,
else where `seq_idx` changes; where several are given they must agree. The batch is recognised by those keys in a
dict argument (or the keyword arguments) that holds no `attention_mask`.
"""

from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from toma.batching.micro_batch_cost import MicroBatchCost
from toma.batching.splitting import MicroBatch, rebuild_mapping, rebuild_sequence, whole

__all__ = ["PACKED_KEYS", "PackedBatch", "PackedTokens", "is_packed", "packed_holder"]

POSITIONS, SEQUENCE_INDEX = "position_ids", "seq_idx"
BOUNDARIES = ("cu_seq_lens_q", "cu_seq_lens_k")
LONGEST = ("max_length_q", "max_length_k")
PACKED_KEYS = (POSITIONS, *BOUNDARIES, SEQUENCE_INDEX)
"""The keys that mark a padding-free batch, and the names `lengths=` takes for one."""

IGNORE_INDEX = -100

TokenMicroBatch = Tuple["PackedBatch", int, int, Optional[int]]


def is_packed(batch: Any) -> bool:
    """Whether `batch` (a dict) is padding-free: it holds one of `PACKED_KEYS` and no attention mask."""
    return (
        isinstance(batch, Mapping)
        and batch.get("attention_mask") is None
        and any(isinstance(batch.get(key), torch.Tensor) for key in PACKED_KEYS)
    )


def packed_holder(args: Tuple[Any, ...], kwargs: Dict[str, Any], name: str) -> Mapping:
    """The dict that holds the packed batch's keys: the keyword arguments or a dict argument."""
    for holder in (kwargs, *(arg for arg in args if isinstance(arg, Mapping))):
        if isinstance(holder.get(name), torch.Tensor):
            if holder.get("attention_mask") is not None:
                raise ValueError(
                    f"lengths={name!r} cuts a padding-free batch between its packed sequences, but this batch has an "
                    "attention_mask: its rows are padded, and the model attends across what position_ids mark. Pass "
                    "lengths='attention_mask' for padded rows"
                )
            return holder
    raise ValueError(
        f"lengths={name!r}: no tensor {name!r} among the call's keyword arguments or in a dict argument; a "
        f"padding-free batch carries one of {', '.join(PACKED_KEYS)}"
    )


def _starts_from_positions(positions: torch.Tensor) -> List[List[int]]:
    """Each row's sequence starts: position 0, and wherever a position does not follow the one before by one."""
    breaks = torch.ones_like(positions, dtype=torch.bool)
    breaks[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return [row.nonzero().flatten().tolist() for row in breaks]


def _starts_from_index(index: torch.Tensor) -> List[List[int]]:
    breaks = torch.ones_like(index, dtype=torch.bool)
    breaks[:, 1:] = index[:, 1:] != index[:, :-1]
    return [row.nonzero().flatten().tolist() for row in breaks]


class _Sequence:
    __slots__ = ("row", "begin", "end")

    def __init__(self, row: int, begin: int, end: int) -> None:
        self.row, self.begin, self.end = row, begin, end


class PackedBatch:
    """A padding-free logical batch of `len(sequences)` packed sequences in `rows` rows of `width` positions; its
    units are the sequences (a micro-batch `[start, stop)` is consecutive sequences of one row, and a share "by
    rows" counts sequences). By a token budget: `PackedTokens`."""

    def __init__(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], key: str, name: str = "args") -> None:
        holder = packed_holder(args, kwargs, key)  # `key`: the name lengths= gave, one of PACKED_KEYS
        self.args, self.kwargs, self.name = args, kwargs, name
        per_token = self._per_token_shape(holder)
        self.rows, self.width = per_token
        starts = self._starts(holder)
        self.sequences: List[_Sequence] = []
        for row, row_starts in enumerate(starts):
            ends = row_starts[1:] + [self.width]
            self.sequences += [_Sequence(row, begin, end) for begin, end in zip(row_starts, ends)]
        self._check_labels(holder)
        self.tensors: List[Tuple[str, torch.Tensor]] = []
        self._walk_check(args, kwargs)
        self.lengths = [s.end - s.begin for s in self.sequences]

    # --- the layout --------------------------------------------------------------------------------

    @staticmethod
    def _per_token_shape(holder: Mapping) -> Tuple[int, int]:
        for key in (POSITIONS, SEQUENCE_INDEX, "input_ids", "labels", "inputs_embeds"):
            value = holder.get(key)
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                return int(value.shape[0]), int(value.shape[1])
        boundaries = next(holder[key] for key in BOUNDARIES if isinstance(holder.get(key), torch.Tensor))
        return 1, int(boundaries[-1])

    def _starts(self, holder: Mapping) -> List[List[int]]:
        found: List[Tuple[str, List[List[int]]]] = []
        positions = holder.get(POSITIONS)
        if isinstance(positions, torch.Tensor):
            found.append((POSITIONS, _starts_from_positions(positions.detach().to("cpu").reshape(self.rows, -1))))
        for key in BOUNDARIES:
            boundaries = holder.get(key)
            if isinstance(boundaries, torch.Tensor):
                if self.rows != 1:
                    raise ValueError(
                        f"{key} holds the sequences of one packed row, but this batch has {self.rows} rows; pack "
                        "them into one row, or leave cu_seq_lens out and let position_ids mark the sequences"
                    )
                edges = boundaries.detach().to("cpu").reshape(-1).tolist()
                if edges[0] != 0 or edges[-1] != self.width or any(b <= a for a, b in zip(edges, edges[1:])):
                    raise ValueError(f"{key} must rise from 0 to the packed row's {self.width} positions, got {edges}")
                found.append((key, [edges[:-1]]))
        index = holder.get(SEQUENCE_INDEX)
        if isinstance(index, torch.Tensor):
            found.append((SEQUENCE_INDEX, _starts_from_index(index.detach().to("cpu").reshape(self.rows, -1))))
        first_key, first = found[0]
        for key, starts in found[1:]:
            if starts != first:
                raise ValueError(
                    f"a padding-free batch's {first_key} and {key} disagree on where its sequences start; they must "
                    "mark the same sequences (a collator builds them together)"
                )
        return first

    def _check_labels(self, holder: Mapping) -> None:
        """A sequence's first label must be -100: else the row's loss trains the last token of one sequence to
        predict the first of the next, which no micro-batch cut between them can."""
        labels = holder.get("labels")
        if (
            not isinstance(labels, torch.Tensor)
            or labels.dim() < 2
            or tuple(labels.shape[:2]) != (self.rows, self.width)
        ):
            return
        inner = [(s.row, s.begin) for s in self.sequences if s.begin > 0]
        if not inner:
            return
        rows, columns = zip(*inner)
        at_starts = labels.detach()[list(rows), list(columns)]
        if bool((at_starts != IGNORE_INDEX).any()):
            raise ValueError(
                "a padding-free batch's labels must be -100 at the first position of each packed sequence (as "
                "DataCollatorWithFlattening and TRL's collators set them): otherwise the row's loss trains the last "
                "token of one sequence to predict the first of the next, and no micro-batch cut between them can "
                "give the same loss"
            )

    def _is_per_token(self, tensor: torch.Tensor) -> bool:
        return tensor.dim() >= 2 and tensor.shape[0] == self.rows and tensor.shape[1] == self.width

    def _walk_check(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Every tensor of the batch is per token, or one this module rebuilds; anything else must be marked whole."""

        def walk(obj: Any, path: str, key: Any) -> None:
            if isinstance(obj, torch.Tensor):
                if obj.dim() == 0 or key in BOUNDARIES:
                    return
                if key in (POSITIONS, SEQUENCE_INDEX) and obj.dim() == 1 and self.rows == 1:
                    obj = obj[None]
                if not self._is_per_token(obj):
                    raise ValueError(
                        f"{path} {tuple(obj.shape)} is neither per token of the padding-free batch ({self.rows} x "
                        f"{self.width}) nor one of {', '.join(BOUNDARIES)}: it cannot be cut between sequences. Wrap "
                        "it in toma.whole(...) if every micro-batch takes it whole"
                    )
                self.tensors.append((path, obj))
            elif isinstance(obj, (list, tuple)):
                for index, item in enumerate(obj):
                    walk(item, f"{path}[{index}]", None)
            elif isinstance(obj, Mapping):
                for item_key, value in obj.items():
                    walk(value, f"{path}[{item_key!r}]", item_key)

        for index, arg in enumerate(args):
            walk(arg, f"{self.name}[{index}]", None)
        for key, value in kwargs.items():
            walk(value, f"kwargs[{key!r}]", key)

    # --- as a logical batch (toma.batching.splitting's protocol) -------------------------------------

    @property
    def size(self) -> int:
        """Its sequences: what micro-batches are cut into (and what a share by "rows" counts)."""
        return len(self.sequences)

    unit_name = "packed sequences"  # what its units are called in messages

    @property
    def unit_count(self) -> int:
        """What micro-batches are cut into: its sequences."""
        return len(self.sequences)

    @property
    def largest(self) -> int:
        return len(self.sequences)

    @property
    def pieces(self) -> List["PackedBatch"]:
        return [self]

    def rows_between(self, start: int, stop: int) -> int:
        return stop - start

    def micro_batches(self, size: int) -> List[MicroBatch]:
        """Micro-batches of at most `size` consecutive sequences of one row."""
        found: List[MicroBatch] = []
        start = 0
        while start < len(self.sequences):
            stop = start + 1
            row = self.sequences[start].row
            while stop < len(self.sequences) and stop - start < size and self.sequences[stop].row == row:
                stop += 1
            found.append((self, start, stop))  # type: ignore[arg-type]
            start = stop
        return found

    def placed(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "PackedBatch":
        return self

    def describe(self, limit: int = 4) -> str:
        shown = ", ".join(f"{path} {tuple(tensor.shape)}" for path, tensor in self.tensors[:limit])
        return f"{len(self.sequences)} packed sequences: " + shown + (", ..." if len(self.tensors) > limit else "")

    def arguments(
        self, start: int, stop: int, rows: Optional[List[torch.Tensor]] = None, width: Optional[int] = None
    ) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """The padding-free row of sequences `[start, stop)` (of one row); the call's own arguments when that is
        the whole batch."""
        if start == 0 and stop >= len(self.sequences) and self.rows == 1:
            if rows is not None:
                rows.extend(tensor for _, tensor in self.tensors)
            return self.args, self.kwargs
        first, last = self.sequences[start], self.sequences[stop - 1]
        if first.row != last.row:
            raise ValueError("a packed micro-batch holds sequences of one row")
        cut = _Cut(self, first.row, first.begin, last.end, self.lengths[start:stop], rows)
        return tuple(cut(arg, None) for arg in self.args), {key: cut(value, key) for key, value in self.kwargs.items()}

    def area_between(self, start: int, stop: int) -> int:
        """The tokens of sequences `[start, stop)`."""
        return sum(self.lengths[start:stop])


class PackedTokens:
    """A `PackedBatch` as a token piece (`toma.batching.tokens`' protocol): its micro-batches are consecutive
    sequences of one row within a token budget; nothing to sort, trim or measure (there is no padding to save)."""

    __slots__ = ("batch", "cost")

    def __init__(self, batch: PackedBatch, cost: Optional[MicroBatchCost] = None) -> None:
        self.batch = batch
        self.cost = MicroBatchCost(0) if cost is None else cost

    @property
    def area(self) -> int:
        """Its tokens (padding-free: every position counts)."""
        return self.batch.rows * self.batch.width

    @property
    def longest(self) -> int:
        """The longest sequence's tokens."""
        return max(self.batch.lengths)

    def area_between(self, start: int, stop: int) -> int:
        return self.batch.area_between(start, stop)

    def stop(self, start: int, budget: int) -> int:
        """Where a micro-batch from sequence `start` ends: as many sequences of its row as `budget` tokens hold (at
        least one)."""
        batch, lengths = self.batch, self.batch.lengths
        row, tokens, stop = batch.sequences[start].row, lengths[start], start + 1
        while stop < len(lengths) and batch.sequences[stop].row == row and tokens + lengths[stop] <= budget:
            tokens += lengths[stop]
            stop += 1
        return stop

    def micro_batches(self, budget: int) -> List[TokenMicroBatch]:
        """Consecutive sequences of one row within `budget` tokens (a longer sequence alone): `(batch, start, stop,
        None)`."""
        found: List[TokenMicroBatch] = []
        start = 0
        while start < len(self.batch.lengths):
            stop = self.stop(start, budget)
            found.append((self.batch, start, stop, None))
            start = stop
        return found


class _Cut:
    """One micro-batch's arguments: per-token tensors sliced to `[begin, end)` of `row`, the boundaries, longest
    lengths and sequence index rebuilt for `lengths`."""

    def __init__(
        self,
        batch: PackedBatch,
        row: int,
        begin: int,
        end: int,
        lengths: Sequence[int],
        collected: Optional[List[torch.Tensor]],
    ) -> None:
        self.batch, self.row, self.begin, self.end, self.lengths = batch, row, begin, end, list(lengths)
        self.collected = collected

    def __call__(self, obj: Any, key: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, key)
        if isinstance(obj, whole):
            return obj.value
        if key in LONGEST and isinstance(obj, int) and not isinstance(obj, bool):
            return max(self.lengths)
        if isinstance(obj, (list, tuple)):
            return rebuild_sequence(obj, [self(item, None) for item in obj])
        if isinstance(obj, Mapping):
            return rebuild_mapping(obj, {item_key: self(value, item_key) for item_key, value in obj.items()})
        return obj

    def _tensor(self, tensor: torch.Tensor, key: Any) -> torch.Tensor:
        if tensor.dim() == 0:
            if key in LONGEST:
                return torch.tensor(max(self.lengths), dtype=tensor.dtype, device=tensor.device)
            return tensor
        if key in BOUNDARIES:
            edges = [0]
            for length in self.lengths:
                edges.append(edges[-1] + length)
            return torch.tensor(edges, dtype=tensor.dtype, device=tensor.device)
        if key == SEQUENCE_INDEX:
            counts = torch.tensor(self.lengths, device=tensor.device)
            index = torch.repeat_interleave(torch.arange(len(self.lengths), device=tensor.device), counts)
            index = index.to(tensor.dtype)
            return index[None] if tensor.dim() == 2 else index
        if tensor.dim() == 1:  # position_ids of a single row given without its row dimension
            cut = tensor[self.begin : self.end]
        else:
            cut = tensor[self.row : self.row + 1, self.begin : self.end]
        if self.collected is not None:
            self.collected.append(cut)
        return cut
