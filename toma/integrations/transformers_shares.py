"""How `TomaTrainer` weights a logical batch's micro-batches so that their losses add up to the plain Trainer's:
each micro-batch's share of the batch, counted in label items as the Trainer counts them, in `toma_weight=`'s
items, or in rows (see `toma.integrations.transformers`'s docstring)."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from toma.batching.groups import Groups, grouped_batch
from toma.batching.logical import Piece
from toma.batching.packed import PACKED_KEYS, PackedBatch, is_packed

IGNORE_INDEX = -100  # the Trainer's label for a position that is not a target

Count = Callable[[Any], Any]


@dataclass(frozen=True)
class Shares:
    """How one logical batch's micro-losses add up to the plain Trainer's loss for it: micro-batch i, a share s_i
    of the batch, is given `num_items_in_batch * s_i` and weighted by s_i."""

    count: Optional[Count]  # what a share is counted in (None: rows)
    total: Any  # the batch's count (None: rows)
    rows: int  # the batch's rows
    num_items: Any  # num_items_in_batch as the Trainer passes it (None: none)
    divisor: int  # the plain Trainer's division by the gradient-accumulation steps (1: none)
    summed: bool = False  # normalised by compute_loss itself without num_items_in_batch: the micro-losses add up
    groups: Optional[Groups] = None  # how the batch's rows belong together (pairs: tensors of n/2 rows beside n)

    def num_items_for(self, micro: Any, whole: Any) -> Any:
        """The micro-batch's `num_items_in_batch`: the Trainer's, times its share (as given, for the whole batch
        `whole`)."""
        if self.num_items is None:
            return None
        if micro is whole:
            return self.num_items
        if self.count is None:
            return self.num_items * units(micro, self.groups) / self.rows
        return self.num_items * self.count(micro) / self.total

    def weight_of(self, micro: Any, whole: Any) -> Any:
        """What the micro-batch's share counts (its label items, or its units): the weight of a metric that
        averages over what the loss does."""
        if self.count is not None:
            return self.count(micro)
        return self.rows if micro is whole else units(micro, self.groups)


def units(batch: Any, groups: Optional[Groups] = None) -> int:
    """A batch's units as a share by rows counts them: its rows (a batch of pairs holds tensors of one value per
    pair beside its rows), or a padding-free batch's packed sequences."""
    if is_packed(batch):
        key = next(key for key in PACKED_KEYS if isinstance(batch.get(key), torch.Tensor))
        return PackedBatch((batch,), {}, key).size
    return int(grouped_batch((batch,), {}, groups).size)


class LabelCount:
    """A batch's label items as the Trainer counts them for `num_items_in_batch`: labels other than -100, after
    the shift of a causal language model's loss (or its `shift_labels` as given)."""

    def __init__(self, shifted: bool) -> None:
        self.shifted = shifted

    def __call__(self, batch: Any) -> torch.Tensor:
        if "shift_labels" in batch:
            labels = batch["shift_labels"]
        else:
            labels = batch["labels"][..., 1:] if self.shifted else batch["labels"]
        return labels.ne(IGNORE_INDEX).sum()


def has_labels(inputs: Any) -> bool:
    """Whether the Trainer's inputs carry labels (`labels` or `shift_labels`) to count."""
    return isinstance(inputs, Mapping) and any(
        isinstance(inputs.get(key), torch.Tensor) for key in ("labels", "shift_labels")
    )


def has_mask(inputs: Any) -> bool:
    """Whether a batch carries a (rows, width) `attention_mask` to pack its rows by."""
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    return isinstance(mask, torch.Tensor) and mask.dim() == 2


def nothing_to_learn(
    inputs: Any, num_items_in_batch: Any, ranks: int, count_for: Callable[[Any], Optional[Count]]
) -> bool:
    """Whether a batch's labels count nothing, on every rank where there are several (the Trainer's
    `num_items_in_batch` counts them all): its loss would be a mean over nothing. `count_for(inputs)`: what the
    loss averages over (None: rows)."""
    if not has_labels(inputs):
        return False
    if num_items_in_batch is not None:
        return float(num_items_in_batch) == 0
    if ranks > 1:
        return False  # the other ranks' items are unknown here: this rank takes part with a loss of 0
    count = count_for(inputs)
    return count is not None and float(count(inputs)) == 0


def is_causal_lm(model: Any) -> bool:
    """Whether the model's own loss shifts its labels, by the Trainer's label-smoothing rule (a causal language
    model's class, not an encoder-decoder), which a subclass of such a class inherits."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) or not isinstance(model, torch.nn.Module):
        return False
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return any(cls.__name__ in causal for cls in type(model).__mro__)


def check_weight(weight: Any) -> Optional[Count]:
    """`toma_weight=` checked: None, or a function of a batch."""
    if weight is not None and not callable(weight):
        raise TypeError(
            "toma_weight must be a function of a batch (the Trainer's inputs) that returns how many items its mean "
            f"loss averages over, e.g. lambda batch: (batch['labels'] != -100).sum(); got {weight!r}"
        )
    return weight


def check_additive(weight: Count, batch: Any, total: float) -> None:
    """`toma_weight` must count a batch's items row by row, or micro-batches' shares would not add up to 1 (a part
    of the batch dropped or counted twice): its two halves must count what the whole does. Checked once, on the
    first batch, before any forward pass."""
    count = batch.unit_count
    if count < 2:
        return
    half = count // 2
    ((first,), _), ((second,), _) = batch.arguments(0, half), batch.arguments(half, count)
    counted = float(weight(first) + weight(second))
    if abs(counted - total) > 1e-6 * total:
        name = getattr(weight, "__qualname__", repr(weight))
        raise ValueError(
            f"toma_weight ({name}) must count a batch's items row by row, so that its micro-batches' counts add up "
            f"to the whole batch's: the two halves of a batch of {batch.size} rows count {counted:g}, the whole "
            f"{total:g}"
        )


def trainer_shares(
    trainer: transformers.Trainer,
    inputs: Any,
    batch: Piece,
    num_items_in_batch: Any,
    count: Optional[Count],
    model_count: Count,
    weight: Optional[Count],
    check: bool,
) -> Shares:
    """The shares of a batch's micro-batches for the Trainer's loss: counted in `count` (None: rows), scaled as the
    Trainer scales for accumulation; `weight` (`toma_weight=`) checked to add up where `check`, and refused where it
    counts nothing in a labelled batch (`model_count` the labels' items)."""
    declared = trainer.loss_is_scaled_for_ga
    if declared is not None:
        scaled = bool(declared)
    else:  # the Trainer's own rule: normalised by num_items_in_batch, by the model or compute_loss_func
        scaled = (
            trainer.model_accepts_loss_kwargs and num_items_in_batch is not None
        ) or trainer.compute_loss_func is not None
    divisor = 1 if scaled else int(trainer.current_gradient_accumulation_steps)
    if declared is True and num_items_in_batch is None:
        # Normalised over the window by compute_loss itself, with nothing to scale: the micro-losses add up.
        return Shares(None, None, batch.size, None, 1, summed=True)
    if count is None:
        return Shares(None, None, batch.size, num_items_in_batch, divisor)
    total = count(inputs)
    value = float(total)
    if value > 0:
        if count is weight and check:
            check_additive(count, batch, value)
        return Shares(count, total, batch.size, num_items_in_batch, divisor)
    if not value == 0:
        raise ValueError(f"toma_weight must return a count of at least 0, got {value} for a batch of {batch.size} rows")
    if count is weight and has_labels(inputs):
        labelled = float(model_count(inputs))
        if labelled > 0:
            raise ValueError(
                f"toma_weight counted 0 items in a batch of {batch.size} rows whose labels hold {labelled:g}: "
                "its micro-batches cannot be weighted, and the plain Trainer would train on this batch's loss. "
                "toma_weight must return what the batch's loss averages over"
            )
    # Nothing to average over (every label -100): shares by rows give the plain Trainer's value all the same.
    return Shares(None, None, batch.size, num_items_in_batch, divisor)
