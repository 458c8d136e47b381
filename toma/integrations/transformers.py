"""The Hugging Face `Trainer` with the batch size you set, whatever the memory: `TomaTrainer` and
`TomaTrainerMixin`.

Every loader batch of `per_device_train_batch_size` rows is one logical batch, trained with `toma.accumulate`'s
machinery in micro-batches that fit (shrinking on out-of-memory errors, `FitToMemory` by default, the size kept
per trainer), with the gradients the plain Trainer gets for that batch. Two hooks change: `training_step` (the
class's own runs, and inside it the Trainer's `compute_loss` call on the batch becomes the logical batch in
micro-batches, each through the class's `compute_loss` and `self.accelerator.backward`; what `compute_loss`
counts and logs per call counted once, `toma.integrations.trainer_records`) and `prediction_step` (an evaluation
batch in chunks that fit, results joined); `log` adds the micro-batch size. Everything else (the loop,
schedulers, clipping, callbacks, checkpoints, accelerate's DDP and mixed precision) is the Trainer's own.

How the micro-losses add up to the plain Trainer's loss for the batch, `compute_loss(batch, num_items_in_batch)`:
each micro-batch holds a share of the batch (its label items over the batch's, counted as the Trainer counts them,
or `toma_weight=`'s count, or its rows), is given `num_items_in_batch` times its share and weighted by its share.
A part of the loss normalised by `num_items_in_batch` then adds up to the batch's, whatever the shares; a part
added once per batch (a penalty on the weights, a mean over what the shares count) adds up to itself, as the
shares add up to 1 (a term that is not linear in the batch, a router's load-balancing loss, is the share-weighted
mean of the micro-batches' values); and a
mean the loss takes on its own (ignoring `num_items_in_batch`) is reproduced where it averages over what the shares
count. The division by the accumulation steps follows the Trainer's rule.
"""

import contextlib
import copy
import dataclasses
import functools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, ContextManager, List, Optional, Tuple

import torch
import transformers
from transformers.trainer_pt_utils import nested_concat
from transformers.trainer_utils import unwrap_peft_model
from transformers.training_args import OptimizerNames

from toma.accumulation.accumulate import AccumulationStats, Sizing, accumulate
from toma.accumulation.options import AccumulationSettings, SettingAttribute, check_flag
from toma.accumulation.sharded_models import is_fsdp2
from toma.batching.groups import GroupedBatch, Groups
from toma.batching.logical import Piece, logical_batch_of
from toma.batching.packed import PackedBatch, is_packed
from toma.batching.splitting import map_tensors
from toma.batching.tokens import restore_order
from toma.core.arguments import check_size
from toma.core.caches import GlobalBatchsizeCache
from toma.core.policy import SizePolicy, check_policy
from toma.core.runner import Runner
from toma.core.steps import RangeStep
from toma.integrations import grpo
from toma.integrations.local_collectives import local_collectives
from toma.integrations.trainer_records import TrainerRecords
from toma.integrations.transformers_shares import (
    Count,
    LabelCount,
    Shares,
    check_additive,
    check_weight,
    has_labels,
    is_causal_lm,
)
from toma.integrations.trl import known_groups, record_rules, trl_trainer
from toma.integrations.versions import require
from toma.sizing.defaults import ACCUMULATION
from toma.training.data import WHOLE_BATCHES

__all__ = ["TomaTrainerMixin", "TomaTrainer"]

MINIMUM_TRANSFORMERS = "5.23"  # the Trainer's `loss_is_scaled_for_ga`, which says how it scales the loss
require("transformers", transformers.__version__, MINIMUM_TRANSFORMERS, "transformers")

log = logging.getLogger("toma")

OPTIONS = (
    "toma_policy",
    "toma_initial_micro_batch",
    "toma_weight",
    "toma_log_micro_batch",
    "toma_pack_tokens",
    "toma_gradient_sync",
    "toma_groups",
    "toma_split_for_padding",
)

_NOTHING = object()  # no instance attribute of that name
_PACKED = "position_ids"  # what a padding-free batch's sequences are found by (or its cu_seq_lens, seq_idx)
_said: set = set()


def _say_once(text: str) -> None:
    if text not in _said:
        _said.add(text)
        log.warning(text)


# Type checkers see the mixin as the Trainer it is mixed into; at run time it is a plain class.
if TYPE_CHECKING:
    _Trainer = transformers.Trainer
else:
    _Trainer = object


class TomaTrainerMixin(_Trainer):
    """Put it first among the bases of a `transformers.Trainer` subclass, `class MyTrainer(TomaTrainerMixin,
    SFTTrainer)`: its loader batches train in micro-batches that fit, with the plain Trainer's gradients.

    Options (keywords of the constructor): `toma_policy=` (a toma sizing policy; `FitToMemory` by default),
    `toma_initial_micro_batch=` (where the search starts; the whole batch by default), `toma_weight=` (a function of
    a batch returning what its mean loss averages over, for a `compute_loss` whose mean is neither over label tokens
    nor over rows), `toma_log_micro_batch=True` (training logs also carry `micro_batch` and `toma_oom_retries`; off
    by default, so the logs are the plain Trainer's), `toma_pack_tokens=` (True by default: a batch that carries an
    `attention_mask` is packed by tokens: rows sorted by length, micro-batches within a token budget, each trimmed
    to its longest row, as `toma.accumulate(lengths="attention_mask")`; the size is then that budget; False keeps
    micro-batches of rows in the loader's order, at the batch's padded width), `toma_split_for_padding=` (True by
    default: packing may split a batch that fits where the padding saved pays for another micro-batch; False keeps
    it whole, bit for bit), `toma_groups=` (how rows belong together: "pairs", "batch", a function of a batch,
    "rows"; by default what toma knows of TRL's trainers, `toma.integrations.trl`), `toma_gradient_sync=` (FSDP2).
    A padding-free batch (TRL's `padding_free`, its packing) is cut between its packed sequences.
    `trainer.toma_stats` holds the micro-batch size (or token budget) and the out-of-memory retries.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        trainer = transformers.Trainer
        if trainer in mro and mro.index(trainer) < mro.index(TomaTrainerMixin):
            raise TypeError(
                f"{cls.__name__}: TomaTrainerMixin must come before transformers.Trainer among the bases, "
                f"as in class {cls.__name__}(TomaTrainerMixin, {mro[1].__name__}), or its hooks are never called"
            )

    def __init__(
        self,
        *args: Any,
        toma_policy: Optional[SizePolicy] = None,
        toma_initial_micro_batch: Optional[int] = None,
        toma_weight: Optional[Count] = None,
        toma_log_micro_batch: bool = False,
        toma_pack_tokens: bool = True,
        toma_gradient_sync: str = "auto",
        toma_groups: Any = None,
        toma_split_for_padding: bool = True,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(name for name in kwargs if name.startswith("toma_"))
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown toma option(s) {', '.join(unknown)}; "
                f"the options are {', '.join(name + '=' for name in OPTIONS)}"
            )
        if not isinstance(self, transformers.Trainer):
            raise TypeError(
                f"{type(self).__name__} uses TomaTrainerMixin without transformers.Trainer: "
                "class MyTrainer(TomaTrainerMixin, transformers.Trainer)"
            )
        given = check_policy(toma_policy, "toma_policy")
        self.toma_initial_micro_batch = (
            WHOLE_BATCHES
            if toma_initial_micro_batch is None
            else check_size(toma_initial_micro_batch, "toma_initial_micro_batch")
        )
        self.toma_weight = check_weight(toma_weight)
        self._toma_weight_checked = False  # whether toma_weight was seen to count row by row
        self.toma_log_micro_batch = check_flag(toma_log_micro_batch, "toma_log_micro_batch")
        self.toma_pack_tokens = check_flag(toma_pack_tokens, "toma_pack_tokens")
        # checked as toma.accumulate checks them, named as given here
        self.toma_settings = AccumulationSettings.checked(
            prefix="toma_",
            gradient_sync=toma_gradient_sync,
            groups=toma_groups,
            split_for_padding=toma_split_for_padding,
        )
        self.toma_stats = AccumulationStats()
        # One size per trainer, for training and for evaluation: set once found, whatever the batch's length.
        self._toma_training = Runner(ACCUMULATION, policy=given, cache=GlobalBatchsizeCache())
        # distributed: per-chunk collectives (the Trainer's token count) need the ranks to chunk alike
        self._toma_evaluation = Runner(ACCUMULATION, policy=given, cache=GlobalBatchsizeCache(), distributed=True)
        super().__init__(*args, **kwargs)
        self._toma_trl = trl_trainer(self)
        self._toma_check_setup()
        if self._toma_trl == "GRPOTrainer":
            grpo.check_grpo(self)
        self._toma_known_groups = known_groups(self) if self._toma_trl else self._toma_trainer_groups()
        self._toma_record_rules = record_rules(self)
        self._toma_trainer_count = LabelCount(self._loss_shifts_labels)
        model = unwrap_peft_model(self.model)
        self._toma_model_count = LabelCount(self._loss_shifts_labels or is_causal_lm(model))

    @property
    def toma_policy(self) -> SizePolicy:
        """How micro-batch and evaluation chunk sizes are found: `toma_policy=`, else `toma.DEFAULT_POLICY` once
        assigned, else a FitToMemory (`toma.sizing.defaults.ACCUMULATION`)."""
        return self._toma_training.resolved_policy()

    @toma_policy.setter
    def toma_policy(self, policy: Optional[SizePolicy]) -> None:
        self._toma_training = self._toma_training.with_policy(policy)
        self._toma_evaluation = self._toma_evaluation.with_policy(policy)

    # The settings as attributes: `toma_settings`, checked where they enter (and again where one is assigned)
    toma_gradient_sync = SettingAttribute("toma_settings", "gradient_sync", "toma_")
    toma_groups = SettingAttribute("toma_settings", "groups", "toma_")
    toma_split_for_padding = SettingAttribute("toma_settings", "split_for_padding", "toma_")

    @property
    def _toma_fsdp2(self) -> bool:
        """Whether accelerate shards the model with FSDP2 (`fsdp_config={"fsdp_version": 2}`), which the
        accumulation handles (`toma.accumulation.sync.AgreeingFSDP2`); FSDP1 it refuses."""
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        return bool(self.is_fsdp_enabled) and getattr(plugin, "fsdp_version", 1) == 2

    def _toma_check_setup(self) -> None:
        """Setups whose collectives or optimizers run inside a step cannot be split into micro-batches."""
        refused = [
            (self.is_deepspeed_enabled, "DeepSpeed (args.deepspeed), which runs its own accumulation"),
            (
                self.is_fsdp_enabled and not self._toma_fsdp2,
                "FSDP1 (args.fsdp without fsdp_version 2), whose collectives run inside each forward pass; FSDP2 "
                '(fsdp_config={"fsdp_version": 2}) is supported',
            ),
            (
                self.toma_gradient_sync == "micro_batch" and not self._toma_fsdp2,
                "toma_gradient_sync='micro_batch', which reduce-scatters FSDP2's gradients: FSDP2 is not on "
                '(fsdp_config={"fsdp_version": 2})',
            ),
            (
                self.args.n_gpu > 1,
                f"DataParallel over {self.args.n_gpu} GPUs in one process; launch one process per GPU (torchrun)",
            ),
            (
                self.args.optim in (OptimizerNames.LOMO, OptimizerNames.ADALOMO),
                f"args.optim={OptimizerNames(self.args.optim).value!r}, which updates the weights inside each "
                "backward pass",
            ),
            (self.get_tp_size() > 1, "tensor parallelism, whose collectives run inside each forward pass"),
            (self.get_cp_size() > 1, "context parallelism, whose collectives run inside each forward pass"),
            (self.get_sp_size() > 1, "sequence parallelism, whose collectives run inside each forward pass"),
        ]
        for refuse, what in refused:
            if refuse:
                raise ValueError(f"{type(self).__name__} cannot split batches into micro-batches under {what}")
        if self.args.auto_find_batch_size:
            log.warning(
                "%s with auto_find_batch_size=True: toma handles out-of-memory errors inside each step, so the "
                "batch size never shrinks; leave auto_find_batch_size off",
                type(self).__name__,
            )

    # --- training ------------------------------------------------------------------------------------

    def _toma_count_for(self, inputs: Any, as_the_trainer_counts: bool = False) -> Optional[Count]:
        """What a batch's loss averages over: `toma_weight=`, else its label items (None: its rows). Counted as the
        Trainer counts `num_items_in_batch` when `as_the_trainer_counts`, else as the model's own mean counts them
        (the Trainer's label-smoothing rule: a causal language model's labels shifted)."""
        if self.toma_weight is not None:
            return self.toma_weight
        if not has_labels(inputs):
            return None
        return self._toma_evaluation_items if as_the_trainer_counts else self._toma_model_count

    def _toma_evaluation_items(self, chunk: Any) -> Any:
        """The `num_items_in_batch` the Trainer's `prediction_step` normalises a chunk's loss by: summed over the ranks
        where it averages tokens across devices (the ranks chunk alike), so the chunks are weighted by what divides
        them."""
        items = self._get_num_items_in_batch([chunk], self.args.device)
        return self._toma_trainer_count(chunk) if items is None else items

    def _toma_shares(self, inputs: Any, batch: Piece, num_items_in_batch: Any) -> Shares:
        if self._toma_trl == "GRPOTrainer":  # scaled for accumulation by itself; what it averages over, by loss type
            if grpo.summed(self):
                return Shares(None, None, batch.size, None, 1, summed=True)
            count = self.toma_weight if self.toma_weight is not None else grpo.grpo_shares(self)
            return Shares(count, None if count is None else count(inputs), batch.size, None, 1)
        declared = self.loss_is_scaled_for_ga
        if declared is not None:
            scaled = bool(declared)
        else:  # the Trainer's own rule: normalised by num_items_in_batch, by the model or compute_loss_func
            scaled = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        divisor = 1 if scaled else int(self.current_gradient_accumulation_steps)
        if declared is True and num_items_in_batch is None:
            # Normalised over the window by compute_loss itself, with nothing to scale: the micro-losses add up.
            return Shares(None, None, batch.size, None, 1, summed=True)
        count = self._toma_count_for(inputs)
        if count is None:
            return Shares(None, None, batch.size, num_items_in_batch, divisor)
        total = count(inputs)
        value = float(total)
        if value > 0:
            if count is self.toma_weight and not self._toma_weight_checked:
                check_additive(count, batch, value)
                self._toma_weight_checked = True
            return Shares(count, total, batch.size, num_items_in_batch, divisor)
        if not value == 0:
            raise ValueError(
                f"toma_weight must return a count of at least 0, got {value} for a batch of {batch.size} rows"
            )
        if count is self.toma_weight and has_labels(inputs):
            labelled = float(self._toma_model_count(inputs))
            if labelled > 0:
                raise ValueError(
                    f"toma_weight counted 0 items in a batch of {batch.size} rows whose labels hold {labelled:g}: "
                    "its micro-batches cannot be weighted, and the plain Trainer would train on this batch's loss. "
                    "toma_weight must return what the batch's loss averages over"
                )
        # Nothing to average over (every label -100): shares by rows give the plain Trainer's value all the same.
        return Shares(None, None, batch.size, num_items_in_batch, divisor)

    def training_step(
        self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Optional[Any] = None
    ) -> torch.Tensor:
        """The training step of the class (TRL's, a subclass's) around the Trainer's, as in a plain run; inside
        it, the Trainer's call of `compute_loss` on the batch trains it as one logical batch in micro-batches that
        fit (`_toma_logical_batch`). Returns what the plain step returns."""
        saved = self.__dict__.get("compute_loss", _NOTHING)
        self.__dict__["compute_loss"] = functools.partial(self._toma_logical_batch, own=saved)
        self._toma_reached = False
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        finally:
            if saved is _NOTHING:
                self.__dict__.pop("compute_loss", None)
            else:
                self.__dict__["compute_loss"] = saved
        if not self._toma_reached:
            _say_once(
                f"{type(self).__name__}: its training_step did not reach the Trainer's call of compute_loss, so toma "
                "did not split its batches into micro-batches"
            )
        return loss

    def _toma_logical_batch(
        self,
        model: torch.nn.Module,
        inputs: Any,
        return_outputs: bool = False,
        num_items_in_batch: Optional[Any] = None,
        *,
        own: Any = None,
    ) -> Any:
        """`compute_loss` on the step's batch: the batch's forward and backward passes in micro-batches, each
        through the class's `compute_loss` and `self.accelerator.backward`, gradients reduced across ranks once per
        batch. Returns the batch's loss as the plain `compute_loss` does, detached from the graph, so that the
        Trainer's own backward pass of it reaches no parameter (they hold the batch's gradients already)."""
        compute = own if own is not _NOTHING and own is not None else type(self).compute_loss.__get__(self)
        if return_outputs:  # the outputs of the whole batch: no micro-batches can give them
            return compute(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        self._toma_reached = True
        if self._toma_fsdp2 and not is_fsdp2(model):
            raise ValueError(
                f"{type(self).__name__}: accelerate shards with FSDP2 but the model the step gets is "
                f"{type(model).__name__}, not the fully_shard root; toma holds and reduces the root's units"
            )
        if self._toma_nothing_to_learn(inputs, num_items_in_batch):
            _say_once(
                f"{type(self).__name__}: a batch whose every label is -100 has nothing to learn from: toma skips it "
                "(no forward or backward pass: it changes nothing, and its loss is logged as 0, not NaN)"
            )
            return torch.zeros((), device=self.args.device).requires_grad_()
        packed = is_packed(inputs)  # cut between its sequences, whatever toma_pack_tokens says: rows cannot cut it
        groups, checked = self._toma_groups_for(packed)
        lengths = _PACKED if packed else "attention_mask" if self.toma_pack_tokens and _has_mask(inputs) else None
        batch = logical_batch_of((inputs,), {}, _PACKED if packed else None, groups, name="inputs")
        shares = dataclasses.replace(self._toma_shares(inputs, batch, num_items_in_batch), groups=groups)
        ranks = self.accelerator.num_processes > 1
        records = TrainerRecords(self, self._toma_record_rules, ranks=ranks)

        def micro_loss(micro: Any) -> torch.Tensor:
            items = shares.num_items_for(micro, inputs)
            share = shares.weight_of(micro, inputs)
            micro = copy.copy(micro)  # compute_loss may pop the labels; a retry needs them
            records.before_call(micro, share)
            loss = compute(model, micro, num_items_in_batch=items)
            records.after_call()
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"compute_loss must return the loss as a tensor, got {type(loss).__name__}")
            return loss

        divisor = shares.divisor

        def backward(loss: torch.Tensor) -> None:
            self.accelerator.backward(loss if divisor == 1 else loss / divisor)

        options = self.toma_settings.for_model(
            model,
            reduction="sum" if shares.summed else "mean",
            weight=shares.count,
            backward=backward,
            name=f"{type(self).__name__}.training_step",
            lengths=lengths,
            groups=groups,
            check_split=checked,
            rollback=records,
            # a router's load-balancing loss is not linear in the batch: split only where the batch does not fit
            split_for_padding=self.toma_split_for_padding and not getattr(self, "aux_loss_enabled", False),
        )
        sizing = Sizing(self.toma_initial_micro_batch, self._toma_training, stats=self.toma_stats)
        with local_collectives(self.accelerator) if ranks else contextlib.nullcontext():
            loss = accumulate(micro_loss, batch, options, sizing, total=shares.total)
        records.merge()
        return loss.detach().requires_grad_()

    def _toma_nothing_to_learn(self, inputs: Any, num_items_in_batch: Any) -> bool:
        """Whether a batch's labels count nothing, on every rank where there are several (the Trainer's
        `num_items_in_batch` counts them all): its loss would be a mean over nothing."""
        if self._toma_trl == "GRPOTrainer" or not has_labels(inputs):
            return False
        if num_items_in_batch is not None:
            return float(num_items_in_batch) == 0
        if self.accelerator.num_processes > 1:
            return False  # the other ranks' items are unknown here: this rank takes part with a loss of 0
        count = self._toma_count_for(inputs)
        return count is not None and float(count(inputs)) == 0

    def _toma_trainer_groups(self) -> Tuple[Optional[Groups], bool]:
        """The plain Trainer's loss is the model's own (a mean or sum over label tokens or rows): rows on their own,
        known. A `compute_loss` of a subclass or a `compute_loss_func` may relate them: checked."""
        for cls in type(self).__mro__:
            if cls is transformers.Trainer:
                break
            if "compute_loss" in vars(cls) and not cls.__module__.startswith("toma."):
                return None, False
        return ("rows", True) if self.compute_loss_func is None else (None, False)

    def _toma_groups_for(self, packed: bool) -> Tuple[Optional[Groups], bool]:
        """How the batch's rows belong together (`toma_groups=`, else what toma knows of the trainer), and whether
        the loss is checked before a batch is split (when that is not known)."""
        if packed:
            if self.toma_groups not in (None, "rows"):
                raise ValueError(
                    f"toma_groups={self.toma_groups!r} groups rows of a padded batch, but this batch is padding-free "
                    "(its sequences packed into one row): it is cut between its sequences"
                )
            return None, self._toma_known_groups[0] is None
        if self.toma_groups is not None:
            return self.toma_groups, False
        groups, known = self._toma_known_groups
        return groups, not known

    def log(self, logs: dict, *args: Any, **kwargs: Any) -> None:
        """The Trainer's log; with `toma_log_micro_batch`, the micro-batch size and the out-of-memory retries so far
        in training logs."""
        stats = self.toma_stats
        if self.toma_log_micro_batch and "loss" in logs and stats.micro_batch is not None:
            logs = {**logs, "micro_batch": stats.micro_batch, "toma_oom_retries": stats.oom_retries}
        super().log(logs, *args, **kwargs)

    # --- evaluation ----------------------------------------------------------------------------------

    def prediction_step(
        self, model: torch.nn.Module, inputs: Any, prediction_loss_only: bool, ignore_keys: Optional[List[str]] = None
    ) -> Tuple[Optional[torch.Tensor], Any, Any]:
        """The Trainer's prediction step (a subclass's included) over chunks of the batch's rows (a padding-free
        batch's packed sequences) that fit; the chunks' losses averaged over their items (or rows), their logits
        and labels joined; what the steps record per call (TRL's metrics) made one value per batch."""
        predict = super().prediction_step
        packed = is_packed(inputs)
        groups = self._toma_groups_for(packed)[0]  # DPO's pairs stay together here as in training
        if groups == "batch":  # never split: its rows relate to each other
            return predict(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        try:
            split = logical_batch_of((inputs,), {}, _PACKED if packed else None, groups, name="inputs")
        except ValueError:  # no rows to cut
            if groups not in (None, "rows"):
                raise  # a batch the grouping asked for does not have: an error, not a batch to run whole
            return predict(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if isinstance(split, PackedBatch) and split.rows != 1:
            return predict(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        # Each chunk's loss is the Trainer's, normalised by the Trainer's count when it passes one; a loss declared
        # normalised by compute_loss itself adds up.
        passes_count = self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        count = self._toma_count_for(inputs, as_the_trainer_counts=passes_count)
        summed = self.loss_is_scaled_for_ga is True and not passes_count
        # TRL's compute_loss gathers its metrics on every call: local while the chunks run, as in training. The plain
        # Trainer's gathers (its token count across devices) stay: every rank runs them at each chunk's start.
        ranks = self.accelerator.num_processes > 1 and self._toma_trl is not None
        records = TrainerRecords(self, self._toma_record_rules, ranks=ranks)
        chunks = _PredictionChunks(predict, split, model, prediction_loss_only, ignore_keys, count, summed, records)
        # FSDP2's forward passes all-gather: held unsharded, a chunk one rank redoes leaves no other waiting
        held: ContextManager[None] = contextlib.nullcontext()
        if self._toma_fsdp2 and is_fsdp2(model):
            from toma.accumulation.fsdp2 import held_unsharded

            held = held_unsharded(model)
        local = local_collectives(self.accelerator) if ranks else contextlib.nullcontext()
        records.begin()
        try:
            with held, local:
                found = self._toma_evaluation.perform(chunks, WHOLE_BATCHES).joined()
        except BaseException:
            records.undo()
            raise
        records.merge()
        return found


def _has_mask(inputs: Any) -> bool:
    """Whether a batch carries a (rows, width) `attention_mask` to pack its rows by."""
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    return isinstance(mask, torch.Tensor) and mask.dim() == 2


class _PredictionChunks(RangeStep):
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


class TomaTrainer(TomaTrainerMixin, transformers.Trainer):
    """`transformers.Trainer` whose loader batches train in micro-batches that fit, with the plain Trainer's
    gradients: change the import, keep the rest (see `TomaTrainerMixin` for the options)."""
