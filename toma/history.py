"""What a training run did, epoch by epoch and step by step; saved as CSV or JSON, plotted as a PNG."""

import csv
import json
import math
from typing import Any, Dict, List, Optional

__all__ = ["TrainingHistory"]

PLOT_HINT = "history.plot needs matplotlib: pip install matplotlib (or pip install 'toma[plot]')"


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

    def plot(self, path: str) -> None:
        """A PNG of the loss and the micro-batch size over the optimizer steps (needs matplotlib)."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as error:
            raise ImportError(PLOT_HINT) from error
        steps = [record["step"] for record in self.steps]
        figure = Figure(figsize=(8, 5.5))
        FigureCanvasAgg(figure)  # no pyplot: nothing global changes, no display needed
        loss_axes, size_axes = figure.subplots(2, 1, sharex=True)
        loss_axes.plot(steps, [record["loss"] for record in self.steps], label="training loss (step)")
        epoch_ends = [epoch["step"] for epoch in self.epochs if "step" in epoch]
        values = self.column("eval_loss")
        points = [(s, v) for s, v in zip(epoch_ends, values, strict=False) if v is not None and math.isfinite(v)]
        if points:
            loss_axes.plot(*zip(*points, strict=True), "o-", label="evaluation loss (epoch)")
        loss_axes.set_ylabel("loss")
        loss_axes.legend()
        size_axes.step(steps, [record["micro_batch"] for record in self.steps], where="post", label="micro-batch size")
        if any("rows" in record for record in self.steps):
            logical = [record.get("rows") for record in self.steps]
            size_axes.step(steps, logical, where="post", linestyle="--", color="gray", label="logical batch")
        retried = [(record["step"], record["micro_batch"]) for record in self.steps if record.get("oom_retries")]
        if retried:
            size_axes.plot(*zip(*retried, strict=True), "rx", label="found after out-of-memory retries")
        size_axes.set_ylabel("rows")
        size_axes.set_ylim(bottom=0)
        size_axes.legend()
        size_axes.set_xlabel("optimizer step")
        figure.tight_layout()
        figure.savefig(path, format="png")
