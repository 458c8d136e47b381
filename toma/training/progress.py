"""What a training run shows while it runs: nothing (verbose=0), a line per epoch (1), or a tqdm bar (2).

This is output the user asked for with `verbose`, written to the stream they choose; toma's diagnostics
stay on `logging.getLogger("toma")`.
"""

import sys
from typing import Any, Dict, Optional, TextIO

__all__ = ["Progress", "format_epoch", "VERBOSITY"]

VERBOSITY = (0, 1, 2)


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_epoch(epoch: int, epochs: int, record: Dict[str, Any]) -> str:
    """`epoch 3/10: loss 0.1234 - eval_loss 0.2 - ... - 1.2e+03 samples/s - micro-batch 128 - 2 OOM retries`."""
    parts = [f"loss {_number(record['loss'])}"]
    parts += [f"{key} {_number(value)}" for key, value in record.items() if key.startswith("eval_")]
    parts.append(f"{record['samples_per_s']:.0f} samples/s")
    parts.append(f"micro-batch {record['micro_batch']}")
    parts.append(f"{record['oom_retries']} OOM retries")
    parts.append(f"{record['time']:.1f} s")
    return f"epoch {epoch + 1}/{epochs}: " + " - ".join(parts)


class Progress:
    """Shows one epoch at a time at the chosen verbosity."""

    def __init__(self, verbose: int, file: Optional[TextIO] = None) -> None:
        self.verbose = verbose
        self.file = file
        self.bar: Any = None

    def start_epoch(self, epoch: int, epochs: int, total_steps: Optional[int]) -> None:
        if self.verbose == 2:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total_steps,
                desc=f"epoch {epoch + 1}/{epochs}",
                unit="step",
                file=self.file if self.file is not None else sys.stderr,
                leave=True,
            )

    def step(self, postfix: Dict[str, Any]) -> None:
        """One optimizer step done; `postfix` values may be callables, evaluated only when the bar redraws."""
        bar = self.bar
        if bar is None:
            return
        bar.update(1)
        if bar.n == bar.total or bar.last_print_n == bar.n:  # it just redrew (or is done): refresh the numbers
            bar.set_postfix({key: value() if callable(value) else value for key, value in postfix.items()})

    def end_epoch(self, epoch: int, epochs: int, record: Dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(format_epoch(epoch, epochs, record).split(": ", 1)[1])
            self.bar.close()
            self.bar = None
        elif self.verbose == 1:
            stream = self.file if self.file is not None else sys.stdout
            stream.write(format_epoch(epoch, epochs, record) + "\n")
            stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
