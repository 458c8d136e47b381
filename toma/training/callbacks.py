"""Callbacks of a training run: hooks called with the trainer after each step and epoch, and the exception that
ends the run cleanly."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the trainer calls the hooks; only its type is needed here
    from toma.training.trainer import Trainer

__all__ = ["Callback", "StopTraining"]


class StopTraining(Exception):
    """Raise it from a callback (or a loss function) to end `fit` cleanly after the current step."""


class Callback:
    """Hooks called with the trainer, which carries the state: `current_epoch` (epochs finished),
    `global_step`, `last_loss`, `history`, `micro_batch`, `oom_retries`, `memory`, `model`, `optimizer`."""

    def on_step_end(self, trainer: "Trainer") -> None:
        pass

    def on_epoch_end(self, trainer: "Trainer") -> None:
        pass
