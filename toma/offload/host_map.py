"""`toma.map`'s step: a function over chunks of host-resident rows, run on a device, outputs joined on dim 0.

The next chunk's inputs are copied to the device (`toma.batching.transfer`) while this chunk computes, and this
chunk's outputs travel back while the next one computes. The engine drives it like a range: an
out-of-memory error drops the chunk under way (and the next one already copied), keeps the finished ones,
and the same rows are tried again in a smaller chunk.
"""

from typing import Any, Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from toma.batching.packed import PackedBatch, PackedTokens
from toma.batching.splitting import ArgumentBatch, map_tensors
from toma.batching.splitting import leaves as leaf_values
from toma.batching.tokens import TokenBatch, restore_order
from toma.batching.transfer import Pending, Transfers
from toma.core.steps import TOKEN_BUDGET, RangeStep

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


class _PackedJoined(_Joined):
    """The outputs of a padding-free batch's chunks of packed sequences: an output per token (`(1, tokens, ...)`)
    goes back into its place in the packed row (`(rows, width, ...)`), one per sequence (`(sequences, ...)`) into
    the sequences' rows."""

    def __init__(self, batch: PackedBatch, device: torch.device, name: str) -> None:
        super().__init__(batch.size, device, name)
        self.batch = batch
        self.kinds: Optional[List[bool]] = None  # per output: per token (True) or per sequence

    def _per_token(self, leaf: torch.Tensor, start: int, stop: int) -> bool:
        tokens = self.batch.area_between(start, stop)
        if leaf.dim() >= 2 and leaf.shape[0] == 1 and leaf.shape[1] == tokens:
            return True
        if leaf.dim() >= 1 and leaf.shape[0] == stop - start:
            return False
        raise TypeError(
            f"{self.name} must return, for a chunk of packed sequences, tensors with one row per sequence or of shape "
            f"(1, tokens, ...): for a chunk of {stop - start} sequences and {tokens} tokens it returned one of "
            f"shape {tuple(leaf.shape)}"
        )

    def check(self, out: Any, rows: int) -> List[torch.Tensor]:
        return [leaf for leaf in leaf_values(out) if isinstance(leaf, torch.Tensor)]

    def write(self, out: Any, start: int, stop: int) -> None:
        leaves = leaf_values(out)
        if start == 0 and stop == self.rows and self.batch.rows == 1:
            self.whole = map_tensors(out, lambda tensor: tensor.detach().to(self.device))
            return
        kinds = [self._per_token(leaf, start, stop) for leaf in leaves]
        if self.tensors is None:
            self.template, self.kinds = out, kinds
            rows, width = self.batch.rows, self.batch.width
            self.tensors = [
                torch.zeros((rows, width, *leaf.shape[2:]) if kind else (self.rows, *leaf.shape[1:]), dtype=leaf.dtype,
                            device=self.device)
                for leaf, kind in zip(leaves, kinds)
            ]  # fmt: skip
        first, last = self.batch.sequences[start], self.batch.sequences[stop - 1]
        for target, leaf, kind in zip(self.tensors, leaves, kinds):
            if kind:
                target[first.row, first.begin : last.end].copy_(leaf.detach()[0])
            else:
                target[start:stop].copy_(leaf.detach())


class MapStep(RangeStep):
    """`func(*chunk_inputs)` for consecutive row chunks of `split`, inputs moved to the transfers' device. With
    `tokens` (`split` sorted by row length, `toma.map(lengths=)`), the size is a token budget, each chunk is
    trimmed to its longest row, outputs as wide as a chunk are padded back with zeros to the rows' width, and the
    result comes back in the call's row order. A padding-free `split` (`PackedBatch`, with its `PackedTokens`) is
    chunked by packed sequences within the budget, and its outputs go back in place (`_PackedJoined`)."""

    __slots__ = (
        "split", "transfers", "joined", "ahead", "back", "to_host", "returns_none", "tokens", "budget", "size_name",
        "timer", "packed",
    )  # fmt: skip

    def __init__(
        self,
        func: Callable[..., Any],
        split: Union[ArgumentBatch, PackedBatch],
        transfers: Transfers,
        output_device: torch.device,
        name: Optional[str] = None,
        tokens: Optional[Union[TokenBatch, PackedTokens]] = None,
    ) -> None:
        super().__init__(func, 0, split.size, (), {}, name, device=transfers.device)
        self.split, self.transfers, self.tokens, self.budget = split, transfers, tokens, 0
        self.size_name = "step" if tokens is None else TOKEN_BUDGET
        self.timer = None if tokens is None else tokens.cost.timer(transfers.device)
        label = str(name or getattr(func, "__qualname__", repr(func)))
        self.packed = isinstance(split, PackedBatch)
        self.joined = (
            _PackedJoined(split, output_device, label)
            if isinstance(split, PackedBatch)
            else _Joined(split.size, output_device, label)
        )
        # Outputs go back through pinned staging when they are on CUDA and asked for on the host.
        self.to_host = transfers.cuda and output_device.type == "cpu"
        self.ahead: Optional[Tuple[int, int, Pending]] = None  # the next chunk's inputs, on their way
        self.back: Optional[Tuple[int, int, Pending]] = None  # the last chunk's outputs, on their way back
        self.returns_none: Optional[bool] = None  # whether the chunks return None (known after the first)

    def _send(self, start: int, stop: int) -> Pending:
        """Start moving the chunk's split tensors; `toma.whole` values were moved once (`ArgumentBatch.placed`)."""
        rows: List[torch.Tensor] = []
        width = self.tokens.widths[start] if isinstance(self.tokens, TokenBatch) else None
        args, _ = self.split.arguments(start, stop, rows, width)
        return self.transfers.prefetch(args, stage=rows)

    def _stop(self, start: int, size: int) -> int:
        """Where a chunk from row `start` at `size` (rows, or a token budget) ends."""
        return min(start + size, self.end) if self.tokens is None else self.tokens.stop(start, size)

    def effective(self, size: int) -> int:
        """The rows a chunk at `size` covers (its padded tokens, with a token budget)."""
        if self.tokens is None:
            return super().effective(size)
        start = self.current
        return self.tokens.area_between(start, self._stop(start, size))

    def at_smallest(self, size: int) -> bool:
        """With a token budget: the chunk holds one row already, trimmed to its own length (or one packed
        sequence)."""
        return self.tokens is not None and self._stop(self.current, size) - self.current == 1

    def __call__(self, size: int) -> bool:
        start, self.budget = self.current, size
        stop = self._stop(start, size)
        self.call(start, stop)
        self.current = stop
        return stop >= self.end

    def _timed(self, start: int, stop: int) -> None:
        """While the cost of a chunk is measured: its start marked (the last chunk's end after its function)."""
        assert self.timer is not None and self.tokens is not None
        if not self.timer.cost.timing:
            self.timer = None
            return
        self.timer.begin(self.tokens.area_between(start, stop))

    def _padded_back(self, out: Any, start: int) -> Any:
        """A trimmed chunk's outputs as wide as the chunk, padded with zeros to the rows' width."""
        tokens = self.tokens
        if not isinstance(tokens, TokenBatch) or tokens.widths[start] >= tokens.width:
            return out
        width, full = tokens.widths[start], tokens.width

        def pad(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() < 2 or tensor.shape[1] != width:
                return tensor
            return F.pad(tensor, (0, 0) * (tensor.dim() - 2) + (0, full - width))

        return map_tensors(out, pad)

    def call(self, start: int, stop: int) -> None:
        ahead, self.ahead = self.ahead, None
        try:
            pending = ahead[2] if ahead is not None and ahead[:2] == (start, stop) else self._send(start, stop)
            del ahead
            inputs = pending.take()
            del pending
            if stop < self.end:  # the next chunk, at this size, copied while this one computes
                following = (
                    self._stop(stop, self.budget) if self.tokens is not None else min(2 * stop - start, self.end)
                )
                self.ahead = (stop, following, self._send(stop, following))
            if self.timer is not None:
                self._timed(start, stop)
            out = self._padded_back(self.func(*inputs), start)
            if start == 0 and stop >= self.end:  # one chunk: the result is new memory, as a join of several is
                out = _unshared(out, inputs)
            del inputs
            if self.timer is not None and stop >= self.end:
                self.timer.end()
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
            if self.timer is not None:
                self.timer.drop()
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
        if self.returns_none:
            return None
        joined = self.joined.result()
        if not isinstance(self.tokens, TokenBatch):
            return joined
        back = torch.tensor(restore_order(self.tokens.order), dtype=torch.long)
        return map_tensors(joined, lambda tensor: tensor.index_select(0, back.to(tensor.device)))


def _unshared(out: Any, inputs: Any) -> Any:
    """`out` with a copy of each tensor that shares memory with a tensor of `inputs` (a function that returns
    its input, or a view of it): what `toma.map` returns never aliases what it was given."""
    given = {_memory(leaf) for leaf in leaf_values(inputs) if isinstance(leaf, torch.Tensor)}
    given.discard(None)
    if not given:
        return out
    return map_tensors(out, lambda tensor: tensor.detach().clone() if _memory(tensor) in given else tensor)


def _memory(tensor: torch.Tensor) -> Optional[int]:
    """Where a strided tensor's storage starts (None for sparse and other layouts, which hold none to share)."""
    if tensor.layout != torch.strided:
        return None
    return int(tensor.untyped_storage().data_ptr())
