"""An evaluation batch in chunks that fit, each through the Trainer's `prediction_step` (`PredictionChunks`, a range
step): the chunks' losses averaged over their items or rows, their logits and labels joined back in the batch's
order."""

import contextlib
from typing import Any, Callable, ContextManager, List, Optional, Tuple

import torch
from transformers.trainer_pt_utils import nested_concat

from toma.accumulation.sharded_models import is_fsdp2
from toma.batching.groups import GroupedBatch
from toma.batching.logical import Piece
from toma.batching.packed import PackedBatch
from toma.batching.splitting import map_tensors
from toma.batching.tokens import restore_order
from toma.core.steps import RangeStep
from toma.integrations.trainer_records import TrainerRecords
from toma.integrations.transformers_shares import Count

__all__ = ["PredictionChunks", "nested_along_row", "held_for_chunks"]


class PredictionChunks(RangeStep):
    """The rows of one evaluation batch in chunks, each through the Trainer's `prediction_step`."""

    size_name = "evaluation chunk size"

    def __init__(
        self,
        predict: Callable[..., Tuple[Any, Any, Any]],
        split: Piece,
        model: torch.nn.Module,
        prediction_loss_only: bool,
        ignore_keys: Optional[List[str]],
        count: Optional[Count],
        summed: bool,
        records: TrainerRecords,
    ) -> None:
        super().__init__(self._chunk, 0, split.unit_count, (), {}, name="TomaTrainer.prediction_step")
        self.predict, self.split, self.model, self.count, self.summed = predict, split, model, count, summed
        self.loss_only, self.ignore_keys, self.records = prediction_loss_only, ignore_keys, records
        self.packed = isinstance(split, PackedBatch)  # its chunks' logits and labels join along the row
        self.grouped = isinstance(split, GroupedBatch)  # its chunks' rows go back to the batch's order
        # (start, loss, logits, labels, weight, the records' calls before it) per chunk
        self.chunks: List[Tuple[int, Any, Any, Any, Any, int]] = []

    @property
    def device(self) -> Optional[torch.device]:
        return next((p.device for p in self.model.parameters()), None)

    def _chunk(self, start: int, stop: int) -> None:
        while self.chunks and self.chunks[-1][0] >= start:  # chunks of an attempt the ranks agreed to redo
            self.records.rewind(self.chunks.pop()[5])
        ((part,), _) = self.split.arguments(start, stop)
        weight = self.count(part) if self.count is not None else self.split.rows_between(start, stop)
        calls = self.records.calls
        self.records.before_call(part, weight)
        loss, logits, labels = self.predict(self.model, part, self.loss_only, ignore_keys=self.ignore_keys)
        self.records.after_call()
        self.chunks.append((start, loss, logits, labels, weight, calls))

    def joined(self) -> Tuple[Optional[torch.Tensor], Any, Any]:
        if len(self.chunks) == 1:
            _, loss, logits, labels, _, _ = self.chunks[0]
            return loss, logits, labels
        return self._loss(), self._concatenated(2), self._concatenated(3)

    def _loss(self) -> Optional[torch.Tensor]:
        """The chunks' losses weighted by their items (chunks with none, a mean over nothing, left out), or
        added up."""
        losses = [(chunk[1], 1.0 if self.summed else float(chunk[4])) for chunk in self.chunks if chunk[1] is not None]
        if not losses:
            return None
        total = 1.0 if self.summed else sum(weight for _, weight in losses)
        if total == 0:  # nothing to average over: the plain Trainer's mean over nothing
            return losses[0][0]
        kept = [loss.float() * (weight / total) for loss, weight in losses if weight > 0]
        return torch.stack(kept).sum().to(losses[0][0].dtype)

    def _concatenated(self, index: int) -> Any:
        parts = [chunk[index] for chunk in self.chunks if chunk[index] is not None]
        if not parts:
            return None
        if self.packed:  # one row of packed sequences: its chunks' outputs side by side along the row
            return nested_along_row(parts)
        joined = parts[0]
        for part in parts[1:]:
            joined = nested_concat(joined, part, padding_index=-100)
        if self.grouped:  # a chunk of groups holds its rows in batch order, chunk after chunk: back to the batch's
            assert isinstance(self.split, GroupedBatch)
            order = [row for chunk in self.chunks for row in self.split.row_indices(*self._units(chunk[0]))]
            back = torch.tensor(restore_order(order), dtype=torch.long)
            rows = len(order)
            joined = map_tensors(
                joined, lambda t: t.index_select(0, back.to(t.device)) if t.dim() and t.shape[0] == rows else t
            )
        return joined

    def _units(self, start: int) -> Tuple[int, int]:
        """The units `[start, stop)` of the chunk that started at `start`."""
        starts = [chunk[0] for chunk in self.chunks]
        index = starts.index(start)
        return start, starts[index + 1] if index + 1 < len(starts) else self.end


def nested_along_row(parts: List[Any]) -> Any:
    """Outputs of a packed row's chunks joined along dim 1 (tensors, also inside tuples and lists)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=1) if first.dim() >= 2 else torch.cat(parts)
    if isinstance(first, (list, tuple)):
        return type(first)(nested_along_row([part[i] for part in parts]) for i in range(len(first)))
    return first


def held_for_chunks(model: torch.nn.Module) -> ContextManager[None]:
    """FSDP2's forward passes all-gather: its units held unsharded while the chunks run, a chunk one rank redoes
    leaves no other waiting (nothing to hold for a model FSDP2 did not shard)."""
    if not is_fsdp2(model):
        return contextlib.nullcontext()
    from toma.accumulation.fsdp2 import held_unsharded

    return held_unsharded(model)
