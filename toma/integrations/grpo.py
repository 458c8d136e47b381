"""TRL's `GRPOTrainer` under `TomaTrainerMixin`: what its loss averages over, how its metrics make one value per
batch, and the settings that cannot be split.

GRPO generates its completions in the Trainer's `_prepare_inputs`, once per step (or once per
`steps_per_generation` steps, buffered), before `compute_loss`: toma splits only the loss over those completions,
so a retry never generates again, and GRPO's own `training_step` around it advances its step counter once per
step. Its loss divides by the accumulation steps itself (`loss_is_scaled_for_ga`), and what a micro-batch's loss is
a share of depends on the loss type:

- `grpo`, `sapo`, `luspo` (a mean over completions of each one's loss) and `dr_grpo` (a sum over the batch's
  tokens over completions x `max_completion_length`): shares by completions (rows);
- `bnpo` (a mean over the batch's completion tokens): shares by completion tokens;
- `dapo`, `cispo`, `vespo` (normalised by a count of the whole generation batch the inputs carry): the micro-losses
  add up as they are.

Refused, with an error that names the setting: `top_entropy_quantile` below 1 (its token mask is a quantile over
the batch), the adaptive entropy controller (it reduces across ranks inside `compute_loss`), and a static entropy
bonus beside any loss but `bnpo` (a mean over tokens, which the shares of a mean over completions would weight
wrongly).
"""

from typing import Any, Callable, Dict, Optional

from toma.integrations.trainer_records import MetricRule

__all__ = ["GRPO_SHARES", "grpo_shares", "summed", "check_grpo", "grpo_rules"]

GRPO_SHARES = {
    "grpo": "rows",
    "sapo": "rows",
    "luspo": "rows",
    "dr_grpo": "rows",
    "bnpo": "tokens",
    "dapo": "summed",
    "cispo": "summed",
    "vespo": "summed",
}
"""What each GRPO loss type's micro-batch losses are shares of."""


def _completion_tokens(inputs: Any) -> Any:
    """The tokens GRPO's loss and its token metrics average over: the completion mask (with the tool mask)."""
    mask = inputs["completion_mask"]
    tools = inputs.get("tool_mask")
    return (mask if tools is None else mask * tools).sum()


def _completions(inputs: Any) -> Any:
    return inputs["completion_mask"].shape[0]


def grpo_shares(trainer: Any) -> Optional[Callable[[Any], Any]]:
    """What a micro-batch's share of the batch counts: completion tokens (`bnpo`), or None (completions, and for
    the loss types whose micro-losses add up, see `summed`)."""
    share = GRPO_SHARES[trainer.loss_type]
    return _completion_tokens if share == "tokens" else None


def summed(trainer: Any) -> bool:
    """Whether the loss type's micro-batch losses add up as they are (normalised by a count the inputs carry)."""
    return GRPO_SHARES[trainer.loss_type] == "summed"


def check_grpo(trainer: Any) -> None:
    """The GRPO settings whose loss cannot be split into micro-batches, refused by name."""
    name = type(trainer).__name__
    loss_type = getattr(trainer, "loss_type", None)
    if loss_type not in GRPO_SHARES:
        raise ValueError(
            f"{name}: loss_type={loss_type!r} is not a GRPO loss toma knows how to split ({', '.join(GRPO_SHARES)})"
        )
    refused = []
    if getattr(trainer, "top_entropy_quantile", 1.0) < 1.0:
        refused.append(
            f"top_entropy_quantile={trainer.top_entropy_quantile} (the tokens it trains are a quantile of the whole "
            "batch's entropies)"
        )
    if getattr(trainer, "use_adaptive_entropy", False):
        refused.append("use_adaptive_entropy=True (its controller reduces across ranks inside compute_loss)")
    elif getattr(trainer, "entropy_coef", 0.0) != 0.0 and loss_type != "bnpo":
        refused.append(
            f"entropy_coef={trainer.entropy_coef} with loss_type={loss_type!r} (the bonus is a mean over tokens, the "
            "loss a mean over completions: no one share weights both; loss_type='bnpo' averages both over tokens)"
        )
    if refused:
        raise ValueError(f"{name} cannot split GRPO's loss into micro-batches under {'; '.join(refused)}")


def grpo_rules(trainer: Any) -> Dict[str, MetricRule]:
    """How GRPO's per-call metrics make one value per batch: its masked means over completion tokens (over
    completions where importance sampling is per sequence), minima and maxima."""
    tokens = MetricRule(weight=_completion_tokens)
    ratios = MetricRule(weight=_completion_tokens if trainer.importance_sampling_level == "token" else _completions)
    return {
        "kl": tokens,
        "entropy": tokens,
        "clip_ratio/low_mean": ratios,
        "clip_ratio/high_mean": ratios,
        "clip_ratio/region_mean": ratios,
        "cispo_clip_ratio": ratios,
        "vespo/phi_seq_mean": MetricRule(weight=_completions),  # one weight per completion
        "clip_ratio/low_min": MetricRule("min"),
        "clip_ratio/high_max": MetricRule("max"),
    }
