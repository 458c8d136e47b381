"""What a TomaTrainer checks once and knows of its Trainer: its `toma_` options, the setups it refuses (DeepSpeed,
FSDP1, tensor parallelism, ...), whether accelerate shards with FSDP2, and how a batch's rows belong together."""

import logging
from typing import Any, Dict, Optional, Tuple

import transformers
from transformers.training_args import OptimizerNames

from toma.batching.groups import Groups
from toma.levers.checkpointing import checkpoint_with

__all__ = [
    "OPTIONS",
    "check_options",
    "checkpoint_as_the_trainer",
    "check_setup",
    "fsdp2_on",
    "trainer_groups",
    "groups_for",
    "say_once",
]

log = logging.getLogger("toma")
_said: set = set()


def say_once(text: str) -> None:
    """A warning given once per process, for what every step would repeat."""
    if text not in _said:
        _said.add(text)
        log.warning(text)


OPTIONS = (
    "toma_policy",
    "toma_initial_micro_batch",
    "toma_weight",
    "toma_log_micro_batch",
    "toma_pack_tokens",
    "toma_gradient_sync",
    "toma_groups",
    "toma_split_for_padding",
    "toma_levers",
)


def check_options(trainer: object, kwargs: Dict[str, Any]) -> None:
    """A `toma_` keyword that is no option, or the mixin without `transformers.Trainer`: an error naming it."""
    unknown = sorted(name for name in kwargs if name.startswith("toma_"))
    if unknown:
        raise TypeError(
            f"{type(trainer).__name__} got unknown toma option(s) {', '.join(unknown)}; "
            f"the options are {', '.join(name + '=' for name in OPTIONS)}"
        )
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(
            f"{type(trainer).__name__} uses TomaTrainerMixin without transformers.Trainer: "
            "class MyTrainer(TomaTrainerMixin, transformers.Trainer)"
        )


def checkpoint_as_the_trainer(trainer: transformers.Trainer) -> None:
    """The memory lever throws the model's activation-checkpointing switch as the Trainer's own
    `args.activation_checkpointing` would: with `args.activation_checkpointing_kwargs` (`use_reentrant=False` unless
    they say otherwise). Where the user turned it on, the lever leaves it as it is."""
    args = trainer.args
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or getattr(
        args, "gradient_checkpointing_kwargs", None
    )
    if trainer.model is not None:
        checkpoint_with(trainer.model, kwargs if isinstance(kwargs, dict) else None)


def fsdp2_on(trainer: transformers.Trainer) -> bool:
    """Whether accelerate shards the model with FSDP2 (`fsdp_config={"fsdp_version": 2}`), which the
    accumulation handles (`toma.accumulation.sync.AgreeingFSDP2`); FSDP1 it refuses."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return bool(trainer.is_fsdp_enabled) and getattr(plugin, "fsdp_version", 1) == 2


def check_setup(trainer: transformers.Trainer, gradient_sync: str) -> None:
    """Setups whose collectives or optimizers run inside a step cannot be split into micro-batches: refused by
    name; `auto_find_batch_size`, which toma makes useless, warned of."""
    refused = [
        (trainer.is_deepspeed_enabled, "DeepSpeed (args.deepspeed), which runs its own accumulation"),
        (
            trainer.is_fsdp_enabled and not fsdp2_on(trainer),
            "FSDP1 (args.fsdp without fsdp_version 2), whose collectives run inside each forward pass; FSDP2 "
            '(fsdp_config={"fsdp_version": 2}) is supported',
        ),
        (
            gradient_sync in ("micro_batch", "sharded") and not fsdp2_on(trainer),
            f"toma_gradient_sync={gradient_sync!r}, which is for FSDP2's gradients: FSDP2 is not on "
            '(fsdp_config={"fsdp_version": 2})',
        ),
        (
            trainer.args.n_gpu > 1,
            f"DataParallel over {trainer.args.n_gpu} GPUs in one process; launch one process per GPU (torchrun)",
        ),
        (
            trainer.args.optim in (OptimizerNames.LOMO, OptimizerNames.ADALOMO),
            f"args.optim={OptimizerNames(trainer.args.optim).value!r}, which updates the weights inside each "
            "backward pass",
        ),
        (trainer.get_tp_size() > 1, "tensor parallelism, whose collectives run inside each forward pass"),
        (trainer.get_cp_size() > 1, "context parallelism, whose collectives run inside each forward pass"),
        (trainer.get_sp_size() > 1, "sequence parallelism, whose collectives run inside each forward pass"),
    ]
    for refuse, what in refused:
        if refuse:
            raise ValueError(f"{type(trainer).__name__} cannot split batches into micro-batches under {what}")
    if trainer.args.auto_find_batch_size:
        log.warning(
            "%s with auto_find_batch_size=True: toma handles out-of-memory errors inside each step, so the "
            "batch size never shrinks; leave auto_find_batch_size off",
            type(trainer).__name__,
        )


def trainer_groups(trainer: transformers.Trainer) -> Tuple[Optional[Groups], bool]:
    """The plain Trainer's loss is the model's own (a mean or sum over label tokens or rows): rows on their own,
    known. A `compute_loss` of a subclass or a `compute_loss_func` may relate them: checked."""
    for cls in type(trainer).__mro__:
        if cls is transformers.Trainer:
            break
        if "compute_loss" in vars(cls) and not cls.__module__.startswith("toma."):
            return None, False
    return ("rows", True) if trainer.compute_loss_func is None else (None, False)


def groups_for(
    packed: bool, given: Optional[Groups], known: Tuple[Optional[Groups], bool]
) -> Tuple[Optional[Groups], bool]:
    """How the batch's rows belong together (`toma_groups=`, `given`, else what toma knows of the trainer), and
    whether the loss is checked before a batch is split (when that is not known)."""
    if packed:
        if given not in (None, "rows"):
            raise ValueError(
                f"toma_groups={given!r} groups rows of a padded batch, but this batch is padding-free "
                "(its sequences packed into one row): it is cut between its sequences"
            )
        return None, known[0] is None
    if given is not None:
        return given, False
    groups, is_known = known
    return groups, not is_known
