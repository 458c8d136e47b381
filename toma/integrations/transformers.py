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
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
import transformers
from transformers.trainer_utils import unwrap_peft_model

from toma.accumulation.accumulate import AccumulationStats, MicroBatchSizing, accumulate
from toma.accumulation.coupling import CoupledRows, SplitCheck, check_split_once
from toma.accumulation.gradient_cache import CutCalls, with_calls_cut
from toma.accumulation.options import AccumulationSettings, SettingAttribute, check_flag
from toma.accumulation.sharded_models import is_fsdp2
from toma.batching.logical import Piece, logical_batch_of
from toma.batching.packed import PackedBatch, is_packed
from toma.core.arguments import check_size
from toma.core.caches import GlobalBatchsizeCache
from toma.core.oom import should_reduce_batch_size
from toma.core.policy import SizePolicy, check_policy
from toma.core.runner import Runner
from toma.integrations import grpo
from toma.integrations.local_collectives import local_collectives
from toma.integrations.sentence_transformers import prefixed_masks, summed_lengths, trimmed_columns
from toma.integrations.trainer_records import TrainerRecords
from toma.integrations.transformers_chunks import PredictionChunks, held_for_chunks
from toma.integrations.transformers_setup import OPTIONS as OPTIONS  # the toma_ options, named here as before
from toma.integrations.transformers_setup import (
    check_options,
    check_setup,
    checkpoint_as_the_trainer,
    fsdp2_on,
    groups_for,
    say_once,
    trainer_groups,
)
from toma.integrations.transformers_shares import (
    Count,
    LabelCount,
    Shares,
    check_weight,
    has_labels,
    has_mask,
    is_causal_lm,
    nothing_to_learn,
    trainer_shares,
)
from toma.integrations.trl import known_groups, record_rules, trl_trainer
from toma.integrations.versions import require
from toma.sizing.defaults import ACCUMULATION
from toma.training.data import WHOLE_BATCHES

__all__ = ["TomaTrainerMixin", "TomaTrainer"]

MINIMUM_TRANSFORMERS = "5.23"  # the Trainer's `loss_is_scaled_for_ga`, which says how it scales the loss
require("transformers", transformers.__version__, MINIMUM_TRANSFORMERS, "transformers")

log = logging.getLogger("toma")


_NOTHING = object()  # no instance attribute of that name
_PACKED = "position_ids"  # what a padding-free batch's sequences are found by (or its cu_seq_lens, seq_idx)
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
    to its longest row, as `toma.accumulate(lengths="attention_mask")`; the size is then that budget; a batch of
    sentence-transformers' columns (`anchor_attention_mask`, ...) is packed by each row's tokens over its columns and
    each column trimmed to its longest row in a micro-batch; False keeps
    micro-batches of rows in the loader's order, at the batch's padded width), `toma_split_for_padding=` (True by
    default: packing may split a batch that fits where the padding saved pays for another micro-batch; False keeps
    it whole, bit for bit), `toma_groups=` (how rows belong together: "pairs", "batch", a function of a batch,
    "rows"; by default what toma knows of TRL's trainers, `toma.integrations.trl`), `toma_gradient_sync=` (FSDP2),
    `toma_levers=` (True by default: where one row does not fit, the model's activation checkpointing, thrown with
    `args.activation_checkpointing_kwargs`, for that step; False: the error).
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
        toma_levers: bool = True,
        **kwargs: Any,
    ) -> None:
        check_options(self, kwargs)
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
            levers=toma_levers,
        )
        self.toma_stats = AccumulationStats()
        # One size per trainer, for training and for evaluation: set once found, whatever the batch's length.
        self._toma_training = Runner(ACCUMULATION, policy=given, cache=GlobalBatchsizeCache())
        # distributed: per-chunk collectives (the Trainer's token count) need the ranks to chunk alike
        self._toma_evaluation = Runner(ACCUMULATION, policy=given, cache=GlobalBatchsizeCache(), distributed=True)
        # whether the evaluation loss couples rows (then never averaged over chunks: `_toma_predict_cut`)
        self._toma_eval_coupling = SplitCheck()
        # several losses (sentence-transformers' dict, chosen by a batch's dataset_name): each its own checks
        self._toma_loss_checks: Dict[str, Tuple[SplitCheck, SplitCheck]] = {}
        super().__init__(*args, **kwargs)
        self._toma_trl = trl_trainer(self)
        self._toma_check_setup()
        if self._toma_trl == "GRPOTrainer":
            grpo.check_grpo(self)
        self._toma_known_groups = known_groups(self) if self._toma_trl else trainer_groups(self)
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
    toma_levers = SettingAttribute("toma_settings", "levers", "toma_")

    @property
    def _toma_fsdp2(self) -> bool:
        """Whether accelerate shards the model with FSDP2, which the accumulation handles; FSDP1 it refuses."""
        return fsdp2_on(self)

    def _toma_check_setup(self) -> None:
        """Setups whose collectives or optimizers run inside a step cannot be split into micro-batches."""
        check_setup(self, self.toma_gradient_sync)

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
        """Each micro-batch's share of the batch (`toma.integrations.transformers_shares.trainer_shares`); GRPO's by
        its loss type, which scales for accumulation by itself."""
        if self._toma_trl == "GRPOTrainer":
            if grpo.summed(self):
                return Shares(None, None, batch.size, None, 1, summed=True)
            count = self.toma_weight if self.toma_weight is not None else grpo.grpo_shares(self)
            return Shares(count, None if count is None else count(inputs), batch.size, None, 1)
        weight, count = self.toma_weight, self._toma_count_for(inputs)
        shares = trainer_shares(
            self,
            inputs,
            batch,
            num_items_in_batch,
            count,
            self._toma_model_count,
            weight,
            not self._toma_weight_checked,
        )
        if weight is not None and shares.count is weight:  # seen to add up: checked once
            self._toma_weight_checked = True
        return shares

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
            say_once(
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
        labelled = self._toma_trl != "GRPOTrainer"  # GRPO's loss averages over no labels
        if labelled and nothing_to_learn(
            inputs, num_items_in_batch, self.accelerator.num_processes, self._toma_count_for
        ):
            say_once(
                f"{type(self).__name__}: a batch whose every label is -100 has nothing to learn from: toma skips it "
                "(no forward or backward pass: it changes nothing, and its loss is logged as 0, not NaN)"
            )
            return torch.zeros((), device=self.args.device).requires_grad_()
        return self._toma_accumulate(compute, model, inputs, num_items_in_batch)

    def _toma_checks_for(self, inputs: Any) -> None:
        """Put in place the split checks (training's, evaluation's) of the loss this batch is computed with, where the
        trainer has several: sentence-transformers' dict of losses, chosen per batch by its `dataset_name` (one
        loss's verdict, independent rows, must not decide how another, in-batch negatives, is cut)."""
        losses = getattr(self, "loss", None)
        name = inputs.get("dataset_name") if isinstance(losses, dict) and isinstance(inputs, Mapping) else None
        if not isinstance(name, str):
            return
        if name not in self._toma_loss_checks:
            self._toma_loss_checks[name] = (SplitCheck(), SplitCheck())
        self.toma_stats.split_check, self._toma_eval_coupling = self._toma_loss_checks[name]

    def _toma_whole(
        self,
        compute: Callable[..., Any],
        model: torch.nn.Module,
        inputs: Any,
        num_items_in_batch: Any,
        reason: ValueError,
    ) -> torch.Tensor:
        """A batch toma cannot cut into rows runs whole, as the plain Trainer runs it (its loss returned with its graph,
        for the Trainer's own backward pass); an out-of-memory error in it says why toma could not help."""
        say_once(
            f"{type(self).__name__}: a batch toma cannot cut into rows runs whole, as the plain Trainer runs it: {reason}"
        )
        try:
            return compute(model, inputs, num_items_in_batch=num_items_in_batch)  # type: ignore[no-any-return]
        except BaseException as error:
            if should_reduce_batch_size(error):
                error.add_note(f"toma: this batch ran whole, as it cannot be cut into rows ({reason})")
            raise

    def _toma_accumulate(
        self, compute: Callable[..., Any], model: torch.nn.Module, inputs: Any, num_items_in_batch: Any
    ) -> torch.Tensor:
        """The batch as one logical batch through `accumulate`: each micro-batch's `compute_loss` given its share of
        `num_items_in_batch` and weighted by it, its backward through the accelerator; the records made one."""
        packed = is_packed(inputs)  # cut between its sequences, whatever toma_pack_tokens says: rows cannot cut it
        groups, checked = groups_for(packed, self.toma_groups, self._toma_known_groups)
        # sentence-transformers' columns (`anchor_attention_mask`, ...): packed by each row's tokens over its columns,
        # each column of a micro-batch trimmed to its longest row there
        columns = not packed and self.toma_pack_tokens and not has_mask(inputs) and bool(prefixed_masks(inputs))
        lengths: Any = None
        if packed:
            lengths = _PACKED
        elif self.toma_pack_tokens and has_mask(inputs):
            lengths = "attention_mask"
        elif columns:
            lengths = summed_lengths
        self._toma_checks_for(inputs)
        try:
            batch = logical_batch_of((inputs,), {}, _PACKED if packed else None, groups, name="inputs")
        except ValueError as reason:  # no rows to cut (a StaticEmbedding's flattened token ids with their offsets)
            if groups not in (None, "rows"):
                raise  # a batch the grouping asked for does not have: an error, not a batch to run whole
            return self._toma_whole(compute, model, inputs, num_items_in_batch, reason)
        shares = dataclasses.replace(self._toma_shares(inputs, batch, num_items_in_batch), groups=groups)
        ranks = self.accelerator.num_processes > 1
        records = TrainerRecords(self, self._toma_record_rules, ranks=ranks)

        def micro_loss(micro: Any) -> torch.Tensor:
            items = shares.num_items_for(micro, inputs)
            share = shares.weight_of(micro, inputs)
            micro = copy.copy(trimmed_columns(micro) if columns else micro)  # compute_loss may pop the labels
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
        sizing = MicroBatchSizing(self.toma_initial_micro_batch, self._toma_training, stats=self.toma_stats)
        checkpoint_as_the_trainer(self)  # where one row does not fit: the switch as the Trainer would throw it
        try:
            with local_collectives(self.accelerator) if ranks else contextlib.nullcontext():
                loss = accumulate(micro_loss, batch, options, sizing, total=shares.total)
        except CoupledRows as refused:  # its remedies in the words this trainer takes
            refused.args = (with_trainer_keywords(str(refused)),) + refused.args[1:]
            raise
        records.merge()
        return loss.detach().requires_grad_()

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
        self._toma_checks_for(inputs)
        packed = is_packed(inputs)
        # DPO's pairs stay together here as in training
        groups = groups_for(packed, self.toma_groups, self._toma_known_groups)[0]
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
        chunks = PredictionChunks(predict, split, model, prediction_loss_only, ignore_keys, count, summed, records)
        held = held_for_chunks(model) if self._toma_fsdp2 else contextlib.nullcontext()
        local = local_collectives(self.accelerator) if ranks else contextlib.nullcontext()
        coupling = self._toma_eval_coupling
        cut = coupling.coupled or (self.toma_stats.split_check.coupled and groups is None)
        records.begin()
        try:
            with held, local:
                if cut:  # a loss that couples rows: the whole batch's, its model calls cut (`_toma_predict_cut`)
                    found = self._toma_predict_cut(predict, model, inputs, prediction_loss_only, ignore_keys, records)
                else:
                    found = self._toma_evaluation.perform(chunks, WHOLE_BATCHES).joined()
                if not cut and len(chunks.chunks) > 1 and found[0] is not None and not coupling.done and groups is None:
                    if self._toma_chunks_couple(chunks, split, count, summed, records):
                        records.undo()
                        records.begin()
                        found = self._toma_predict_cut(
                            predict, model, inputs, prediction_loss_only, ignore_keys, records
                        )
        except BaseException:
            records.undo()
            raise
        records.merge()
        return found

    def _toma_chunks_couple(
        self, chunks: PredictionChunks, split: Any, count: Any, summed: bool, records: TrainerRecords
    ) -> bool:
        """Once, where an evaluation batch ran in chunks: whether its loss is what its parts add up to (the first
        chunk's loss against its halves', `toma.accumulation.coupling`), so that a loss that couples rows is never
        reported as an average of chunks. The check's calls record nothing."""
        coupling = self._toma_eval_coupling
        start, stop = chunks.chunks[0][0], chunks.chunks[1][0]
        calls = records.calls
        predict = chunks.predict

        def loss_of(part: Any) -> Any:
            records.before_call(part, 1.0)
            loss = predict(chunks.model, part, True, ignore_keys=chunks.ignore_keys)[0]
            records.after_call()
            return loss

        def weight_of(piece: Any, a: int, b: int, arguments: Any) -> Optional[float]:
            counted = float(count(arguments[0][0])) if count is not None else float(piece.rows_between(a, b))
            return counted if counted > 0 else None

        arguments_of = lambda piece, a, b, width: piece.arguments(a, b)  # noqa: E731
        name = f"{type(self).__name__}.prediction_step"

        def cut_loss(arguments: Any) -> Any:  # two rows that do not fit together: the model's calls one row at a time
            trusted = SplitCheck()
            trusted.rows_checked = True
            return with_calls_cut(chunks.model, 1, loss_of, arguments, trusted, name)

        try:
            check_split_once(
                coupling, loss_of, chunks.model, split, start, stop, None, arguments_of, weight_of, summed, name,
                cut_loss,
            )  # fmt: skip
        except CoupledRows as found:
            coupling.coupled = coupling.done = True
            log.info(
                "toma: %s: the evaluation loss couples rows (%s): each batch's loss is computed whole, the model's "
                "calls cut into chunks",
                name,
                str(found).split(": the loss is not")[0],
            )
        finally:
            records.rewind(calls)
        return coupling.coupled

    def _toma_predict_cut(
        self,
        predict: Callable[..., Any],
        model: torch.nn.Module,
        inputs: Any,
        prediction_loss_only: bool,
        ignore_keys: Optional[List[str]],
        records: TrainerRecords,
    ) -> Tuple[Optional[torch.Tensor], Any, Any]:
        """The prediction step on the whole batch, every call of the model cut into chunks that fit
        (`toma.accumulation.gradient_cache.with_calls_cut`): the loss of a loss that couples rows, exactly."""
        name = f"{type(self).__name__}.prediction_step"

        def predicted(*args: Any, **kwargs: Any) -> Tuple[Optional[torch.Tensor], Any, Any]:
            calls = records.calls
            records.before_call(inputs, 1.0)
            try:
                found = predict(*args, **kwargs)
            except BaseException:
                records.rewind(calls)
                raise
            records.after_call()
            return found  # type: ignore[no-any-return]

        arguments = ((model, inputs, prediction_loss_only), {"ignore_keys": ignore_keys})
        rows = logical_batch_of((inputs,), {}, None, None, name="inputs").largest
        step = CutCalls(model, predicted, arguments, rows, self._toma_eval_coupling, name)
        return self._toma_evaluation.perform(step, WHOLE_BATCHES).result  # type: ignore[no-any-return]


def with_trainer_keywords(text: str) -> str:
    """A message of toma's that names `toma.accumulate`'s keywords, naming the trainer's (`groups=` is
    `toma_groups=` there, `weight=` is `toma_weight=`)."""
    return re.sub(r"(?<![\w.])(groups|weight)=", r"toma_\1=", text)


class TomaTrainer(TomaTrainerMixin, transformers.Trainer):
    """`transformers.Trainer` whose loader batches train in micro-batches that fit, with the plain Trainer's
    gradients: change the import, keep the rest (see `TomaTrainerMixin` for the options)."""
