"""What a training batch and a model's output hold for the Trainer: the loss, the logits and the targets, and the
metrics computed from them."""

from typing import Any, Callable, Dict, Iterable, Mapping, Sequence, Union

import torch

Metric = Callable[[torch.Tensor, torch.Tensor], Any]


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The share of targets whose largest output is the target class; targets of -100 (the `ignore_index`
    of PyTorch's and Hugging Face's losses: padding) are not counted."""
    counted = targets != -100
    hits = (outputs.argmax(dim=-1) == targets) & counted
    return hits.sum().float() / counted.sum().clamp(min=1)


METRICS: Dict[str, Metric] = {"accuracy": accuracy}
"""The built-in metrics, by the names `metrics=["accuracy"]` takes."""


def check_metrics(metrics: Union[None, Mapping[str, Any], Sequence[Any]]) -> Dict[str, Metric]:
    if metrics is None:
        return {}
    if isinstance(metrics, str) or callable(metrics):  # one metric, by name or as a function
        metrics = [metrics]
    if not isinstance(metrics, Iterable):
        raise TypeError(f"metrics must be a list of metrics (names or functions) or a dict of them, got {metrics!r}")
    if isinstance(metrics, Mapping):
        named = dict(metrics)
    else:
        named = {}
        for metric in metrics:
            if isinstance(metric, str) and metric not in METRICS:
                raise ValueError(f"metrics: unknown metric {metric!r}; the built-in ones are {sorted(METRICS)}")
            name = metric if isinstance(metric, str) else getattr(metric, "__name__", type(metric).__name__)
            if name in named:
                raise ValueError(f"metrics: two metrics named {name!r}; give them names with a dict {{name: metric}}")
            named[name] = METRICS[metric] if isinstance(metric, str) else metric
    if "loss" in named:
        raise ValueError("metrics: 'loss' is the name of evaluate's own loss; give the metric another name")
    for name, metric in named.items():
        if not callable(metric):
            raise TypeError(f"metrics[{name!r}] must be a function (outputs, targets) -> value, got {metric!r}")
    return named


def check_scalar(loss: Any, what: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)
        raise TypeError(f"{what} must return a scalar tensor (the batch's loss), got {shape}")
    return loss


def field(output: Any, name: str) -> Any:
    """`output.name` or `output[name]` (a Hugging Face ModelOutput has both), or None."""
    if isinstance(output, Mapping):
        return output.get(name)
    return getattr(output, name, None)


def loss_of(output: Any) -> torch.Tensor:
    """forward's result: the loss itself, or a model output carrying it (`.loss`, `["loss"]`)."""
    if isinstance(output, torch.Tensor):
        return check_scalar(output, "forward(batch)")
    loss = field(output, "loss")
    if loss is None:
        raise TypeError(
            "forward(batch) must return the batch's loss (a scalar tensor) or a model output carrying it as "
            f".loss (a Hugging Face ModelOutput, or a dict with 'loss'), got {type(output).__name__}"
        )
    return check_scalar(loss, "forward(batch).loss")


def logits_of(output: Any) -> torch.Tensor:
    logits = None if isinstance(output, torch.Tensor) else field(output, "logits")
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            "metrics with forward= need forward(batch) to return the model's output with its loss and logits "
            "(a Hugging Face ModelOutput, or a dict with 'loss' and 'logits'); it returned "
            f"{type(output).__name__}"
        )
    return logits


def default_targets(batch: Any) -> Any:
    """The targets of a batch for metrics with forward=: `batch["labels"]`, or the second of a pair."""
    if isinstance(batch, Mapping) and "labels" in batch:
        return batch["labels"]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[1]
    raise TypeError(
        "metrics with forward= need the batch's targets: batches that are dicts with 'labels' or "
        "(inputs, targets) pairs have them; for others pass targets=batch -> targets"
    )
