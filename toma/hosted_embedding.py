"""`toma.HostedEmbedding`: an embedding table, and its optimizer's per-row state, kept in host memory.

The device holds only the rows a batch touches. `forward` gathers those rows (once each), moves them to the
device and looks the batch up in them with autograd, as `nn.Embedding` would; `step()` runs the given
optimizer (any `torch.optim` optimizer) on the touched rows with their hosted state, in parts whose size
adapts to device memory like every toma form, and writes rows and state back to the host.
"""

import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from toma import engine
from toma.arguments import check_size
from toma.batchsize_cache import GlobalBatchsizeCache
from toma.policy import SizePolicy, check_policy, get_default_policy
from toma.transfer import Pending, Transfers, check_device

__all__ = ["HostedEmbedding", "OptimizerFactory"]

OptimizerFactory = Callable[[List[torch.Tensor]], torch.optim.Optimizer]

_INTEGER_TYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _is_rows(value: Any, like: torch.Tensor) -> bool:
    """A state entry that holds one row per parameter row (Adam's moments), as opposed to one for all rows
    (Adam's step count)."""
    return isinstance(value, torch.Tensor) and value.shape == like.shape


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


class HostedEmbedding(nn.Module):
    """An `nn.Embedding` whose table (`.weight`) and optimizer state live in host memory (pinned where CUDA is
    available), for tables and optimizer state larger than the device.

    `optimizer` builds the optimizer from a list of parameters, e.g. `lambda params: torch.optim.Adam(params,
    lr=1e-3)`; any `torch.optim` optimizer works. Call `step()` after `backward()`, in place of the optimizer's
    own step (`.optimizer` is the optimizer, for learning-rate schedulers). Updates are lazy, like
    `SparseAdam`: rows a batch does not use, and their optimizer state, are left untouched (no decay of their
    moments, no weight decay); state shared by all rows, such as Adam's step count, counts every `step()`.
    A row's state starts as the optimizer leaves a zero row after a zero gradient (zeros for Adam and
    RMSprop, `initial_accumulator_value` for Adagrad).

    The table stays on the host under `.to()`/`.cuda()`; those move where the rows are used (`.device`).
    `prefetch(indices)` starts moving the next batch's rows while this one computes. Under DDP each rank would
    need the touched rows' gradients combined before `step()`; this module is single-process for now.
    """

    weight: torch.Tensor

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        optimizer: OptimizerFactory,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
        policy: Optional[SizePolicy] = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = check_size(num_embeddings, "num_embeddings")
        self.embedding_dim = check_size(embedding_dim, "embedding_dim")
        if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "optimizer must be a function that builds the optimizer from a list of parameters, e.g. "
                f"lambda params: torch.optim.Adam(params, lr=1e-3); got {optimizer!r}"
            )
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.device = check_device(device, "device")
        self.policy = check_policy(policy, "policy")
        weight = torch.empty(self.num_embeddings, self.embedding_dim, dtype=dtype, pin_memory=self._pin)
        nn.init.normal_(weight)
        self.register_buffer("weight", weight)
        self._factory = optimizer
        placeholder = torch.zeros(1, self.embedding_dim, dtype=dtype, device=self.device)
        built = optimizer([placeholder])
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must return a torch.optim.Optimizer when called with a list of parameters, got {built!r}"
            )
        self.optimizer = built
        self._placeholder = placeholder
        # State an optimizer makes when it is built (Adagrad's sums), not at its first step (Adam's moments).
        self._built_state: Dict[str, Any] = dict(built.state.pop(placeholder, {}))
        self._rows: Optional[Dict[str, torch.Tensor]] = None  # per-row state tables, made at the first step
        self._shared: Optional[Dict[str, Any]] = None  # state for all rows, as the last step left it
        self._pending: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (rows' ids, device rows) since the last step
        self._prefetched: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Pending]] = None
        self._transfers = Transfers(self.device)
        self._sizes = GlobalBatchsizeCache()
        self.resident_rows = 0  # distinct rows the last forward put on the device
        self.step_rows = 0  # rows updated at once on the device in the last step (fewer when memory is short)

    @property
    def _pin(self) -> bool:
        return torch.cuda.is_available()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, device={self.device}, optimizer={type(self.optimizer).__name__}"

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "HostedEmbedding":
        """The table and its state stay on the host; where rows are used follows the move."""
        target = fn(torch.empty(0, device=self.device)).device
        if target != self.device:
            self.device = check_device(target, "device")
            self._transfers = Transfers(self.device)
            self._placeholder = self._placeholder.to(self.device)
            self._built_state = {key: _to(value, self.device) for key, value in self._built_state.items()}
            self._pending, self._prefetched = [], None
        return self

    # --- looking rows up -------------------------------------------------------------------------------

    def _check(self, indices: Any) -> torch.Tensor:
        """Integer indices within the table, checked before anything moves."""
        if not isinstance(indices, torch.Tensor):
            raise TypeError(f"indices must be a tensor of integer row indices, got {type(indices).__name__}")
        if indices.dtype not in _INTEGER_TYPES:
            raise TypeError(f"indices must hold integers (torch.long, say), got {indices.dtype}")
        if indices.numel():
            low, high = int(indices.min()), int(indices.max())
            if low < 0 or high >= self.num_embeddings:
                bad = low if low < 0 else high
                raise IndexError(
                    f"indices holds {bad}, outside the table's rows [0, {self.num_embeddings})"
                )
        return indices

    def _gather(self, indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Pending]:
        flat = indices.detach().reshape(-1).to("cpu", torch.long)
        unique, inverse = torch.unique(flat, return_inverse=True)
        return unique, inverse, self._transfers.prefetch(self.weight.index_select(0, unique))

    def prefetch(self, indices: torch.Tensor) -> None:
        """Start moving the rows `indices` uses to the device, so the next `forward(indices)` finds them there
        (a `step()` in between is taken into account)."""
        indices = self._check(indices)
        unique, inverse, pending = self._gather(indices)
        self._prefetched = (indices.detach().to("cpu"), unique, inverse, pending)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        """The rows `indices` names, shaped `indices.shape + (embedding_dim,)`, on the device."""
        indices = self._check(indices)
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and _same(prefetched[0], indices):
            _, unique, inverse, pending = prefetched
        else:
            unique, inverse, pending = self._gather(indices)
        del prefetched
        rows = pending.take()
        self.resident_rows = int(unique.numel())
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._pending.append((unique, rows))
        return F.embedding(inverse.to(self.device).reshape(indices.shape), rows)

    # --- updating rows -----------------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the rows looked up since the last step (and their gradients)."""
        self._pending = []
        super().zero_grad(set_to_none)

    def step(self) -> None:
        """Update the rows used since the last step with the optimizer, from their gradients; nothing happens
        when no backward pass reached them."""
        pending, self._pending = self._pending, []
        used = [(unique, rows) for unique, rows in pending if rows.grad is not None]
        del pending
        if not used:
            return
        if len(used) == 1:
            unique, rows = used[0]
            grad = rows.grad
        else:  # several lookups: one gradient per distinct row
            unique, where = torch.unique(torch.cat([u for u, _ in used]), return_inverse=True)
            first = used[0][1]
            grad = torch.zeros(len(unique), self.embedding_dim, dtype=first.dtype, device=first.device)
            grad.index_add_(0, where.to(first.device), torch.cat([r.grad for _, r in used]))  # type: ignore[misc]
            rows = self._transfers.move(self.weight.index_select(0, unique))
        rows = rows.detach()
        del used
        update = _RowUpdate(self, unique, rows, grad)  # type: ignore[arg-type]
        # Sized against the whole table, so a small step never caps the parts of a later, larger one.
        engine.drive(update, self._sizes, self.num_embeddings, self.policy or get_default_policy())
        self._shared = update.shared_after if update.shared_after is not None else self._shared
        self._refresh_prefetched(unique)

    def _refresh_prefetched(self, updated: torch.Tensor) -> None:
        """Rows prefetched before this step and changed by it: moved again."""
        if self._prefetched is None:
            return
        indices, unique, inverse, pending = self._prefetched
        rows = pending.take()
        stale = torch.isin(unique, updated)
        if bool(stale.any()):
            rows[stale.to(rows.device)] = self._transfers.move(self.weight.index_select(0, unique[stale]))
        self._prefetched = (indices, unique, inverse, Pending(rows))

    def _state_for(self, ids: torch.Tensor, first: bool) -> Dict[str, Any]:
        """The optimizer state of rows `ids` on the device, shared entries as a copy (a failed part leaves
        the originals as they were). At the first step every row is new: the state the optimizer was built
        with, or none (it makes its own)."""
        if first:
            state = {key: _clone(value) for key, value in self._built_state.items() if not _is_rows(value, self._placeholder)}
            for key, value in self._built_state.items():
                if _is_rows(value, self._placeholder):
                    state[key] = value[:1].expand(len(ids), -1).clone()
            return state
        gathered = {key: table.index_select(0, ids) for key, table in (self._rows or {}).items()}
        state = {key: _clone(value) for key, value in (self._shared or {}).items()}
        state.update(self._transfers.move(gathered))
        return state

    def _write(self, ids: torch.Tensor, rows: torch.Tensor, state: Dict[str, Any]) -> Dict[str, Any]:
        """Put updated rows and their state back on the host; returns the shared state."""
        per_row = {key: value for key, value in state.items() if _is_rows(value, rows)}
        if self._rows is None:
            fresh = self._fresh_rows()
            tables = {}
            for key, value in per_row.items():
                table = torch.empty(self.num_embeddings, self.embedding_dim, dtype=value.dtype, pin_memory=self._pin)
                start = fresh.get(key)
                table.copy_(start.to(value.dtype).expand_as(table) if start is not None else torch.zeros(()))
                tables[key] = table
            self._rows = tables  # only once all are made: a part that fails here leaves no half-made state
        host = self._transfers.to_host((rows, per_row)).take(copy=False)
        self.weight.index_copy_(0, ids, host[0])
        for key, value in host[1].items():
            self._rows[key].index_copy_(0, ids, value)
        return {key: value for key, value in state.items() if key not in per_row}

    def _fresh_rows(self) -> Dict[str, torch.Tensor]:
        """Each per-row state entry of a row that has never been updated: as the optimizer leaves a zero row
        after a zero gradient (or as it built it, for state made when the optimizer is built)."""
        zero = torch.zeros(1, self.embedding_dim, dtype=self.weight.dtype, device=self.device)
        probe = self._factory([zero])
        built = dict(probe.state.get(zero, {}))
        zero.grad = torch.zeros_like(zero)
        probe.step()
        fresh = {}
        for key, value in probe.state.get(zero, {}).items():
            if _is_rows(value, zero):
                start = built.get(key, value)
                fresh[key] = start[0].detach().to("cpu")
        return fresh

    # --- saving ------------------------------------------------------------------------------------------

    def get_extra_state(self) -> Dict[str, Any]:
        groups = [{key: value for key, value in group.items() if key != "params"} for group in self.optimizer.param_groups]
        return {"rows": self._rows, "shared": self._shared, "param_groups": groups}

    def set_extra_state(self, state: Dict[str, Any]) -> None:
        rows = state.get("rows")
        self._rows = None if rows is None else {
            key: table.detach().to("cpu").clone().pin_memory() if self._pin else table.detach().to("cpu").clone()
            for key, table in rows.items()
        }
        self._shared = None if state.get("shared") is None else {key: _clone(v) for key, v in state["shared"].items()}
        for group, saved in zip(self.optimizer.param_groups, state.get("param_groups", [])):
            group.update(saved)
        self._pending, self._prefetched = [], None


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _same(saved: torch.Tensor, indices: torch.Tensor) -> bool:
    return saved.shape == indices.shape and bool(torch.equal(saved, indices.detach().to("cpu")))


class _RowUpdate(engine.RangeStep):
    """The optimizer over the touched rows `[start, stop)` at a time, state moved in and written back."""

    size_name = "rows"
    __slots__ = ("table", "ids", "rows", "grad", "shared_after", "first")

    def __init__(self, table: HostedEmbedding, ids: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
        super().__init__(table.optimizer.step, 0, len(ids), (), {}, name="HostedEmbedding.step", device=table.device)
        self.table, self.ids, self.rows, self.grad = table, ids, rows, grad
        self.shared_after: Optional[Dict[str, Any]] = None
        self.first = table._rows is None

    def call(self, start: int, stop: int) -> None:
        table, optimizer = self.table, self.table.optimizer
        ids = self.ids[start:stop]
        part = self.rows[start:stop]
        part.grad = self.grad[start:stop]
        group = optimizer.param_groups[0]
        try:
            optimizer.state[part] = table._state_for(ids, self.first)
            group["params"] = [part]
            optimizer.step()
            state = optimizer.state.pop(part)
        except BaseException:
            # A failed part may have changed its rows in place: back to the table's (still unchanged) values.
            optimizer.state.pop(part, None)
            part.grad = None
            part.copy_(table.weight.index_select(0, ids).to(part.device))
            raise
        finally:
            group["params"] = [table._placeholder]
        part.grad = None
        self.shared_after = table._write(ids, part, state)
        table.step_rows = max(table.step_rows if start else 0, stop - start)
