"""FSDP2 (`torch.distributed.fsdp.fully_shard`) as an accumulation needs it: every unit held unsharded for one
attempt at a logical batch, so that its micro-batches run no collective at all (a rank that runs out of memory
cannot leave another waiting in an all-gather or a reduce-scatter), and the gradients reduce-scattered, each rank
keeping its shard, only where the ranks agreed that every one of them got there (after the attempt, or after
each micro-batch: `toma.accumulation.sync`).

FSDP2 has no public way to reduce gradients it accumulated unsharded, nor to clear the state a forward or a
backward pass that raised half-way leaves behind (a unit's training state, the root's queued final callback).
Those private parts are used here and nowhere else, checked when a model is first seen: a torch release that
moved them gets an error naming this module and the releases it was written against, not a hang."""

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from toma.accumulation.fsdp2_agreed import AgreedAllGather, AgreedReduceScatter, CollectiveAgreements
from toma.accumulation.sharded_models import fsdp2_root, is_fsdp2
from toma.core.agreement import Agreement, RankFailed
from toma.core.oom import collective, should_reduce_batch_size
from toma.memory.reserve import room_for

__all__ = ["is_fsdp2", "fsdp2_root", "held_unsharded", "Fsdp2Changed", "UnshardedDoesNotFit", "ShardedUnits"]

WRITTEN_FOR = "torch 2.11 and 2.13"


class Fsdp2Changed(RuntimeError):
    """This torch's FSDP2 lacks a private part toma relies on."""


class UnshardedDoesNotFit(RuntimeError):
    """This rank cannot hold every unit of the model unsharded, as toma's FSDP2 accumulation does for a logical
    batch: no micro-batch size changes that, so it is not taken for an out-of-memory error to retry smaller."""


def _changed(what: str) -> Fsdp2Changed:
    return Fsdp2Changed(
        f"toma.accumulate with FSDP2: this torch ({torch.__version__}) has no {what}, which toma's FSDP2 support "
        f"(toma/accumulation/fsdp2.py) was written against ({WRITTEN_FOR}); accumulate without toma, or use a "
        "torch release it supports"
    )


def _groups(unit: FSDPModule) -> List[Any]:
    """A unit's parameter groups (one, or several in later releases)."""
    state = unit._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return [group for group in state._fsdp_param_groups if group is not None]
    if hasattr(state, "_fsdp_param_group"):
        return [] if state._fsdp_param_group is None else [state._fsdp_param_group]
    raise _changed("FSDPState._fsdp_param_groups")


class ShardedUnits:
    """The FSDP2 units of a root module: checked for room (`probe`), held unsharded without gradient sync for an
    attempt (`hold`), the unsharded gradients of the parameters that train reduce-scattered into sums of each
    rank's shard (`scatter_buffers`, `reduce_scatter`) that become the sharded gradients (`keep_sums`), and put
    back as they were (`release`; `reset` after an attempt that raised). In FSDP2's own schedule instead (the
    sharded mode): every collective of the passes agreed on first (`agree_before_collectives`)."""

    __slots__ = (
        "units", "params", "groups", "trained", "process_group", "rank", "world", "sums", "_settings", "_comms",
    )  # fmt: skip

    def __init__(self, root: torch.nn.Module) -> None:
        self.units: List[FSDPModule] = [m for m in root.modules() if isinstance(m, FSDPModule)]
        # Modules sharded together (`fully_shard([norm, head])`, as accelerate shards a model's tail) are units
        # of one parameter group: each group once, or its gradients are reduced again as zeros.
        groups = {id(group): group for unit in self.units for group in _groups(unit)}
        self.groups = list(groups.values())
        for group in self.groups:
            for name in ("_all_gather_comm", "_reduce_scatter_comm", "reduce_grads"):
                if not hasattr(group, name):
                    raise _changed(f"FSDPParamGroup.{name}")
        self.params = [param for group in self.groups for param in group.fsdp_params]
        # Per group, the parameters that train (frozen ones, LoRA's base weights, get no gradient, as in FSDP2)
        self.trained: List[Tuple[Any, List[Any]]] = []
        for param in self.params:
            for name in ("unsharded_param", "to_sharded_dtensor"):
                if not hasattr(type(param), name):
                    raise _changed(f"FSDPParam.{name}")
            for name in ("sharded_param", "sharded_size", "mesh_info", "unsharded_accumulated_grad"):
                if not hasattr(param, name):
                    raise _changed(f"FSDPParam.{name}")
        if not self.params:
            raise ValueError("toma.accumulate: the FSDP2 model has no sharded parameters")
        for group in self.groups:
            trained = [param for param in group.fsdp_params if param.sharded_param.requires_grad]
            if trained:
                self.trained.append((group, trained))
        for param in self.params:
            if getattr(param, "offload_to_cpu", False):
                raise NotImplementedError(
                    "toma.accumulate does not support FSDP2 with CPU offloading (CPUOffloadPolicy) yet"
                )
            if getattr(param, "is_dtensor", False):
                raise NotImplementedError(
                    "toma.accumulate supports FSDP2 over plain parameters; parameters that are DTensors already "
                    "(tensor parallelism) are not supported yet"
                )
            if param.mesh_info.mesh.ndim != 1 or not hasattr(param.mesh_info, "shard_process_group"):
                raise NotImplementedError(
                    "toma.accumulate supports FSDP2 on a 1-D device mesh (fully sharded); HSDP and replication are "
                    "not supported yet"
                )
        meshes = {tuple(dist.get_process_group_ranks(p.mesh_info.shard_process_group)) for p in self.params}
        if len(meshes) > 1:
            raise NotImplementedError("toma.accumulate: FSDP2 units sharded over different ranks are not supported")
        self.process_group = self.params[0].mesh_info.shard_process_group
        self.rank, self.world = dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        self.sums: Optional[List[torch.Tensor]] = None  # this attempt's reduced shards, when reduced per micro-batch
        self._settings: Optional[List[Tuple[Any, Any, Any]]] = None
        self._comms: Optional[List[Tuple[Any, Any, bool]]] = None  # each group's own, while agreements wrap them

    def probe(self, gradients: bool = True) -> None:
        """Before the ranks agree to unshard: whether this rank can allocate what the attempt holds whatever its
        micro-batch size, so that a rank short of memory says so in the agreement rather than leaving the others in
        an all-gather, or running out of memory at every size down to one row. Held: every unit's unsharded
        parameters and the largest unit's all-gather buffer; with `gradients` (training) also the unsharded
        gradients of the parameters that train (each one's, once its first backward pass reached it), the sums of
        their shards and the largest unit's reduce-scatter buffers (`scatter_buffers`). What it allocates is freed
        at once (a CUDA allocator keeps it cached for the unshard)."""
        needs: Dict[torch.device, int] = {}
        largest: Dict[torch.device, int] = {}
        trained = {id(param) for _, params in self.trained for param in params} if gradients else set()
        for group in self.groups:
            held = 0
            for param in group.fsdp_params:
                dtype = getattr(param, "param_dtype", None) or param.sharded_param.dtype
                numel = param.sharded_param.numel()  # a DTensor's: the whole parameter's
                held += numel * dtype.itemsize
                if id(param) in trained:
                    # the unsharded gradient (FSDP2 keeps it in the reduce dtype between backward passes, where
                    # mixed precision gives one) and the sum of this rank's shard
                    reduced = getattr(param, "reduce_dtype", None) or dtype
                    held += numel * max(dtype.itemsize, reduced.itemsize)
                    held += param.sharded_size.numel() * param.sharded_param.dtype.itemsize
            device = group.fsdp_params[0].sharded_param.device
            needs[device] = needs.get(device, 0) + held
            largest[device] = max(largest.get(device, 0), held)
        for device, held in needs.items():
            wanted = held + largest[device]
            try:
                torch.empty(wanted, dtype=torch.uint8, device=device)
            except Exception as error:
                if not should_reduce_batch_size(error):
                    raise
                what = "units unsharded, with their gradients" if gradients else "units unsharded"
                message = (
                    f"toma.accumulate with FSDP2: rank {self.rank} cannot hold the model's {what} "
                    f"({wanted / 2**20:.0f} MiB on {device}), which toma does for each logical batch so that no "
                    "collective runs inside a micro-batch; no micro-batch size changes that. Shard over more ranks, "
                    "or leave the parameters sharded: gradient_sync='sharded' (or 'auto', which goes on so)"
                )
                raise UnshardedDoesNotFit(message) from None

    def hold(self, agreements: Optional[CollectiveAgreements] = None) -> None:
        """Before an attempt: no reduce-scatter and no resharding in its passes, every unit unsharded (the
        all-gathers, here, before any micro-batch), each all-gather after the ranks' `agreements` where given (a
        rank that runs out of memory allocating one tells the others at the next, instead of leaving them in it)."""
        if self._settings is None:
            # FSDP2 settles the root's settings in its first forward pass (the root is not resharded after it):
            # settle them first, so that `release` puts back those
            for unit in self.units[:1]:
                state = unit._get_fsdp_state()
                if hasattr(state, "_lazy_init"):
                    state._lazy_init()
            self._settings = [(g.reduce_grads, g.reshard_after_backward, g.post_forward_mesh_info) for g in self.groups]
        for group in self.groups:
            group.reduce_grads, group.reshard_after_backward, group.post_forward_mesh_info = False, False, None
        gathers = [group._all_gather_comm for group in self.groups]
        if agreements is not None:
            for group, gather in zip(self.groups, gathers):
                group._all_gather_comm = AgreedAllGather(gather, agreements)
        try:
            for unit in self.units:
                unit.unshard()
        finally:
            for group, gather in zip(self.groups, gathers):
                group._all_gather_comm = gather

    def scatter_buffers(self) -> Dict[torch.dtype, Tuple[torch.Tensor, torch.Tensor]]:
        """What `reduce_scatter` needs, allocated before the ranks agree to run it (a rank that runs out of memory
        here tells the others in the agreement, instead of leaving them in a reduce-scatter): per dtype the
        gradients are reduced in (FSDP2's `reduce_dtype`, else theirs), an input of the largest unit's padded
        unsharded gradients and an output of its shard; the attempt's sums of shards (zeros) on the first call. Under
        an address-space limit, room for what gloo allocates inside a reduce-scatter of CPU tensors (about its
        input; twice its input and output, as a margin) is checked here too."""
        self.zero_sums()
        largest: Dict[Tuple[torch.dtype, torch.device], int] = {}
        for _, params in self.trained:
            key = (_reduce_dtype(params[0]), params[0].unsharded_param.device)
            largest[key] = max(largest.get(key, 0), sum(_padded_rows(p, self.world)[1] for p in params))
        buffers = {
            dtype: (torch.empty(self.world * n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device))
            for (dtype, device), n in largest.items()
        }
        room = max((i.nbytes + o.nbytes for i, o in buffers.values() if i.device.type == "cpu"), default=0)
        if room:
            room_for(2 * room, "gloo inside the gradients' reduce-scatter")
        return buffers

    def reduce_scatter(self, scale: float, buffers: Dict[torch.dtype, Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Once every rank finished (a micro-batch, or the attempt): each unit's unsharded gradients (a parameter
        without one counts as zeros; this rank's multiplied by `scale`) reduce-scattered over the ranks, averaged,
        this rank's shard added to its sum, and the unsharded gradients dropped (after a micro-batch, the memory
        the next one's forward pass gets)."""
        assert self.sums is not None
        sums = iter(self.sums)
        for _, params in self.trained:
            flat_in, flat_out = buffers[_reduce_dtype(params[0])]
            shapes = [_padded_rows(p, self.world) for p in params]
            total = sum(n for _, n in shapes)
            matrix = flat_in[: self.world * total].view(self.world, total)
            offset = 0
            for param, (rows, n) in zip(params, shapes):
                _copy_padded(_unsharded_grad(param), matrix[:, offset : offset + n], rows)
                offset += n
            if scale != 1.0:
                matrix.mul_(scale)
            out = flat_out[:total]
            with collective("gradients' reduce-scatter"):
                _reduce_scatter()(out, matrix.reshape(-1), group=self.process_group)
            out.div_(self.world)
            offset = 0
            for param, (rows, n) in zip(params, shapes):
                total_sum = next(sums)
                total_sum.add_(out[offset : offset + total_sum.numel()].view_as(total_sum))
                offset += n
                _drop_unsharded_grad(param)

    def zero_sums(self) -> None:
        """The attempt's sums of shards, zeros until a reduce-scatter adds to them (allocated once)."""
        if self.sums is None:
            self.sums = [
                torch.zeros(p.sharded_size, dtype=p.sharded_param.dtype, device=p.sharded_param.device)
                for _, params in self.trained
                for p in params
            ]

    def keep_sums(self) -> None:
        """After an attempt every rank finished and reduced: the sums of shards the sharded gradients of the
        parameters that train (zeros where no reduce-scatter ran: every rank's micro-batches counted nothing)."""
        self.zero_sums()
        assert self.sums is not None
        trained = [p for _, params in self.trained for p in params]
        for param, total_sum in zip(trained, self.sums):
            param.sharded_param.grad = param.to_sharded_dtensor(total_sum)
        self.release()

    def release(self) -> None:
        """The units as they were before `hold`: unsharded gradients dropped, settings back, resharded."""
        self.sums = None
        for param in self.params:
            _drop_unsharded_grad(param)
        if self._settings is not None:
            for group, (reduce_grads, after_backward, post_forward) in zip(self.groups, self._settings):
                group.reduce_grads, group.reshard_after_backward = reduce_grads, after_backward
                group.post_forward_mesh_info = post_forward
            self._settings = None
        for unit in self.units:
            unit.reshard()

    def agree_before_collectives(self, agreements: CollectiveAgreements) -> None:
        """For an attempt in FSDP2's own schedule: each group's all-gather and reduce-scatter run only after the
        ranks agree (`toma.accumulation.fsdp2_agreed`), and each micro-batch's gradients reduce-scattered (the
        groups' own settings back with `stop_agreeing`)."""
        if self._comms is None:
            self._comms = [(g._all_gather_comm, g._reduce_scatter_comm, g.reduce_grads) for g in self.groups]
        for group, (gather, scatter, _) in zip(self.groups, self._comms):
            group._all_gather_comm = AgreedAllGather(gather, agreements)
            group._reduce_scatter_comm = AgreedReduceScatter(scatter, agreements)
            group.reduce_grads = True

    @property
    def can_reset(self) -> bool:
        """Whether FSDP2 clears its own per-iteration state after a failed pass (`reset_iter_state`, torch 2.13),
        which the sharded mode needs: what `_reset_by_hand` clears covers the unsharded modes' passes only."""
        return hasattr(self.units[0], "reset_iter_state")

    def stop_agreeing(self) -> None:
        """Each group's own all-gather, reduce-scatter and gradient sync setting back."""
        if self._comms is not None:
            for group, (gather, scatter, reduce_grads) in zip(self.groups, self._comms):
                group._all_gather_comm, group._reduce_scatter_comm, group.reduce_grads = gather, scatter, reduce_grads
            self._comms = None

    def reset(self) -> None:
        """After an attempt that raised in a forward or backward pass: FSDP2's per-iteration state cleared (its own
        `reset_iter_state` where the release has it: in-flight collectives waited for, every group resharded),
        the collectives' own communication back, then `release`."""
        self.stop_agreeing()
        root = self.units[0]  # its `_is_root` is None until its first forward pass set FSDP2 up
        if hasattr(root, "reset_iter_state") and getattr(root._get_fsdp_state(), "_is_root", None):
            root.reset_iter_state()
        else:
            self._reset_by_hand()
        self.release()

    def _reset_by_hand(self) -> None:
        """FSDP2's training state back to idle (as its final backward callback leaves it), where the release has
        no `reset_iter_state`."""
        for unit in self.units:
            state = unit._get_fsdp_state()
            context = state._state_ctx
            context.iter_forward_root = None
            context.post_backward_final_callback_queued = False
            state._training_state = type(state._training_state).IDLE
            if hasattr(state, "_modules_to_run_forward"):
                state._modules_to_run_forward.clear()
            for group in _groups(unit):
                group._training_state = type(group._training_state).IDLE
                group._all_gather_result = None


def _reduce_scatter() -> Any:
    """torch.distributed's reduce-scatter of one tensor: `reduce_scatter_single` where the release has it (2.13),
    else `reduce_scatter_tensor`."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@contextlib.contextmanager
def held_unsharded(root: torch.nn.Module) -> Iterator[None]:
    """Every unit of `root` unsharded around forward passes that run no collective of their own (evaluation
    chunks a rank may fail and redo alone); the ranks first agree that each can hold them (else
    `UnshardedDoesNotFit` on the rank that cannot, `RankFailed` on the others), and FSDP2's state is reset after."""
    units = ShardedUnits(root)
    failed: Optional[UnshardedDoesNotFit] = None
    try:
        units.probe(gradients=False)
    except UnshardedDoesNotFit as error:
        failed = error
    device = units.params[0].sharded_param.device
    unable = Agreement(units.process_group, device).sum(0.0 if failed is None else 1.0)
    if failed is not None:
        raise failed
    if unable:
        raise RankFailed("toma: another rank cannot hold the FSDP2 units unsharded; this rank stops with it")
    units.hold()
    try:
        yield
    finally:
        units.reset()


def _reduce_dtype(param: Any) -> torch.dtype:
    """The dtype FSDP2 reduces a parameter's gradients in: its mixed-precision `reduce_dtype`, else the
    unsharded parameter's."""
    return getattr(param, "reduce_dtype", None) or param.unsharded_param.dtype


def _unsharded_grad(param: Any) -> Optional[torch.Tensor]:
    """The gradient an unsharded parameter accumulated without reduction: FSDP2 moves it, after each backward
    pass, into `unsharded_accumulated_grad` where it reduces in another dtype than the parameter's."""
    accumulated = getattr(param, "unsharded_accumulated_grad", None)
    grad = param.unsharded_param.grad
    if accumulated is None:
        return grad
    if grad is not None:  # in place: nothing is allocated once the ranks agreed to reduce
        accumulated.add_(grad)
        param.unsharded_param.grad = None
    return accumulated


def _drop_unsharded_grad(param: Any) -> None:
    if hasattr(param, "_unsharded_param"):  # made by the first unshard
        param.unsharded_param.grad = None
    param.unsharded_accumulated_grad = None


def _padded_rows(param: Any, world: int) -> Tuple[int, int]:
    """A sharded parameter's rows per rank (dim 0 split into `world` chunks, the last ones padded, as FSDP2
    pads them) and the elements of one rank's padded chunk."""
    shape = param.unsharded_param.shape
    rows = -(-shape[0] // world) if len(shape) else 1
    per_row = 1
    for length in shape[1:]:
        per_row *= length
    return rows, rows * per_row


def _copy_padded(grad: Optional[torch.Tensor], into: torch.Tensor, rows: int) -> None:
    """`grad` (None: zeros) into `into` (world x padded chunk): rank r's chunk of dim 0 into its row, zeros
    where dim 0 ran out."""
    if grad is None:
        into.zero_()
        return
    world = into.shape[0]
    flat = grad.reshape(grad.shape[0], -1) if grad.dim() else grad.reshape(1, 1)
    if flat.shape[0] == rows * world:
        into.copy_(flat.reshape(world, -1))
        return
    for r in range(world):
        piece = flat[r * rows : (r + 1) * rows].reshape(-1)
        into[r, : piece.numel()].copy_(piece)
        into[r, piece.numel() :].zero_()
