"""Gradient caching: a loss that couples rows through the model's outputs (in-batch negatives, CoSENT, CLIP) trained
exactly with the model's calls in micro-batches (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size
under Memory Limited Setup"; luyug/GradCache; sentence-transformers' `Cached*` losses).

Where the split check (`toma.accumulation.coupling`) finds that a loss is not what its parts add up to, toma runs
the user's loss function once on the whole logical batch with the `model=` it was given intercepted: each call of
the model runs in micro-batches of the attempt's size without a graph (first pass), its outputs joined in the call's
order and given to the loss as leaves that take a gradient. The loss, computed once on every row's outputs, is
backpropagated to those outputs (and to any parameter it uses directly, a CLIP temperature); then each micro-batch
of each call runs again with its graph (second pass) and backpropagates its slice of the cached gradient. The
gradients are the whole batch's: the loss is never split. Each micro-batch's random state is replayed in the second
pass (dropout draws the same masks in both), and so is the autocast it ran under.

It is exact where the model treats rows independently: a BatchNorm in training mode, a forward that mixes rows or
outputs that are not by rows are refused by name (`ModelMixesRows`), checked once per loss function on the first
call's first micro-batch (its outputs whole against its halves', without gradients, in eval mode). Without
gradients (evaluation) the first pass alone gives the loss: the whole batch's, never an average of parts.
"""

import contextlib
import logging
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Protocol, Tuple, runtime_checkable

import torch

from toma.accumulation.backward import _autocast_enabled, _autocast_off, enabled_autocast
from toma.accumulation.chunk_speed import now, synchronized
from toma.accumulation.coupling import CoupledRows, SplitCheck, tolerance
from toma.accumulation.diagnostics import loss_error
from toma.accumulation.misuse import MisuseWatch
from toma.accumulation.rollback import RandomState
from toma.accumulation.sync import GradientSync
from toma.batching.micro_batch_cost import NEVER, MicroBatchCost
from toma.batching.nested import map_tensors, rebuild_mapping, rebuild_sequence
from toma.batching.splitting import ArgumentBatch
from toma.batching.tokens import TokenBatch, restore_order
from toma.core.oom import should_reduce_batch_size
from toma.core.steps import BatchStep

__all__ = [
    "ModelMixesRows",
    "GradientCache",
    "CutCalls",
    "CallsThrough",
    "called_module",
    "mixing_modules",
    "with_calls_cut",
]

log = logging.getLogger("toma")

Arguments = Tuple[Tuple[Any, ...], Dict[str, Any]]
_AUTOCAST_KINDS = ("cuda", "cpu")  # the device types whose autocast a call's replay puts back
_MASK = "attention_mask"  # a call's rows are grouped by the length this mask gives, and trimmed to it


class ModelMixesRows(CoupledRows):
    """The loss couples rows and the model does not treat its rows independently (BatchNorm in training mode, a
    forward that mixes rows, outputs not by rows): neither micro-batches nor gradient caching train it exactly."""


@runtime_checkable
class CallsThrough(Protocol):
    """A model given to `toma.accumulate` that stands for another module, the one a loss function calls (Lightning's
    `ModuleAsModel`: a training step calls the LightningModule as `self(...)`): gradient caching cuts its calls."""

    @property
    def called_module(self) -> torch.nn.Module: ...


def called_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose calls gradient caching cuts: `model`, or the module it stands for (`CallsThrough`)."""
    return model.called_module if isinstance(model, CallsThrough) else model


def mixing_modules(model: torch.nn.Module) -> List[str]:
    """The model's modules that mix rows in training mode (BatchNorm's batch statistics), by name."""
    return [
        name or type(module).__name__
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.training
    ]


def _remedies(label: str) -> str:
    return (
        f"{label}: gradient caching (toma's answer to a loss that couples rows) needs a model whose forward treats "
        "rows independently. Put BatchNorm in eval mode or replace it (LayerNorm, GroupNorm), keep rows apart in "
        "the forward, or give the loss's rows' relation with groups= ('batch' never splits a batch)"
    )


def _autocast_dtype(kind: str) -> torch.dtype:
    """Autocast's dtype for device type `kind` (torch < 2.4 has no `get_autocast_dtype`)."""
    getter = getattr(torch, "get_autocast_dtype", None)
    if getter is not None:
        return getter(kind)  # type: ignore[no-any-return]
    return torch.get_autocast_gpu_dtype() if kind == "cuda" else torch.get_autocast_cpu_dtype()


class _Autocast:
    """The autocast in effect at a model call, on or off, per device type, put back for its second pass where the
    replay runs under another (a call the loss made inside `torch.autocast(...)`, or with it turned off)."""

    __slots__ = ("states",)

    def __init__(self) -> None:
        self.states: Dict[str, Optional[torch.dtype]] = {
            kind: _autocast_dtype(kind) if _autocast_enabled(kind) else None for kind in _AUTOCAST_KINDS
        }

    def entered(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for kind, dtype in self.states.items():
            now = _autocast_dtype(kind) if _autocast_enabled(kind) else None
            if now != dtype:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=dtype is not None))
        return stack


class _Call:
    """One call of the model by the loss function: its arguments as a batch of rows (sorted longest first where its
    rows were grouped by length), its micro-batches, the random state and autocast each ran under, and the leaves its
    joined outputs were given to the loss as."""

    __slots__ = ("batch", "chunks", "rows", "order", "width", "states", "autocast", "leaves")

    def __init__(
        self,
        batch: ArgumentBatch,
        chunks: List[Tuple[int, int, Optional[int]]],
        order: Optional[List[int]] = None,
        width: Optional[int] = None,
    ) -> None:
        self.batch = batch
        self.chunks = chunks  # micro-batches [start, stop) of `batch`, each trimmed to a width (None: as it is)
        self.order = order  # the call's row at each of `batch`'s positions; None: `batch` is the call's own
        self.width = width  # the call's padded width, that trimmed outputs are padded back to; None: none trimmed
        self.rows: List[Any] = [  # each micro-batch's rows among the call's, to slice the outputs' gradients by
            slice(start, stop) if order is None else torch.tensor(order[start:stop], dtype=torch.long)
            for start, stop, _ in chunks
        ]
        self.states: List[RandomState] = []
        self.autocast = _Autocast()
        self.leaves: List[Optional[torch.Tensor]] = []  # per output tensor, in `_tensors` order; None: not taking one

    @property
    def sorted(self) -> bool:
        return self.order is not None


def _by_rows(batch: ArgumentBatch, rows: int) -> List[Tuple[int, int, Optional[int]]]:
    return [(start, min(start + rows, batch.size), None) for start in range(0, batch.size, rows)]


def _has_mask(batch: ArgumentBatch) -> bool:
    """Whether the call carries a (rows, width) `attention_mask` (a keyword, or a key of a dict argument)."""
    holders: List[Mapping] = [batch.kwargs, *(arg for arg in batch.args if isinstance(arg, Mapping))]
    for holder in holders:
        mask = holder.get(_MASK)
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == batch.size:
            return True
    return False


def _call_of(batch: ArgumentBatch, size: int, tokens: bool) -> _Call:
    """A call's micro-batches: `size` rows each, or with a token budget as many rows as fit it. Where the call carries
    an `attention_mask` and is cut, its rows are grouped by length (sorted longest first) and each micro-batch trimmed
    to its longest row (right padding; `toma.batching.tokens`); the outputs go back to the call's order."""
    by_length: Optional[TokenBatch] = None
    if _has_mask(batch) and (tokens or batch.size > size):
        try:
            by_length = TokenBatch(batch, _MASK, MicroBatchCost(NEVER))
        except ValueError as error:  # not a 0/1 mask: the call's rows as they are
            log.debug("toma: a model call's rows are not grouped by length: %s", error)
    if by_length is None:
        if tokens:  # the rows of the call's padded width (its widest tensor's dim 1) that fit the budget
            width = max((tensor.shape[1] for _, tensor in batch.tensors if tensor.dim() >= 2), default=1)
            size = max(1, size // max(1, width))
        return _Call(batch, _by_rows(batch, size))
    if tokens:
        parts = by_length.micro_batches(size)
        if len(parts) == 1:  # one micro-batch: the call as it is
            return _Call(batch, [(0, batch.size, None)])
        chunks = [(start, stop, width) for _, start, stop, width in parts]
    else:
        chunks = [(start, stop, by_length.widths[start]) for start, stop, _ in _by_rows(batch, size)]
    sorted_batch = by_length.batch
    assert isinstance(sorted_batch, ArgumentBatch)
    return _Call(sorted_batch, chunks, by_length.order, by_length.width if sorted_batch.trimmed else None)


def _items(output: Mapping) -> List[Tuple[Any, Any]]:
    """A mapping's items in an order that does not depend on the order its keys were set in (by their text)."""
    return sorted(output.items(), key=lambda item: str(item[0]))


def _tensors(output: Any) -> List[torch.Tensor]:
    """The tensors of a model's output, in a fixed order (tuples, lists, mappings by key, a Hugging Face
    ModelOutput): the first pass's leaves and the second pass's outputs pair up in it."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, Mapping):
        return [t for _, value in _items(output) for t in _tensors(value)]
    return []


class GradientCache:
    """One attempt's model calls under gradient caching: `loss(func, arguments)` runs the loss function on the whole
    batch with the model's calls in micro-batches of `size` rows (first pass); `replay(scope)` runs each micro-batch
    again with its graph and backpropagates its slice of the outputs' gradients (second pass); `train` runs both.
    `coupling`: the loss function's split check, which remembers that the model was found treating rows
    independently (checked on the first call's first micro-batch until then)."""

    def __init__(
        self,
        model: torch.nn.Module,
        size: int,
        random_on: List[torch.Tensor],
        coupling: SplitCheck,
        label: str,
        tokens: bool = False,
    ) -> None:
        self.model, self.size, self.random_on, self.coupling, self.label = model, size, random_on, coupling, label
        self.tokens = tokens  # `size` is a token budget: a call's micro-batches hold as many rows as fit its width
        self.check_rows = not coupling.rows_checked
        self.chunk_rows = 0  # the most rows a micro-batch of a call held so far
        self.rows_compared = False  # whether `_check_rows` compared a micro-batch's outputs with its halves'
        self.calls: List[_Call] = []
        self.inside = False  # within one of the model's micro-batches: a nested call runs as it is
        self.after_loss: Optional[RandomState] = None
        # the attempt timed while the call site's micro-batch rows are still being chosen (`ChunkSpeed`)
        self.timing = torch.is_grad_enabled() and coupling.speed.timing and not tokens
        self.original: Callable[..., Any] = model.forward  # the model's own forward, which the passes call

    @contextlib.contextmanager
    def _intercepted(self) -> Iterator[None]:
        """The model's calls go through `_first_pass` while the loss function runs; the model as it was after."""
        model = self.model
        had_own = "forward" in model.__dict__
        self.original = original = model.forward
        call = self._first_pass

        def forward(*args: Any, **kwargs: Any) -> Any:
            return call(original, args, kwargs)

        model.forward = forward  # type: ignore[method-assign]
        try:
            yield
        finally:
            if had_own:
                model.forward = original  # type: ignore[method-assign]
            else:
                del model.forward

    def train(
        self,
        func: Callable[..., Any],
        arguments: Arguments,
        factor: float,
        backward: Callable[[torch.Tensor], Any],
        sync: GradientSync,
        watch: MisuseWatch,
    ) -> torch.Tensor:
        """One attempt: the first pass with the loss (times `factor`, its share of a larger mean), its `backward` to
        the model's outputs, the second pass in `sync`'s scopes (under `watch`, as micro-batches are); without
        gradients the loss alone. The loss, detached."""
        started = now() if self.timing else 0.0
        try:
            with watch:
                with self._intercepted():  # its backward too: a loss's backward hook may call the model (`Cached*`)
                    loss = self._cached_loss(func, arguments, factor, backward, sync, watch)
                rows = sum(call.batch.size for call in self.calls)
                self.replay(sync.scope, sync.micro_batch_done if sync.each_micro_batch else None)
            if self.timing:
                synchronized([loss])
                self.coupling.speed.record(self.size, now() - started, rows)
        finally:
            self.forget()
        loss = loss.detach()
        return loss if loss.dim() == 0 else loss.reshape(())

    def _cached_loss(
        self,
        func: Callable[..., Any],
        arguments: Arguments,
        factor: float,
        backward: Callable[[torch.Tensor], Any],
        sync: GradientSync,
        watch: MisuseWatch,
    ) -> torch.Tensor:
        """The first pass: the loss on the whole batch (times `factor`), backpropagated to the model's outputs."""
        args, kwargs = arguments
        loss = func(*args, **kwargs)
        watch.loss_done()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise loss_error(func, loss)
        self.coupling.rows_checked = self.coupling.rows_checked or self.rows_compared
        if not self.calls:
            raise CoupledRows(
                f"{self.label}: its loss couples rows, and it never called the model= given "
                f"({type(self.model).__name__}) with a batch of rows: gradient caching cuts at the model's "
                "calls. Pass the model the loss function calls, or groups= to say how its rows belong together"
            )
        if factor != 1.0:
            loss = loss * factor
        if torch.is_grad_enabled():
            with sync.scope(False):
                backward(loss)
        return loss

    def loss(self, func: Callable[..., Any], arguments: Arguments) -> Any:
        """The loss function on the whole batch (`arguments`), the model's calls in micro-batches without a graph;
        with gradients, their joined outputs as leaves that take one. Raises the `CoupledRows` error it was chosen
        for where the function never called the model (nothing to cut)."""
        args, kwargs = arguments
        with self._intercepted():
            value = func(*args, **kwargs)
        return value

    def _first_pass(self, original: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """One call of the model: in micro-batches without a graph, outputs joined; the call recorded for the second
        pass. A call without rows (no tensor with a batch dimension) runs as it is."""
        if self.inside:
            return original(*args, **kwargs)
        try:
            batch = ArgumentBatch(args, kwargs, name=f"{self.label}: the model's call")
        except ValueError:
            batch = None
        if batch is None or not batch.size:
            return original(*args, **kwargs)
        if torch.is_grad_enabled() and any(tensor.requires_grad for _, tensor in batch.tensors):
            raise ModelMixesRows(
                f"{_remedies(self.label)}. Its call got inputs that require gradients (another call's outputs, or "
                "tensors computed from parameters in the loss function): gradient caching reruns each call on its "
                "own, so they cannot be cached apart. Call the model on the data itself, or pass groups="
            )
        call = _call_of(batch, self.size, self.tokens)
        self.chunk_rows = max(self.chunk_rows, call.chunks[0][1] - call.chunks[0][0])
        if self.check_rows and not self.calls:
            self._check_rows(original, call)
        outputs = []
        self.inside = True
        try:
            for start, stop, width in call.chunks:
                call.states.append(RandomState(self.random_on))
                chunk_args, chunk_kwargs = call.batch.arguments(start, stop, width=width)
                with torch.no_grad():
                    output = original(*chunk_args, **chunk_kwargs)
                if call.sorted:  # its inputs passed through, as the call's own (while the micro-batch's are alive)
                    output = _passed_through(output, (chunk_args, chunk_kwargs), (args, kwargs))
                outputs.append(output)
            if call.width is not None:
                outputs = self._padded_back(original, call, outputs)
        finally:
            self.inside = False
        joined = _joined(outputs, [stop - start for start, stop, _ in call.chunks], self.label)
        if call.sorted:
            joined = _in_call_order(joined, restore_order(call.order or []))
        if torch.is_grad_enabled():
            joined = self._as_leaves(joined, call)
        self.calls.append(call)
        return joined

    def _padded_back(self, original: Callable[..., Any], call: _Call, outputs: List[Any]) -> List[Any]:
        """The trimmed micro-batches' outputs with their tensors by position (dim 1 as wide as their micro-batch)
        padded back to the call's width with zeros: what a trimmed position computes is padding (a loss that read it
        would depend on how much padding there is). An output is by position where its dim 1 follows the micro-batch's
        width; where every micro-batch has one width, the first row run one position wider (no graph, the random
        state put back) tells which outputs follow it."""
        widths = [width or 0 for _, _, width in call.chunks]
        found = [_by_path(output) for output in outputs]
        paths = set(found[0]).intersection(*found[1:])
        if len(set(widths)) > 1:
            positional = {
                path
                for path in paths
                if all(f[path].dim() >= 2 and f[path].shape[1] == width for f, width in zip(found, widths))
            }
        else:
            wider = widths[0] + 1
            probe_args, probe_kwargs = call.batch.arguments(0, 1, width=wider)
            state = RandomState(self.random_on)
            try:
                with torch.no_grad():
                    probe = _by_path(original(*probe_args, **probe_kwargs))
            finally:
                state.restore()
            positional = {
                path
                for path in paths
                if path in probe
                and probe[path].dim() >= 2
                and probe[path].shape[1] == wider
                and found[0][path].dim() >= 2
                and found[0][path].shape[1] == widths[0]
            }
        if not positional:
            return outputs
        return [_pad_paths(output, positional, call.width or 0) for output in outputs]

    def _as_leaves(self, output: Any, call: _Call) -> Any:
        """`output` with each floating-point tensor a leaf that takes a gradient (recorded on `call`)."""
        if isinstance(output, torch.Tensor):
            if output.is_floating_point() or output.is_complex():
                leaf = output.detach().requires_grad_(True)
                call.leaves.append(leaf)
                return leaf
            call.leaves.append(None)
            return output
        if isinstance(output, (tuple, list)):
            return rebuild_sequence(output, [self._as_leaves(item, call) for item in output])
        if isinstance(output, Mapping):
            leaves = {key: self._as_leaves(value, call) for key, value in _items(output)}
            return rebuild_mapping(output, {key: leaves[key] for key in output})
        return output

    def _check_rows(self, original: Callable[..., Any], call: _Call) -> None:
        """Refuse a model that mixes rows: BatchNorm in training mode by name; else the first micro-batch's outputs
        whole against its halves' (without gradients, in eval mode, the random state put back)."""
        mixing = mixing_modules(self.model)
        if mixing:
            raise ModelMixesRows(
                f"{_remedies(self.label)}. BatchNorm in training mode computes each batch's statistics from its "
                f"rows: {', '.join(mixing[:4])}{', ...' if len(mixing) > 4 else ''}"
            )
        start, stop, width = call.chunks[0]
        extended = stop - start < 2
        stop = min(call.batch.size, start + max(2, stop - start))  # micro-batches of one row: two, to compare
        if stop - start < 2:
            return  # one row in the call: nothing to compare it with
        middle = (start + stop) // 2
        state = RandomState(self.random_on)
        modes = [(module, module.training) for module in self.model.modules()]
        self.inside = True
        try:
            self.model.eval()
            with torch.no_grad():
                parts = []
                for first, last in ((start, stop), (start, middle), (middle, stop)):
                    chunk_args, chunk_kwargs = call.batch.arguments(first, last, width=width)
                    parts.append(original(*chunk_args, **chunk_kwargs))
        except Exception as error:
            if not (extended and should_reduce_batch_size(error)):
                raise
            # two rows do not fit together even without gradients: the forward cannot be compared with its halves
            log.warning(
                "toma: %s: could not check that the model treats rows independently (2 rows ran out of memory without "
                "gradients); BatchNorm was checked by name, and gradient caching trains on as if it does",
                self.label,
            )
            self.rows_compared = True
            return
        finally:
            self.inside = False
            for module, training in modes:
                module.training = training
            state.restore()
        whole = _tensors(_joined(parts[:1], [stop - start], self.label))
        halves = _tensors(_joined(parts[1:], [middle - start, stop - middle], self.label))
        allowed = tolerance(self.model)
        for index, (a, b) in enumerate(zip(whole, halves)):
            if not (a.is_floating_point() or a.is_complex()):
                continue
            if a.shape != b.shape:
                raise ModelMixesRows(
                    f"{_remedies(self.label)}. Its output {index} is {tuple(a.shape)} for {stop - start} rows but "
                    f"{tuple(b.shape)} joined from its halves: its outputs are not by rows"
                )
            scale = float(a.detach().abs().max()) if a.numel() else 0.0
            difference = float((a - b).abs().max()) / scale if scale > 0 else float((a - b).abs().max())
            if difference > allowed:
                raise ModelMixesRows(
                    f"{_remedies(self.label)}. The first {stop - start} rows of its call gave output {index} "
                    f"{tuple(a.shape)} with a relative difference of {difference:.2g} from its two halves' (in eval "
                    "mode, without gradients): the forward mixes rows"
                )
        self.rows_compared = True
        log.debug("toma: %s: the model treats rows independently (checked once)", self.label)

    def replay(self, scope: Callable[[bool], Any], done: Optional[Callable[[], None]] = None) -> None:
        """The second pass: each call's micro-batches again with their graph, their random state and autocast as in
        the first, each backpropagating its slice of its outputs' cached gradients; within `scope(last)` (the
        gradient sync's context, `last` for the final one), `done()` after each where given. The random state is
        left as the loss left it."""
        self.after_loss = RandomState(self.random_on)
        original = self.original
        # only the calls the loss backpropagated to (not one made under no_grad, nor one whose outputs it ignored)
        calls = [(call, [None if leaf is None else leaf.grad for leaf in call.leaves]) for call in self.calls]
        calls = [(call, grads) for call, grads in calls if any(grad is not None for grad in grads)]
        for call in self.calls:  # the outputs themselves are no longer needed, only their gradients: free them
            call.leaves = []
        total, index = sum(len(call.chunks) for call, _ in calls), 0
        outside = enabled_autocast()  # each backward pass outside autocast, as `toma.accumulation.backward` runs them
        for call, grads in calls:
            for (start, stop, width), rows, state in zip(call.chunks, call.rows, call.states):
                index += 1
                state.restore()
                chunk_args, chunk_kwargs = call.batch.arguments(start, stop, width=width)
                with scope(index == total):
                    with call.autocast.entered():
                        outputs = _tensors(original(*chunk_args, **chunk_kwargs))
                    pairs = [
                        (out, _slice_of(grad, rows, out))
                        for out, grad in zip(outputs, grads)
                        if grad is not None and out.requires_grad
                    ]
                    if pairs:
                        with _autocast_off(outside):
                            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
                    del outputs, pairs
                if done is not None:
                    done()
        self.after_loss.restore()

    def forget(self) -> None:
        """Drop what the attempt cached (outputs, their gradients), as soon as it is done or failed."""
        self.calls = []


class _Passed:
    """An input of the call that its micro-batch's output holds as it was given (a features dict passed through, as
    sentence-transformers' modules pass theirs): the call's own tensor in the joined output."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Passed) and other.tensor is self.tensor

    __hash__ = None  # type: ignore[assignment]


def _paired_tensors(chunk: Any, call: Any, found: Dict[int, torch.Tensor]) -> None:
    """Each tensor of a micro-batch's arguments (`chunk`) by id, paired with the call's own at the same place."""
    if isinstance(chunk, torch.Tensor):
        if isinstance(call, torch.Tensor):
            found[id(chunk)] = call
    elif isinstance(chunk, (tuple, list)) and isinstance(call, (tuple, list)) and len(chunk) == len(call):
        for a, b in zip(chunk, call):
            _paired_tensors(a, b, found)
    elif isinstance(chunk, Mapping) and isinstance(call, Mapping):
        for key, value in chunk.items():
            if key in call:
                _paired_tensors(value, call[key], found)


def _passed_through(output: Any, chunk: Arguments, given: Arguments) -> Any:
    """A sorted micro-batch's output with the inputs it passes through as it was given them (a features dict, as
    sentence-transformers' modules pass theirs) marked as the call's own (`_Passed`)."""
    inputs: Dict[int, torch.Tensor] = {}
    _paired_tensors(chunk, given, inputs)
    if not inputs:
        return output
    return map_tensors(output, lambda tensor: _Passed(inputs[id(tensor)]) if id(tensor) in inputs else tensor)


Path = Tuple[Any, ...]


def _by_path(output: Any, path: Path = ()) -> Dict[Path, torch.Tensor]:
    """The tensors of an output by where they sit (keys, indices)."""
    if isinstance(output, torch.Tensor):
        return {path: output}
    found: Dict[Path, torch.Tensor] = {}
    if isinstance(output, (tuple, list)):
        for index, item in enumerate(output):
            found.update(_by_path(item, path + (index,)))
    elif isinstance(output, Mapping):
        for key, value in output.items():
            found.update(_by_path(value, path + (key,)))
    return found


def _pad_paths(output: Any, paths: Any, width: int, path: Path = ()) -> Any:
    """`output` with the tensors at `paths` padded with zeros along dim 1 to `width`."""
    if isinstance(output, torch.Tensor):
        if path not in paths or output.shape[1] >= width:
            return output
        pad = output.new_zeros((output.shape[0], width - output.shape[1], *output.shape[2:]))
        return torch.cat([output, pad], 1)
    if isinstance(output, (tuple, list)):
        return rebuild_sequence(output, [_pad_paths(item, paths, width, path + (i,)) for i, item in enumerate(output)])
    if isinstance(output, Mapping):
        return rebuild_mapping(output, {k: _pad_paths(v, paths, width, path + (k,)) for k, v in output.items()})
    return output


def _in_call_order(output: Any, inverse: List[int]) -> Any:
    """The joined output of a sorted call with its rows put back in the call's order, its passed-through inputs as
    the call gave them."""
    index: Dict[torch.device, torch.Tensor] = {}

    def back(obj: Any) -> Any:
        if isinstance(obj, _Passed):
            return obj.tensor
        if isinstance(obj, torch.Tensor):
            if obj.dim() == 0:
                return obj
            if obj.device not in index:
                index[obj.device] = torch.tensor(inverse, dtype=torch.long, device=obj.device)
            return obj.index_select(0, index[obj.device])
        if isinstance(obj, (tuple, list)):
            return rebuild_sequence(obj, [back(item) for item in obj])
        if isinstance(obj, Mapping):
            return rebuild_mapping(obj, {key: back(value) for key, value in obj.items()})
        return obj

    return back(output)


def _slice_of(grad: torch.Tensor, rows: Any, output: torch.Tensor) -> torch.Tensor:
    """A micro-batch's slice of an output's gradient: its rows (in the call's order), narrowed along dim 1 to the
    micro-batch's trimmed width where the output was padded back."""
    part = grad[rows] if isinstance(rows, slice) else grad.index_select(0, rows.to(grad.device))
    if output.dim() >= 2 and part.dim() >= 2 and part.shape[1] > output.shape[1]:
        part = part[:, : output.shape[1]]
    return part


def _joined(outputs: List[Any], rows: List[int], label: str) -> Any:
    """The micro-batches' outputs of one call as one output: tensors joined along dim 0 (each must hold its
    micro-batch's rows), containers rebuilt; anything else must be the same in every micro-batch."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        for output, count in zip(outputs, rows):
            if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[0] != count:
                shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
                scalar = isinstance(output, torch.Tensor) and output.dim() == 0
                raise ModelMixesRows(
                    f"{_remedies(label)}. Its output {shape} for a micro-batch of {count} rows is not one row per "
                    "input row, so its rows cannot be cached apart"
                    + (
                        " (a loss the model computes itself: compute the loss outside the model from its outputs, "
                        "or, where its rows are independent and it averages over tokens, give weight= what it "
                        "averages over and it trains in plain micro-batches)"
                        if scalar
                        else ""
                    )
                )
            if output.shape[1:] != first.shape[1:]:
                raise ModelMixesRows(
                    f"{_remedies(label)}. Its outputs {tuple(first.shape)} and {tuple(output.shape)} for two "
                    "micro-batches differ beyond their rows: they cannot be joined into the whole batch's"
                )
        return first if len(outputs) == 1 else torch.cat(outputs)
    if isinstance(first, (tuple, list)):
        if any(not isinstance(output, (tuple, list)) or len(output) != len(first) for output in outputs):
            raise ModelMixesRows(f"{_remedies(label)}. Its outputs differ in length between micro-batches")
        return rebuild_sequence(first, [_joined(list(items), rows, label) for items in zip(*outputs)])
    if isinstance(first, Mapping):
        if any(not isinstance(output, Mapping) or set(output) != set(first) for output in outputs):
            raise ModelMixesRows(f"{_remedies(label)}. Its outputs hold other keys in different micro-batches")
        return rebuild_mapping(first, {key: _joined([o[key] for o in outputs], rows, label) for key in first})
    if not all(output is first or _same(output, first) for output in outputs[1:]):
        raise ModelMixesRows(
            f"{_remedies(label)}. Its output {type(first).__name__} differs between micro-batches and is not a tensor "
            "of rows"
        )
    return first


def _same(a: Any, b: Any) -> bool:
    """Whether two outputs that are not tensors are the same (False where comparing them says nothing clear)."""
    try:
        return bool(a == b)
    except Exception:
        return False


def with_calls_cut(
    model: torch.nn.Module, size: int, func: Callable[..., Any], arguments: Arguments, coupling: SplitCheck, label: str
) -> Any:
    """`func(*args, **kwargs)` without gradients, every call of `model` cut into micro-batches of `size` rows and their
    outputs joined: the evaluation of a loss that couples rows, the whole batch's (never an average of parts's
    losses). The model is checked to treat rows independently once (`coupling.rows_checked`)."""
    cache = GradientCache(model, size, [], coupling, label)
    try:
        with torch.no_grad():
            found = cache.loss(func, arguments)
        coupling.rows_checked = coupling.rows_checked or cache.rows_compared
        if not cache.calls:
            raise CoupledRows(
                f"{label}: its loss couples rows, and it never called the model ({type(model).__name__}) with a batch "
                "of rows: its calls cannot be cut, and its loss is not an average of chunks"
            )
        return found
    finally:
        cache.forget()


class CutCalls(BatchStep):
    """One evaluation of a loss that couples rows as a step of the engine: `func(*args, **kwargs)` with `model`'s calls
    cut at the attempt's size (`with_calls_cut`); its effective size at most `rows`, the batch's, so that a retry
    shrinks from there."""

    size_name = "evaluation chunk size"
    __slots__ = ("model", "rows", "coupling")

    def __init__(
        self,
        model: torch.nn.Module,
        func: Callable[..., Any],
        arguments: Arguments,
        rows: int,
        coupling: SplitCheck,
        name: str,
    ) -> None:
        super().__init__(func, *arguments, name=name)
        self.model, self.rows, self.coupling = model, rows, coupling

    @property
    def device(self) -> Optional[torch.device]:
        return next((p.device for p in self.model.parameters()), None)

    def effective(self, size: int) -> int:
        return min(size, self.rows)

    def __call__(self, size: int) -> bool:
        label = self.name or "evaluation"
        self.result = with_calls_cut(self.model, size, self.func, (self.args, self.kwargs), self.coupling, label)
        return True
