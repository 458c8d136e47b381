"""`toma.map`'s step: a function over chunks of host-resident rows, run on a device, outputs joined on dim 0.

The next chunk's inputs are copied to the device (`toma.batching.transfer`) while this chunk computes, and this
chunk's outputs travel back while the next one computes. The engine drives it like a range: an
out-of-memory error drops the chunk under way (and the next one already copied), keeps the finished ones,
and the same rows are tried again in a smaller chunk.
"""

from typing import Any, Callable, List, Optional, Tuple

import torch

from toma.batching.splitting import ArgumentBatch, map_tensors
from toma.batching.splitting import leaves as leaf_values
from toma.batching.transfer import Pending, Transfers
from toma.core.steps import RangeStep

__all__ = ["MapStep"]


class _Joined:
    """The outputs of all chunks, written into tensors of all rows on `device` as the chunks finish."""

    def __init__(self, rows: int, device: torch.device, name: str) -> None:
        self.rows, self.device, self.name = rows, device, name
        self.template: Any = None
        self.tensors: Optional[List[torch.Tensor]] = None
        self.whole: Any = None  # a single chunk's output, kept as it is: nothing to join

    def check(self, out: Any, rows: int) -> List[torch.Tensor]:
        """The output's tensors; a TypeError naming the function when it is not tensors of `rows` rows."""
        leaves = leaf_values(out)
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.shape[0] != rows:
                what = f"a tensor of shape {tuple(leaf.shape)}" if isinstance(leaf, torch.Tensor) else repr(leaf)
                raise TypeError(
                    f"{self.name} must return a tensor (or tuple, list or dict of tensors) with one row per input "
                    f"row, to be joined along dim 0: for a chunk of {rows} rows it returned {what}"
                )
        if self.tensors is not None and len(leaves) != len(self.tensors):
            raise TypeError(
                f"{self.name} returned {len(leaves)} tensors for one chunk and {len(self.tensors)} for another"
            )
        return leaves

    def write(self, out: Any, start: int, stop: int) -> None:
        """Put the rows `[start, stop)` of every output (host or device tensors) in place."""
        leaves = leaf_values(out)
        if start == 0 and stop == self.rows:
            self.whole = map_tensors(out, lambda tensor: tensor.detach().to(self.device))
            return
        if self.tensors is None:
            self.template = out
            self.tensors = [
                torch.empty((self.rows, *leaf.shape[1:]), dtype=leaf.dtype, device=self.device) for leaf in leaves
            ]
        for target, leaf in zip(self.tensors, leaves):
            if leaf.shape[1:] != target.shape[1:] or leaf.dtype != target.dtype:
                raise TypeError(
                    f"{self.name} returned rows of shape {tuple(leaf.shape[1:])} ({leaf.dtype}) for rows {start}-{stop} "
                    f"and of shape {tuple(target.shape[1:])} ({target.dtype}) for earlier ones: they cannot be joined"
                )
            target[start:stop].copy_(leaf.detach())

    def result(self) -> Any:
        if self.whole is not None:
            return self.whole
        if self.tensors is None:
            return None
        remaining = iter(self.tensors)
        return map_tensors(self.template, lambda tensor: next(remaining))


class MapStep(RangeStep):
    """`func(*chunk_inputs)` for consecutive row chunks of `split`, inputs moved to the transfers' device."""

    size_name = "step"
    __slots__ = ("split", "transfers", "joined", "ahead", "back", "to_host", "returns_none")

    def __init__(
        self,
        func: Callable[..., Any],
        split: ArgumentBatch,
        transfers: Transfers,
        output_device: torch.device,
        name: Optional[str] = None,
    ) -> None:
        super().__init__(func, 0, split.size, (), {}, name, device=transfers.device)
        self.split, self.transfers = split, transfers
        label = str(name or getattr(func, "__qualname__", repr(func)))
        self.joined = _Joined(split.size, output_device, label)
        # Outputs go back through pinned staging when they are on CUDA and asked for on the host.
        self.to_host = transfers.cuda and output_device.type == "cpu"
        self.ahead: Optional[Tuple[int, int, Pending]] = None  # the next chunk's inputs, on their way
        self.back: Optional[Tuple[int, int, Pending]] = None  # the last chunk's outputs, on their way back
        self.returns_none: Optional[bool] = None  # whether the chunks return None (known after the first)

    def _send(self, start: int, stop: int) -> Pending:
        """Start moving the chunk's split tensors; `toma.whole` values were moved once (`ArgumentBatch.placed`)."""
        rows: List[torch.Tensor] = []
        args, _ = self.split.arguments(start, stop, rows)
        return self.transfers.prefetch(args, stage=rows)

    def call(self, start: int, stop: int) -> None:
        ahead, self.ahead = self.ahead, None
        try:
            pending = ahead[2] if ahead is not None and ahead[:2] == (start, stop) else self._send(start, stop)
            del ahead
            inputs = pending.take()
            del pending
            if stop < self.end:  # the next chunk, at this size, copied while this one computes
                following = min(stop + (stop - start), self.end)
                self.ahead = (stop, following, self._send(stop, following))
            out = self.func(*inputs)
            del inputs
            if self.returns_none is None:
                self.returns_none = out is None
            elif self.returns_none != (out is None):
                raise TypeError(
                    f"{self.joined.name} returned None for some chunks and outputs for others: return the rows' "
                    "outputs from every chunk, or None from every chunk"
                )
            if out is None:
                return
            self.joined.check(out, stop - start)
            if self.to_host:
                returning = (start, stop, self.transfers.to_host(out))
                del out
                self._land()
                self.back = returning
            else:
                self.joined.write(out, start, stop)
        except BaseException:
            self.ahead = None  # its device memory goes with the failed attempt's
            raise
        if stop >= self.end:
            self._land()

    def _land(self) -> None:
        """Write the outputs that came back from the previous chunk."""
        if self.back is not None:
            start, stop, pending = self.back
            self.back = None
            self.joined.write(pending.take(copy=start == 0 and stop == self.end), start, stop)

    def result(self) -> Any:
        self._land()
        return None if self.returns_none else self.joined.result()
