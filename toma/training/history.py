"""What a training run did, epoch by epoch and step by step; saved as CSV or JSON, plotted as a PNG."""

import csv
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["TrainingHistory"]

PLOT_HINT = "history.plot needs matplotlib: pip install matplotlib (or pip install 'toma[plot]')"


@dataclass
class EpochTally:
    """An epoch's steps as they run, for its record: each step's loss (times what it averaged over, for a mean
    loss), its weight and rows, and the micro-batch size full logical batches ran at (a short last one runs whole)."""

    mean: bool  # the loss is a mean (over rows, or what the weight counts), not a sum
    started: float = field(default_factory=time.perf_counter)
    weighted: List[torch.Tensor] = field(default_factory=list)
    weights: List[float] = field(default_factory=list)
    sizes: List[int] = field(default_factory=list)
    micro_batch: Optional[int] = None

    def add(self, loss: torch.Tensor, weight: float, rows: int, micro_batch: Optional[int], full: bool) -> None:
        """A step's loss (still on the device), weight, rows and micro-batch size; `full`: a whole logical batch."""
        self.weighted.append(loss.float() * weight if self.mean else loss.float())
        self.weights.append(weight)
        self.sizes.append(rows)
        if full or self.micro_batch is None:
            self.micro_batch = micro_batch

    def loss(self) -> float:
        """The epoch's loss per item: a mean over what the steps averaged over, or a summed loss over the rows it
        summed (as `evaluate` gives it, so that the training and evaluation losses compare)."""
        total = float(torch.stack(self.weighted).sum())
        counted = sum(self.weights) if self.mean else sum(self.sizes)
        return total / counted if counted > 0 else 0.0


def _parse(text: str) -> Any:
    """A CSV cell back to the number (or None, or text) it was written from."""
    if text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


class TrainingHistory:
    """`epochs`: one flat dict per epoch (loss, eval results as `eval_<name>`, time, samples/s, micro-batch
    size, OOM retries, peak memory); `steps`: one dict per optimizer step (loss, micro-batch size, rows)."""

    def __init__(self, epochs: Optional[List[Dict[str, Any]]] = None, steps: Optional[List[Dict[str, Any]]] = None):
        self.epochs: List[Dict[str, Any]] = list(epochs or [])
        self.steps: List[Dict[str, Any]] = list(steps or [])

    def __repr__(self) -> str:
        return f"TrainingHistory({len(self.epochs)} epochs, {len(self.steps)} steps)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TrainingHistory) and (self.epochs, self.steps) == (other.epochs, other.steps)

    def column(self, name: str) -> List[Any]:
        """One value per epoch (None where an epoch lacks it)."""
        return [epoch.get(name) for epoch in self.epochs]

    def save(self, path: str) -> None:
        """JSON (epochs and steps) or, for a `.csv` path, CSV (one row per epoch)."""
        with open(path, "w", encoding="utf-8", newline="") as file:
            if str(path).endswith(".csv"):
                fields = list(dict.fromkeys(key for epoch in self.epochs for key in epoch))
                writer = csv.DictWriter(file, fieldnames=fields)
                writer.writeheader()
                writer.writerows(self.epochs)
            else:
                json.dump({"epochs": self.epochs, "steps": self.steps}, file, indent=1)

    @classmethod
    def load(cls, path: str) -> "TrainingHistory":
        """Read what `save` wrote (a CSV holds the epochs only)."""
        with open(path, encoding="utf-8", newline="") as file:
            if str(path).endswith(".csv"):
                epochs = [{key: _parse(value) for key, value in row.items()} for row in csv.DictReader(file)]
                return cls(epochs)
            data = json.load(file)
        return cls(data["epochs"], data["steps"])

    def _logical_batch_line(self) -> Tuple[List[Any], List[Any], List[Any], List[Any]]:
        """The logical batch per step, as (steps, rows) for the line and (steps, rows) for the short batches that
        end an epoch, drawn apart so that the line does not dip at every epoch's end."""
        line_steps, line_rows, short_steps, short_rows = [], [], [], []
        largest: Dict[Any, int] = {}
        for record in self.steps:
            if record.get("rows") is not None:
                epoch = record.get("epoch")
                largest[epoch] = max(largest.get(epoch, 0), record["rows"])
        last_of_epoch = {record.get("epoch"): record["step"] for record in self.steps}
        for record in self.steps:
            rows, epoch = record.get("rows"), record.get("epoch")
            if rows is None:
                continue
            if record["step"] == last_of_epoch[epoch] and rows < largest[epoch]:
                short_steps.append(record["step"])
                short_rows.append(rows)
            else:
                line_steps.append(record["step"])
                line_rows.append(rows)
        return line_steps, line_rows, short_steps, short_rows

    def plot(self, path: Any) -> Any:
        """A PNG of the loss, the evaluation results and the micro-batch size over the optimizer steps, epochs
        marked (needs matplotlib). Returns the matplotlib Figure."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as error:
            raise ImportError(PLOT_HINT) from error
        steps = [record["step"] for record in self.steps]
        epoch_ends = [epoch["step"] for epoch in self.epochs if "step" in epoch]
        metric_names = [
            key for key in dict.fromkeys(k for epoch in self.epochs for k in epoch) if key.startswith("eval_")
        ]
        metric_names = [name for name in metric_names if name != "eval_loss"]
        figure = Figure(figsize=(8, 8 if metric_names else 5.5))
        FigureCanvasAgg(figure)  # no pyplot: nothing global changes, no display needed
        axes = figure.subplots(3 if metric_names else 2, 1, sharex=True, squeeze=False)[:, 0]
        loss_axes, size_axes = axes[0], axes[-1]

        loss_axes.plot(steps, [record["loss"] for record in self.steps], label="training loss (step)")
        self._epoch_series(loss_axes, epoch_ends, "eval_loss", "evaluation loss (epoch)")
        loss_axes.set_ylabel("loss")
        loss_axes.legend()
        if metric_names:
            for name in metric_names:
                self._epoch_series(axes[1], epoch_ends, name, f"{name} (epoch)")
            axes[1].set_ylabel("evaluation")
            axes[1].legend()

        size_axes.step(steps, [record["micro_batch"] for record in self.steps], where="post", label="micro-batch size")
        line_steps, line_rows, short_steps, short_rows = self._logical_batch_line()
        if line_steps:
            size_axes.step(line_steps, line_rows, where="post", linestyle="--", color="gray", label="logical batch")
        if short_steps:
            size_axes.plot(short_steps, short_rows, "o", color="gray", markersize=3, label="short last batch")
        retried = [(record["step"], record["micro_batch"]) for record in self.steps if record.get("oom_retries")]
        if retried:
            size_axes.plot(*zip(*retried, strict=True), "rx", label="found after out-of-memory retries")
        size_axes.set_ylabel("rows")
        size_axes.set_ylim(bottom=0)
        size_axes.legend()
        size_axes.set_xlabel("optimizer step")
        for axis in axes:
            for end in epoch_ends[:-1]:
                axis.axvline(end + 0.5, color="lightgray", linestyle=":", linewidth=1, gid="epoch end")
        figure.tight_layout()
        figure.savefig(path, format="png")
        return figure

    def _epoch_series(self, axes: Any, epoch_ends: List[Any], name: str, label: str) -> None:
        values = self.column(name)
        points = [(s, v) for s, v in zip(epoch_ends, values, strict=False) if _finite(v)]
        if points:
            axes.plot(*zip(*points, strict=True), "o-", label=label)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
