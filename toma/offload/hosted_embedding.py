"""`toma.HostedEmbedding`: an embedding table, and its optimizer's per-row state, kept in host memory.

The device holds only the rows a batch touches. `forward` gathers those rows (once each), moves them to the
device and looks the batch up in them with autograd, as `nn.Embedding` would; `step()` runs the given
optimizer on the touched rows with their hosted state (lazily, see `toma.offload.row_optimizer`), in parts whose size
adapts to device memory like every toma form, and writes rows and state back to the host.
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from toma.batching.transfer import Pending, Transfers, check_device
from toma.core.arguments import check_size
from toma.core.caches import GlobalBatchsizeCache
from toma.core.runner import Runner
from toma.core.steps import RangeStep
from toma.memory.backends import backend_for
from toma.offload import pinned
from toma.offload.first_gradient import on_first_gradient
from toma.offload.row_optimizer import RowState, clone, initial_state, probe, step_rows
from toma.sizing.defaults import CALLS
from toma.sizing.policies import SizePolicy, check_policy

try:
    from torch.amp import GradScaler
except ImportError:  # torch < 2.3
    from torch.cuda.amp import GradScaler  # type: ignore[assignment]

__all__ = ["HostedEmbedding", "OptimizerFactory"]

OptimizerFactory = Callable[[List[torch.Tensor]], torch.optim.Optimizer]

_INTEGER_TYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class HostedEmbedding(nn.Module):
    """An `nn.Embedding` whose table (`.weight`) and optimizer state live in host memory (page-locked when the
    rows are used on a CUDA device), for tables and optimizer state larger than the device.

    `optimizer` builds the optimizer from a list of parameters, e.g. `lambda params: torch.optim.Adam(params,
    lr=1e-3)`. Call `step()` after `backward()`, in place of the optimizer's own step (`.optimizer` is the
    optimizer, for learning-rate schedulers). Updates are lazy, like `SparseAdam`: a step runs the optimizer on
    the rows the batch touched, with their state, as if they were the whole parameter; rows a batch does not
    use, and their state, are left untouched (no decay of their moments, no weight decay). State shared by all
    rows, such as Adam's step count, counts every `step()` a backward pass reached, also one whose batch looked
    up no rows (as SparseAdam counts it). A row's state starts as the optimizer leaves a zero row after a zero
    gradient (zeros for Adam and RMSprop, `initial_accumulator_value` for Adagrad, `lr` for Rprop's step
    sizes). With Adam this is `nn.Embedding(sparse=True)` with `SparseAdam`.

    The factory is also called on a few probe rows when the module is made, to check that the optimizer's
    lazy update can equal its update of the whole table on those rows; one whose step needs a closure
    (LBFGS), that takes only sparse gradients (SparseAdam: use Adam) or whose rows depend on each other
    (Muon, Adafactor) is refused with a ValueError that says why. Of `torch.optim`, ASGD, Adadelta, Adagrad,
    Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Rprop and SGD train.

    Mixed precision: `step(scaler)` with the `torch.amp.GradScaler` that scaled the loss unscales the rows'
    gradients and skips the step when they hold an inf or NaN, as `scaler.step(optimizer)` does, and tells the
    scaler (call it before `scaler.update()`).

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
        given = check_policy(policy, "policy")
        self._factory = optimizer
        placeholder = torch.zeros(1, self.embedding_dim, dtype=dtype, device=self.device)
        built = self._build([placeholder])
        self.optimizer = built
        self._placeholder = placeholder
        # State an optimizer makes when it is built (Adagrad's sums), not at its first step (Adam's moments).
        self._built_state: Dict[str, Any] = dict(built.state.pop(placeholder, {}))
        probe_device = torch.device("cpu") if self.device.type == "meta" else self.device
        self._layout: RowState = probe(built, self._build, self.embedding_dim, dtype, probe_device)
        weight = self._host_empty((self.num_embeddings, self.embedding_dim), dtype)
        nn.init.normal_(weight)
        self.register_buffer("weight", weight)
        self._rows: Optional[Dict[str, torch.Tensor]] = None  # per-row state tables, made at the first step
        self._shared: Optional[Dict[str, Any]] = None  # state for all rows, as the last step left it
        # (rows' ids, device rows) of the lookups a backward pass reached since the last step
        self._pending: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._prefetched: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Pending]] = None
        self._transfers = Transfers(self.device)
        self._sizes = GlobalBatchsizeCache()
        self._runner = Runner(CALLS, policy=given, cache=self._sizes)
        self.resident_rows = 0  # distinct rows the last forward put on the device
        self.step_rows = 0  # rows updated at once on the device in the last step (fewer when memory is short)

    @property
    def policy(self) -> Optional[SizePolicy]:
        """The sizing policy given for the steps' parts (None: `toma.DEFAULT_POLICY` once assigned, else Halving);
        assignable."""
        return self._runner.policy

    @policy.setter
    def policy(self, policy: Optional[SizePolicy]) -> None:
        self._runner = self._runner.with_policy(policy)

    def _build(self, params: List[torch.Tensor]) -> torch.optim.Optimizer:
        built = self._factory(params)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must return a torch.optim.Optimizer when called with a list of parameters, got {built!r}"
            )
        return built

    @property
    def _pin(self) -> bool:
        """Whether tables are page-locked: only for rows used on a device whose copies from the host go through
        page-locked memory, CUDA's (a CPU table never touches CUDA)."""
        return backend_for(self.device).pins_host_memory

    def _host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor for a table: page-locked for copies to a CUDA device (`toma.offload.pinned`:
        exactly its size, unlocked when freed), ordinary memory otherwise."""
        if self._pin:
            return pinned.empty(shape, dtype, self.device)
        return torch.empty(tuple(shape), dtype=dtype)

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
                raise IndexError(f"indices holds {bad}, outside the table's rows [0, {self.num_embeddings})")
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
            # queued for step() when a backward pass reaches it: a lookup none reaches is freed with its output
            on_first_gradient(rows, self, lambda module, reached: module._pending.append((unique, reached)))
        return F.embedding(inverse.to(self.device).reshape(indices.shape), rows)

    # --- updating rows -----------------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients the rows looked up got since the last step. A parent module's `zero_grad()` does
        not reach them (the table is no parameter): call this one too where gradients are discarded unstepped."""
        self._pending = []
        super().zero_grad(set_to_none)

    def pending_mark(self) -> int:
        """`toma.accumulation.rollback.PendingState`: how many lookups are queued for `step()`."""
        return len(self._pending)

    def pending_rewind(self, mark: int) -> None:
        """Drop the lookups a failed attempt queued (under `toma.accumulate`), so `step()` counts each once."""
        del self._pending[mark:]

    def step(self, scaler: Optional[GradScaler] = None) -> None:
        """Update the rows used since the last step with the optimizer, from their gradients; nothing happens
        when no backward pass reached them (a backward pass that reached a lookup of no rows is a step for the
        shared state). `scaler`: the `torch.amp.GradScaler` that scaled the loss; the gradients are unscaled and
        an inf or NaN among them skips the step and is reported to the scaler, as `scaler.step()` does."""
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
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
        if scaler is not None and not self._unscale(scaler, rows, grad):  # type: ignore[arg-type]
            return
        update = _RowUpdate(self, unique, rows, grad)  # type: ignore[arg-type]
        try:
            if len(unique):
                # Sized against the whole table, so a small step never caps the parts of a later, larger one.
                self._runner.perform(update, self.num_embeddings)
            else:  # a lookup of no rows: the shared state (a step count) counts the step, as SparseAdam's does
                update.call(0, 0)
        finally:  # also when a later part failed for good: the rows written so far stepped with this state
            self._shared = update.shared_after if update.shared_after is not None else self._shared
        self._refresh_prefetched(unique)

    def _unscale(self, scaler: GradScaler, rows: torch.Tensor, grad: torch.Tensor) -> bool:
        """Unscale `grad` in place through `scaler.unscale_` on the optimizer holding `rows`, which records an
        inf/NaN for `scaler.update()`; False when there is one (the step is skipped)."""
        if not scaler.is_enabled():
            return True
        if grad.dtype == torch.float16:
            raise TypeError(
                "step(scaler=...) needs a float32 (or bfloat16) table: a GradScaler cannot unscale float16 "
                "gradients, and float16 rows would lose the small updates it protects; make the table with "
                "dtype=torch.float32 and run the model under torch.autocast"
            )
        group = self.optimizer.param_groups[0]
        rows.grad = grad
        group["params"] = [rows]
        try:
            scaler.unscale_(self.optimizer)
        finally:
            group["params"] = [self._placeholder]
            rows.grad = None
        return bool(torch.isfinite(grad).all())

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
            return initial_state(self._built_state, self._layout.per_row, len(ids))
        gathered = {key: table.index_select(0, ids) for key, table in (self._rows or {}).items()}
        state = {key: clone(value) for key, value in (self._shared or {}).items()}
        state.update(self._transfers.move(gathered))
        return state

    def _write(self, ids: torch.Tensor, rows: torch.Tensor, state: Dict[str, Any]) -> Dict[str, Any]:
        """Put updated rows and their state back on the host; returns the shared state. What can fail (new state
        tables, the copy back) comes before the first write, so a part that fails leaves the host as it was."""
        per_row, shared = self._layout.split(state)
        tables = dict(self._rows or {})
        missing = {key: value for key, value in per_row.items() if key not in tables}
        if missing:
            tables.update(self._new_tables(missing))
        host_rows, host_state = self._transfers.to_host((rows, per_row)).take(copy=False)
        self.weight.index_copy_(0, ids, host_rows)
        for key, value in host_state.items():
            tables[key].index_copy_(0, ids, value)
        self._rows = tables
        return shared

    def _new_tables(self, per_row: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """A table for each per-row state entry, every row as a row never updated has it."""
        tables = {}
        for key, value in per_row.items():
            table = self._host_empty((self.num_embeddings, *value.shape[1:]), value.dtype)
            fresh = self._layout.fresh.get(key)
            start = fresh.to(value.dtype).expand_as(table) if fresh is not None else torch.zeros((), dtype=value.dtype)
            table.copy_(start)
            tables[key] = table
        return tables

    # --- saving ------------------------------------------------------------------------------------------

    def _table_for(self, kept: Optional[torch.Tensor], saved: torch.Tensor) -> torch.Tensor:
        """A host table holding `saved`: the one in use when it has the same shape and dtype (loading a state
        dict then locks no second copy of the table's memory), else a new one."""
        target = kept if kept is not None and _same_layout(kept, saved) else self._host_empty(saved.shape, saved.dtype)
        return target.copy_(saved.detach())

    def get_extra_state(self) -> Dict[str, Any]:
        groups = [
            {key: value for key, value in group.items() if key != "params"} for group in self.optimizer.param_groups
        ]
        return {"rows": self._rows, "shared": self._shared, "param_groups": groups}

    def set_extra_state(self, state: Dict[str, Any]) -> None:
        rows = state.get("rows")
        kept = self._rows or {}
        self._rows = (
            None if rows is None else {key: self._table_for(kept.get(key), table) for key, table in rows.items()}
        )
        self._shared = None if state.get("shared") is None else {key: clone(v) for key, v in state["shared"].items()}
        for group, saved in zip(self.optimizer.param_groups, state.get("param_groups", [])):
            group.update(saved)
        self._pending, self._prefetched = [], None


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _same(saved: torch.Tensor, indices: torch.Tensor) -> bool:
    return saved.shape == indices.shape and bool(torch.equal(saved, indices.detach().to("cpu")))


class _RowUpdate(RangeStep):
    """The optimizer over the touched rows `[start, stop)` at a time, state moved in and written back."""

    size_name = "rows"
    __slots__ = ("table", "ids", "rows", "grad", "shared_after", "first", "dirty_until")

    def __init__(self, table: HostedEmbedding, ids: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
        super().__init__(table.optimizer.step, 0, len(ids), (), {}, name="HostedEmbedding.step", device=table.device)
        self.table, self.ids, self.rows, self.grad = table, ids, rows, grad
        self.shared_after: Optional[Dict[str, Any]] = None
        self.first = table._rows is None
        self.dirty_until = 0  # `rows` before this index may hold the update of a part that failed

    def call(self, start: int, stop: int) -> None:
        table = self.table
        ids = self.ids[start:stop]
        if start < self.dirty_until:  # a retry starts from the rows as the host table still has them
            part = table._transfers.move(table.weight.index_select(0, ids))
        else:
            part = self.rows[start:stop]
        try:
            state = table._state_for(ids, self.first)
            state = step_rows(table.optimizer, part, self.grad[start:stop], state, table._placeholder)
            self.shared_after = table._write(ids, part, state)
        except BaseException:
            # Updated on the device perhaps, but nothing written to the host (see `_write`).
            self.dirty_until = max(self.dirty_until, stop)
            raise
        table.step_rows = max(table.step_rows if start else 0, stop - start)
