"""What a logical batch's micro-batches run with under `MicroBatching`: the LightningModule as `toma.accumulate`'s
model, its own training step once per micro-batch, the gradients set aside while they run, and the loss whose
backward pass hands Lightning the logical batch's gradients (`LogicalBatchLoss`)."""

import contextlib
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import lightning.pytorch as pl
import torch

from toma.integrations.lightning_logs import StepLogs

__all__ = [
    "HeldGradients",
    "LogicalBatchLoss",
    "ModuleAsModel",
    "AsReturned",
    "MicroBatchStep",
    "autograd_backward",
    "micro_batch_region",
    "NOT_SET",
]


class HeldGradients:
    """The logical batch's gradients, one per parameter (None: the batch gave it none), and the loss scale the
    micro-batches' backward passes were multiplied by (None: no scaler)."""

    __slots__ = ("grads", "scale")

    def __init__(self, grads: List[Optional[torch.Tensor]], scale: Optional[torch.Tensor]) -> None:
        self.grads: Optional[List[Optional[torch.Tensor]]] = grads
        self.scale = scale

    def take(self, grad_output: torch.Tensor) -> List[Optional[torch.Tensor]]:
        """The gradients times `grad_output` (what reached the loss) over the scale they already carry, handed
        over: kept nowhere else, so autograd can use them as `.grad` without a copy."""
        grads, self.grads = self.grads, None
        if grads is None:
            raise RuntimeError("the logical batch's loss can only be backpropagated once")
        factor = grad_output if self.scale is None else grad_output / self.scale
        for grad in grads:
            if grad is not None:
                grad.mul_(factor)
        return grads


class LogicalBatchLoss(torch.autograd.Function):
    """The logical batch's loss (already computed, with its gradients, in micro-batches) as a tensor of the
    parameters' graph: its backward pass gives each parameter the logical batch's gradient times the gradient
    that reached the loss (Lightning's 1 / `accumulate_grad_batches`, a scaler's scale)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, gradients: HeldGradients, *params: torch.Tensor) -> torch.Tensor:
        ctx.gradients = gradients
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        gradients: HeldGradients = ctx.gradients
        return (None, None, *gradients.take(grad_output))


class ModuleAsModel(torch.nn.Module):
    """The LightningModule as `toma.accumulate`'s model, with what the micro-batches left for the logical batch
    (their `self.log` calls, whether each returned a loss) as its pending state
    (`toma.accumulation.rollback.PendingState`): a failed attempt's share is dropped with its gradients."""

    def __init__(self, module: pl.LightningModule, logs: StepLogs) -> None:
        super().__init__()
        self.module = module
        self.logs = logs
        self.returned: List[bool] = []  # per micro-batch: it returned a loss (True) or None (False)

    @property
    def called_module(self) -> torch.nn.Module:
        """The module whose calls gradient caching cuts (`toma.accumulation.gradient_cache`): the LightningModule,
        which a training step calls as `self(...)`."""
        return self.module

    def pending_mark(self) -> Tuple[int, int]:
        return self.logs.mark(), len(self.returned)

    def pending_rewind(self, mark: Tuple[int, int]) -> None:
        self.logs.rewind(mark[0])
        del self.returned[mark[1] :]


class AsReturned(Exception):
    """A training step's output that is not a loss MicroBatching can train: it goes to Lightning unchanged, whose
    own checks answer it (an error for an invalid output), as in a plain run."""

    def __init__(self, output: Any) -> None:
        super().__init__("the training step's output goes to Lightning as it is")
        self.output = output


class MicroBatchStep:
    """The module's own training step, called once per micro-batch: its loss goes to toma; what else it returned
    (a dict's other keys) is kept from the last micro-batch. A step that returns None (Lightning's way to skip a
    batch) gives toma a loss with no parameter behind it, so the logical batch can be skipped whole."""

    def __init__(self, step: Callable[..., Any], args: tuple, kwargs: Dict[str, Any], model: ModuleAsModel) -> None:
        self.step, self.args, self.kwargs, self.model = step, args, kwargs, model
        self.extra: Optional[Dict[str, Any]] = None
        self.name = getattr(step, "__qualname__", "training_step")

    def loss(self, part: Any) -> Any:
        self.model.logs.start(part)
        output = self.step(part, *self.args, **self.kwargs)
        if output is None:
            self.model.logs.returned(None)
            self.model.returned.append(False)
            return torch.zeros((), device=self.model.module.device, requires_grad=True)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise AsReturned(output)
        self.model.logs.returned(loss)
        if isinstance(output, Mapping):
            self.extra = {key: value for key, value in output.items() if key != "loss"}
        self.model.returned.append(True)
        return loss

    def function(self) -> Callable[[Any], Any]:
        """`loss` as a function named after the module's training step (for toma's messages and the size file)."""

        def loss(part: Any) -> Any:
            return self.loss(part)

        loss.__qualname__, loss.__module__ = self.name, getattr(self.step, "__module__", loss.__module__)
        return loss


def autograd_backward(loss: torch.Tensor) -> None:
    """A micro-batch's backward pass, run by autograd itself: `Tensor.backward` is what Lightning calls, once per
    batch, and a patched or counted `Tensor.backward` sees it once per batch with MicroBatching too."""
    torch.autograd.backward(loss)


NOT_SET: Any = object()  # no instance attribute of that name (the class's own is used)


@contextlib.contextmanager
def micro_batch_region(module: "pl.LightningModule", params: List[torch.Tensor], logs: StepLogs) -> Iterator[None]:
    """While the micro-batches run: the gradients so far set aside (the logical batch's start from None) and
    the module's `self.log` captured; both put back after, whatever happens."""
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    own_log = module.__dict__.get("log", NOT_SET)
    module.log = logs.log  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own_log is NOT_SET:
            del module.log
        else:
            module.log = own_log  # type: ignore[method-assign]
        for p, grad in zip(params, held, strict=True):
            p.grad = grad
