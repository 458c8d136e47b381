"""The runs of the forms that are more than a step and the engine, shared by all kinds of call: `toma.accumulate`
(and `explicit.accumulate`), `toma.map`. The other forms run their step (`toma.core.steps`) with the call's
Runner, `runner.perform(step, initial, context)`, the same in `toma.X`, `explicit.X`, `simple.X` and
`toma.execute.X`."""

from typing import Any, Callable, Dict, Hashable, Optional, Tuple, Union

import torch

from toma.accumulation.accumulate import AccumulationStats, MicroBatchSizing, accumulate
from toma.accumulation.options import AccumulationOptions
from toma.batching.logical import is_packed_lengths, logical_batch_of
from toma.batching.packed import PackedBatch, PackedTokens
from toma.batching.splitting import ArgumentBatch, leaves
from toma.batching.tokens import Lengths, TokenBatch
from toma.batching.transfer import Transfers
from toma.core.runner import Runner
from toma.offload.host_map import MapStep

__all__ = ["Args", "Kwargs", "run_accumulate", "run_map"]

Args = Tuple[Any, ...]
Kwargs = Dict[str, Any]


def run_accumulate(
    func: Callable[..., torch.Tensor],
    accumulation: AccumulationOptions,
    runner: Runner,
    initial: Optional[int],
    args: Args,
    kwargs: Kwargs,
    context: Optional[Hashable] = None,
    stats: Optional[AccumulationStats] = None,
) -> torch.Tensor:
    """Forward and backward over the logical batch of `args`/`kwargs` in micro-batches; its loss, detached."""
    sizing = MicroBatchSizing(initial, runner, context, stats)
    batch = logical_batch_of(args, kwargs, accumulation.lengths, accumulation.groups)
    return accumulate(func, batch, accumulation, sizing)


def run_map(
    func: Callable[..., Any],
    inputs: Args,
    device: torch.device,
    output: torch.device,
    initial_step: Optional[int],
    runner: Runner,
    lengths: Optional[Lengths] = None,
) -> Any:
    """`func(*chunk)` over row chunks of `inputs` on `device`; the outputs joined on `output`. With `lengths`,
    the rows sorted by length and chunked by a token budget (`initial_step` rows of the longest to start)."""
    if not any(isinstance(t, torch.Tensor) and t.dim() > 0 for t in leaves(inputs)):
        raise ValueError(
            "toma.map needs inputs: tensors (also inside tuples, lists or dicts) whose dim 0 holds the rows "
            f"to map over; got {len(inputs)} input(s) with none"
        )
    tokens: Optional[Union[TokenBatch, PackedTokens]] = None
    split: Union[ArgumentBatch, PackedBatch]
    if isinstance(lengths, str) and is_packed_lengths(lengths):  # a padding-free batch: its packed sequences
        split = PackedBatch(inputs, {}, lengths, name="inputs")
        tokens = PackedTokens(split)
        initial = tokens.area if initial_step is None else initial_step * tokens.longest
    else:
        split = ArgumentBatch(inputs, {}, name="inputs")
        initial = split.size if initial_step is None else initial_step
        if lengths is not None:
            tokens = TokenBatch(split, lengths)
            assert isinstance(tokens.batch, ArgumentBatch)  # rows, not groups: a map's rows are on their own
            split, initial = tokens.batch, initial * tokens.widths[0]
    transfers = Transfers(device)
    split = split.placed(transfers.place)  # toma.whole values move once per call, not once per chunk
    return runner.perform(MapStep(func, split, transfers, output, tokens=tokens), initial).result()
