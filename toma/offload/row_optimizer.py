"""A torch optimizer run on some rows of a table at a time, its state carried per row: lazy updates.

`probe()` runs the optimizer once on a few probe rows (when a `HostedEmbedding` is made) to learn which state
entries hold one row per parameter row (Adam's moments) and which are shared by all rows (its step count), and
what state a row has before its first update. It refuses an optimizer whose lazy update could not equal its
dense one on the rows it updates: a step that needs a closure (LBFGS), that takes no dense gradients
(SparseAdam), or whose rows do not update independently (checked by updating the probe rows together and in
parts of other sizes, over two steps at a learning rate of 0.01: Muon orthogonalises the whole matrix,
Adafactor keeps a factor shared by all rows).
"""

import copy
import inspect
from typing import Any, Callable, Dict, FrozenSet, List, Tuple

import torch

from toma.core.oom import should_reduce_batch_size

__all__ = ["Build", "RowState", "probe", "step_rows", "initial_state"]

Build = Callable[[List[torch.Tensor]], torch.optim.Optimizer]

_ROWS = 6  # probe rows; parts of other sizes (and a second run on one row fewer) tell rows from shared state
_PARTS = ((0, 4, 6), (0, 1, 6))  # where the probe's two steps cut the rows into parts
_TOLERANCE = 1e-4  # relative to the largest value compared: rounding passes, a dependence between rows does not
_RATE = 1e-2  # the probe's learning rate: updates well above rounding (the factory's may be 0 until a scheduler)


class RowState:
    """Which optimizer state entries are per row (`per_row`) and which shared by all rows (`shared`), and each
    per-row entry's value for a row never updated (`fresh`: one row each, on the CPU)."""

    __slots__ = ("per_row", "shared", "fresh")

    def __init__(self, per_row: FrozenSet[str], shared: FrozenSet[str], fresh: Dict[str, torch.Tensor]) -> None:
        self.per_row, self.shared, self.fresh = per_row, shared, fresh

    def split(self, state: Dict[str, Any]) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        """`state` as (per-row entries, shared entries); an entry the probe never saw cannot be told apart."""
        unknown = sorted(key for key in state if key not in self.per_row and key not in self.shared)
        if unknown:
            raise RuntimeError(
                f"the optimizer made state {', '.join(map(repr, unknown))} that it did not make on the probe rows "
                "when the HostedEmbedding was built: it cannot tell whether it holds a row for each row of the table"
            )
        per_row = {key: value for key, value in state.items() if key in self.per_row}
        return per_row, {key: value for key, value in state.items() if key not in self.per_row}


def clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def initial_state(built: Dict[str, Any], per_row: FrozenSet[str], rows: int) -> Dict[str, Any]:
    """The state of `rows` rows at the optimizer's first step: as it was built for one row (Adagrad's sums),
    each per-row entry repeated for every row; the optimizer makes the rest itself."""
    return {
        key: value[:1].expand(rows, *value.shape[1:]).clone() if key in per_row else clone(value)
        for key, value in built.items()
    }


def step_rows(
    optimizer: torch.optim.Optimizer,
    rows: torch.Tensor,
    grad: torch.Tensor,
    state: Dict[str, Any],
    rest: torch.Tensor,
) -> Dict[str, Any]:
    """One step of `optimizer` on `rows` (updated in place) with gradient `grad` and state `state`; returns the
    state after it. Its first parameter group holds `rest` again afterwards, also when the step fails."""
    group = optimizer.param_groups[0]
    optimizer.state[rows] = state
    group["params"] = [rows]
    rows.grad = grad
    try:
        optimizer.step()
        return optimizer.state.pop(rows)
    finally:
        optimizer.state.pop(rows, None)
        rows.grad = None
        group["params"] = [rest]


def _follows(value: Any, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows


def _close(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return bool(a == b)
    if a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    scale = float(torch.maximum(a.abs().max(), b.abs().max()))
    return float((a - b).abs().max()) <= _TOLERANCE * scale


class _Refused(Exception):
    """Why an optimizer cannot update rows lazily."""


def _run(step: Callable[[], Any], doing: str) -> Any:
    """`step()`; an error that is not out-of-memory becomes a refusal saying what the optimizer was doing."""
    try:
        return step()
    except Exception as error:
        if should_reduce_batch_size(error):
            raise
        raise _Refused(f"its step fails {doing} ({type(error).__name__}: {error})") from error


def probe(
    optimizer: torch.optim.Optimizer, build: Build, width: int, dtype: torch.dtype, device: torch.device
) -> RowState:
    """Check that `optimizer` (made by `build`, which makes more for the probe) can update rows of `width`
    lazily, and learn its state's layout; raises ValueError naming the optimizer and why not."""
    kind = type(optimizer)
    name = f"torch.optim.{kind.__name__}" if getattr(torch.optim, kind.__name__, None) is kind else kind.__qualname__
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise _Refused(
                "its step needs a closure that evaluates the loss again, over the whole parameter; "
                "HostedEmbedding.step() updates only the rows a batch touched"
            )
        per_row, shared = _check_rows(build, width, dtype, device)
        fresh = _fresh(build, width, dtype, device, per_row)
    except _Refused as refusal:
        hint = ""
        if isinstance(optimizer, torch.optim.SparseAdam):
            hint = "; use torch.optim.Adam, which HostedEmbedding applies lazily, as SparseAdam does"
        raise ValueError(f"optimizer builds {name}, which HostedEmbedding cannot use: {refusal}{hint}") from (
            refusal.__cause__
        )
    return RowState(per_row, shared, fresh)


def _check_rows(
    build: Build, width: int, dtype: torch.dtype, device: torch.device
) -> Tuple[FrozenSet[str], FrozenSet[str]]:
    """The per-row and the shared state entries, once rows updated together are shown to equal rows updated in
    parts."""
    exact = torch.float64 if dtype == torch.float64 else torch.float32  # differences above rounding
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(_ROWS, width, generator=generator, dtype=exact).to(device)
    grads = [torch.randn(_ROWS, width, generator=generator, dtype=exact).to(device) for _ in _PARTS]

    together, state = _dense(build, start, grads, _ROWS)
    _, fewer = _dense(build, start, grads, _ROWS - 1)
    per_row = frozenset(
        key for key, value in state.items() if _follows(value, _ROWS) and _follows(fewer.get(key), _ROWS - 1)
    )

    placeholder = torch.zeros(1, width, dtype=exact, device=device)
    optimizer = _probing(build, [placeholder])
    built = dict(optimizer.state.pop(placeholder, {}))
    weight, tables, shared = _in_parts(optimizer, placeholder, start, grads, built, per_row, state)
    _compare(state, per_row, start, together, weight, tables, shared)
    empty = torch.zeros(0, width, dtype=exact, device=device)
    carried = {key: clone(value) for key, value in shared.items()}
    carried.update({key: table[:0].clone() for key, table in tables.items()})
    _run(lambda: step_rows(optimizer, empty, torch.zeros_like(empty), carried, placeholder), "on a step of no rows")
    return per_row, (frozenset(built) | frozenset(state)) - per_row


def _probing(build: Build, params: List[torch.Tensor]) -> torch.optim.Optimizer:
    """`build(params)` at the probe's learning rate, so that its updates stand well above rounding."""
    optimizer = build(params)
    for group in optimizer.param_groups:
        if isinstance(group.get("lr"), (int, float)):
            group["lr"] = _RATE
    return optimizer


def _dense(
    build: Build, start: torch.Tensor, grads: List[torch.Tensor], rows: int
) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """The first `rows` probe rows updated together over the probe's steps (the reference): weight and state."""
    weight = start[:rows].clone()
    optimizer = _probing(build, [weight])
    for grad in grads:
        weight.grad = grad[:rows].clone()
        _run(optimizer.step, f"on {rows} rows with a dense gradient")
    return weight, dict(optimizer.state[weight])


def _in_parts(
    optimizer: torch.optim.Optimizer,
    placeholder: torch.Tensor,
    start: torch.Tensor,
    grads: List[torch.Tensor],
    built: Dict[str, Any],
    per_row: FrozenSet[str],
    state: Dict[str, Any],
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor], Dict[str, Any]]:
    """The probe rows updated in the parts `_PARTS` cuts, each part's state carried per row as a hosted table
    carries it: the weight, the per-row state tables and the shared state after the last step."""
    weight = start.clone()
    tables: Dict[str, torch.Tensor] = {}
    shared: Dict[str, Any] = {}
    for index, (grad, cuts) in enumerate(zip(grads, _PARTS)):
        after: Dict[str, Any] = {}
        for low, high in zip(cuts, cuts[1:]):
            part = weight[low:high].clone()
            if index == 0:
                carried = initial_state(built, per_row, high - low)
            else:
                carried = {key: clone(value) for key, value in shared.items()}
                carried.update({key: table[low:high].clone() for key, table in tables.items()})
            new = _run(
                lambda: step_rows(optimizer, part, grad[low:high].clone(), carried, placeholder),
                f"when the rows are updated in parts of {high - low} of {_ROWS}",
            )
            weight[low:high] = part
            for key in per_row:
                if key not in new:
                    raise _Refused(f"it keeps no {key!r} state for a part of {high - low} rows")
                tables.setdefault(key, torch.empty_like(state[key]))[low:high] = new[key]
            after = {key: value for key, value in new.items() if key not in per_row}
        shared = after
    return weight, tables, shared


def _compare(
    state: Dict[str, Any],
    per_row: FrozenSet[str],
    start: torch.Tensor,
    together: torch.Tensor,
    weight: torch.Tensor,
    tables: Dict[str, torch.Tensor],
    shared: Dict[str, Any],
) -> None:
    """Refuse an optimizer whose rows updated in parts do not end as the rows updated together (weight and state)."""
    differing = sorted(key for key, value in state.items() if key not in per_row and not _close(shared.get(key), value))
    if differing:
        raise _Refused(
            f"it keeps state shared by all rows that depends on their gradients ({', '.join(differing)}), so its "
            "update of the rows a batch touched would differ from its update of the whole table"
        )
    if not _close(weight - start, together - start) or not all(_close(tables[key], state[key]) for key in per_row):
        raise _Refused(
            "it does not update rows independently: rows updated together do not end as the same rows updated "
            "in parts do, so its update of the rows a batch touched would differ from its update of the whole table"
        )


def _fresh(
    build: Build, width: int, dtype: torch.dtype, device: torch.device, per_row: FrozenSet[str]
) -> Dict[str, torch.Tensor]:
    """Each per-row entry of a row never updated: as the optimizer leaves a zero row after a zero gradient, or as
    it built it (state made when the optimizer is built, such as Adagrad's sums)."""
    zero = torch.zeros(1, width, dtype=dtype, device=device)
    optimizer = build([zero])
    built = dict(optimizer.state.get(zero, {}))
    zero.grad = torch.zeros_like(zero)
    _run(optimizer.step, "on one row with a zero gradient")
    fresh = {}
    for key, value in optimizer.state.get(zero, {}).items():
        if key in per_row:
            fresh[key] = built.get(key, value)[0].detach().to("cpu")
    return fresh
