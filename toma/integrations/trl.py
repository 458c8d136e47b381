"""What toma knows of TRL's trainers (1.16), for `TomaTrainerMixin`: how their batches' rows belong together and how
the metrics their `compute_loss` records per call make one value per batch. Nothing here imports TRL: a trainer is
recognised by the TRL classes among its bases.

- `SFTTrainer`: rows (or packed sequences) on their own; `entropy` and `mean_token_accuracy` average over label
  tokens (after the causal shift), `num_tokens` is the running `_total_train_tokens`.
- `DPOTrainer`: the chosen rows first, the rejected rows second, paired by halving the batch (`groups="pairs"`);
  `entropy` averages over completion tokens, `logits/chosen` and `mean_token_accuracy` over the chosen ones,
  `logits/rejected` over the rejected ones, the rewards and log-probabilities over pairs. Its `aot` and
  `aot_unpaired` losses sort the pairs of a batch against each other and its `sft` loss averages over the batch's
  chosen tokens (so that, beside a pairwise loss, no one share weights both): with those a batch is never split
  (`groups="batch"`): it trains whole, or, when it does not fit, its out-of-memory error is raised with a note.
- `RewardTrainer`: pairs as DPO's; `min_reward`/`max_reward` are a minimum and a maximum over rows.
- `GRPOTrainer`: completions on their own (their advantages computed at generation, before the split); its loss
  types' shares and metrics in `toma.integrations.grpo`.

Any other key a trainer records is averaged over the micro-batches' shares of the batch (their label tokens, or
rows), which is the batch's value where the metric averages over what the loss does.
"""

from typing import Any, Dict, Optional, Tuple

import torch

from toma.integrations.grpo import grpo_rules
from toma.integrations.trainer_records import MetricRule, RecordRules

__all__ = ["trl_trainer", "record_rules", "known_groups", "KNOWN_TRAINERS"]

KNOWN_TRAINERS = ("SFTTrainer", "DPOTrainer", "RewardTrainer", "GRPOTrainer")

# DPO's losses that score each pair on its own; the others relate a batch's pairs (aot) or its tokens (sft).
DPO_PAIRWISE_LOSSES = frozenset(
    {
        "sigmoid",
        "hinge",
        "ipo",
        "exo_pair",
        "nca_pair",
        "robust",
        "bco_pair",
        "sppo_hard",
        "apo_zero",
        "apo_down",
        "discopop",
        "sigmoid_norm",
    }
)

_COUNTER = "_total_train_tokens"


def trl_trainer(trainer: Any) -> Optional[str]:
    """The TRL trainer class `trainer` is (or derives from), by name; None for any other trainer."""
    for cls in type(trainer).__mro__:
        if cls.__module__.startswith("trl.") and cls.__name__ in KNOWN_TRAINERS:
            return cls.__name__
    return None


def _overrides_compute_loss(trainer: Any, known: str) -> bool:
    """Whether a class between the trainer's own and TRL's overrides `compute_loss` (then TRL's structure is not
    known to hold)."""
    for cls in type(trainer).__mro__:
        if cls.__name__ == known and cls.__module__.startswith("trl."):
            return False
        if "compute_loss" in vars(cls) and not cls.__module__.startswith("toma."):
            return True
    return False


def known_groups(trainer: Any) -> Tuple[Optional[str], bool]:
    """How a known TRL trainer's rows belong together, and whether that is known to hold for its loss (else it is
    checked before a batch is split): ("rows", True) for SFT, ("pairs", ...) for DPO and reward models ("batch"
    for DPO's losses that relate a batch's pairs); (None, False) for any other trainer."""
    known = trl_trainer(trainer)
    if known is None:
        return None, False
    own = not _overrides_compute_loss(trainer, known)
    if known in ("SFTTrainer", "GRPOTrainer"):
        return "rows", own
    if known == "DPOTrainer":
        losses = set(getattr(trainer, "loss_types", None) or [getattr(trainer, "loss_type", "sigmoid")])
        if losses <= DPO_PAIRWISE_LOSSES:
            return "pairs", own
        return "batch", True  # the pairs of a batch relate to each other: never split (run whole, or refused)
    return "pairs", own


def _shifted(mask: torch.Tensor) -> torch.Tensor:
    return mask[..., 1:]


def _completion_tokens(inputs: Any) -> Any:
    return _shifted(inputs["completion_mask"]).sum()


def _chosen_tokens(inputs: Any) -> Any:
    return _shifted(inputs["completion_mask"]).chunk(2, dim=0)[0].sum()


def _rejected_tokens(inputs: Any) -> Any:
    return _shifted(inputs["completion_mask"]).chunk(2, dim=0)[1].sum()


def _label_tokens(inputs: Any) -> Any:
    labels = inputs.get("shift_labels")
    labels = _shifted(inputs["labels"]) if labels is None else labels
    return (labels != -100).sum()


def record_rules(trainer: Any) -> RecordRules:
    """How `trainer`'s records make one value per batch (TRL's `_metrics`; the default rule for other trainers)."""
    known = trl_trainer(trainer)
    counter = MetricRule("counter", counter=_COUNTER)
    rules: Dict[str, MetricRule] = {}
    if known == "SFTTrainer":
        rules = {
            "entropy": MetricRule(weight=_label_tokens),
            "mean_token_accuracy": MetricRule(weight=_label_tokens),
            "num_tokens": counter,
        }
    elif known == "DPOTrainer":
        rules = {
            "entropy": MetricRule(weight=_completion_tokens),
            "logits/chosen": MetricRule(weight=_chosen_tokens),
            "logits/rejected": MetricRule(weight=_rejected_tokens),
            "mean_token_accuracy": MetricRule(weight=_chosen_tokens),
            "num_tokens": counter,
        }
    elif known == "RewardTrainer":
        rules = {"min_reward": MetricRule("min"), "max_reward": MetricRule("max"), "num_tokens": counter}
    elif known == "GRPOTrainer":
        rules = grpo_rules(trainer)
    if known is None:
        return RecordRules()
    return RecordRules(rules=rules, counters=(_COUNTER,))
