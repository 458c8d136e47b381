"""Moving batches between the host and a device ahead of use.

`Transfers(device)` copies tensors (also inside tuples, lists and dicts) to `device` so that the copy of the
next chunk overlaps the compute of this one. On CUDA: plain dense host tensors are packed into a pinned
staging buffer (a few, reused round-robin, grown and shrunk with the chunk size, never pinned per chunk), one
copy per chunk runs on a side stream, the stream that uses the result waits on an event, and the result's
memory (allocated on the side stream) is recorded on that stream (`record_stream`) so the caching allocator
cannot hand it out while work queued there still reads it. Tensors whose bytes cannot stand for them (sparse,
requiring grad, subclasses) move with `.to()` where they are used, keeping layout and autograd. Results come
back through staging too (`to_host`), the device tensors kept referenced until their copy is waited on (no
`record_stream`); outputs on another GPU are copied at once. When the driver refuses page-locked memory the
moves fall back to pageable `.to()` copies (one warning), never an out-of-memory error. Without CUDA the moves
are plain `.to()` calls (nothing is pinned) and tensors already on `device` are not copied at all.

`MicroBatchTransfers` moves the micro-batches of one call's logical batch: only the split (per-row) tensors
of each micro-batch go through the pipeline; `toma.whole` values move once per call.
"""

import logging
import threading
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from toma.batching.splitting import ArgumentBatch, map_tensors
from toma.batching.staging import (
    ALIGNMENT,
    StagingSlot,
    aligned,
    dense,
    stageable,
    view_in,
)
from toma.memory.backends import CUDA, backend_for

__all__ = [
    "Transfers",
    "Pending",
    "MicroBatchTransfers",
    "check_device",
    "shared_transfers",
    "stageable",
    "uses_cuda",
    "ALIGNMENT",
]

log = logging.getLogger("toma")


def check_device(device: Any, name: str) -> torch.device:
    """A device that exists here: a `torch.device`, a string like "cuda:0", or a CUDA index; None: the current
    CUDA device if CUDA is available, else the CPU."""
    if device is None:
        return CUDA.current() if CUDA.available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(f"{name} must be a device such as 'cuda:0' or 'cpu', got {device!r} ({error})") from None
    if resolved.type in ("cpu", "meta"):
        return resolved
    backend = backend_for(resolved)
    if not backend.available():
        what = "CUDA is" if resolved.type == "cuda" else f"no {resolved.type} device is"
        raise ValueError(f"{name} is {device!r}, but {what} available on this machine")
    resolved, count = backend.resolve(resolved), backend.device_count()
    if resolved.index is not None and count is not None and resolved.index >= count:
        raise ValueError(f"{name} is {device!r}, but this machine has {count} {backend.kind.upper()} device(s)")
    return resolved


def uses_cuda(device: torch.device) -> bool:
    """Whether moves to `device` go through (CUDA) streams, events and pinned staging."""
    return backend_for(device).pins_host_memory


def _tensors(obj: Any) -> List[torch.Tensor]:
    found: List[torch.Tensor] = []
    map_tensors(obj, lambda tensor: found.append(tensor))
    return found


def _distinct(tensors: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """Each tensor once (one object passed twice is copied once)."""
    return list({id(tensor): tensor for tensor in tensors}.values())


class Pending:
    """A transfer under way: `take()` returns its result (here: a value that needed no transfer)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def take(self, copy: bool = True) -> Any:
        return self.value


class _Arriving(Pending):
    """A copy to the device: `take()` makes the current stream wait for it, records the memory that the side
    stream allocated on the current stream, and moves the tensors left for `.to()` there."""

    __slots__ = ("source", "placed", "later", "device", "event", "blocks", "side", "done")

    def __init__(
        self,
        source: Any,
        placed: Dict[int, torch.Tensor],
        later: Set[int],
        device: torch.device,
        event: Any = None,
        blocks: Tuple[torch.Tensor, ...] = (),
        side: Any = None,
    ) -> None:
        super().__init__(None)
        self.source, self.placed, self.later, self.device = source, placed, later, device
        self.event, self.blocks, self.side, self.done = event, blocks, side, False

    def take(self, copy: bool = True) -> Any:
        """The moved value, usable on the current stream."""
        if self.done:
            return self.value
        if self.event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self.event)
            if stream != self.side:  # never onto the stream that allocated the blocks (cudaMallocAsync warns)
                for block in self.blocks:
                    block.record_stream(stream)
        placed, later, device = self.placed, self.later, self.device

        def arrived(tensor: torch.Tensor) -> torch.Tensor:
            moved = placed.get(id(tensor))
            if moved is not None:
                return moved
            return tensor.to(device) if id(tensor) in later else tensor

        self.value = map_tensors(self.source, arrived)
        self.source, self.placed, self.blocks, self.done = None, {}, (), True
        return self.value


class _Returning(Pending):
    """A copy back to the host: `take()` waits for it and returns host tensors of their own.

    The device tensors being read stay referenced (here and by the staging slot) until the copy's event has
    been waited on, instead of being recorded on the side stream: `record_stream` onto a tensor's allocating
    stream warns under the cudaMallocAsync backend, and an output can be a view of memory the side stream
    allocated (rows `prefetch`ed and returned as they are). If a `_Returning` is dropped untaken, the slot keeps
    them until its next use waits on the same event, so no memory is freed while the side stream reads it."""

    __slots__ = ("source", "placed", "copied", "event", "slot", "done")

    def __init__(
        self,
        source: Any,
        placed: Dict[int, torch.Tensor],
        copied: Dict[int, torch.Tensor],
        event: Any = None,
        slot: Optional[StagingSlot] = None,
    ) -> None:
        super().__init__(None)
        self.source, self.placed, self.copied, self.event, self.slot = source, placed, copied, event, slot
        self.done = False

    def take(self, copy: bool = True) -> Any:
        """The host value; `copy=False`: staged tensors as views of the staging buffer, valid until the next
        transfer back reuses it, for a caller that copies them at once."""
        if self.done:
            return self.value
        if self.event is not None:
            self.event.synchronize()
            if self.slot is not None and self.slot.event is self.event:
                self.slot.reading = ()  # read: the device tensors may go
        placed, copied = self.placed, self.copied

        def back(tensor: torch.Tensor) -> torch.Tensor:
            view = placed.get(id(tensor))
            if view is not None:
                return view.clone() if copy else view
            return copied.get(id(tensor), tensor)

        self.value = map_tensors(self.source, back)
        self.source, self.placed, self.copied, self.slot, self.done = None, {}, {}, None, True
        return self.value


class Transfers:
    """Host-to-device (and back) copies for one device, with `slots` staging buffers each way that alternate (2:
    one chunk copied while the previous one is still read)."""

    def __init__(self, device: Any, slots: int = 2) -> None:
        self.device = check_device(device, "device")
        self.cuda = uses_cuda(self.device)
        self.stream: Optional[Any] = torch.cuda.Stream(self.device) if self.cuda else None
        count = max(1, slots) if self.cuda else 0
        self._slots = [StagingSlot() for _ in range(2 * count)]  # the first half inbound, the rest outbound
        self._next = [0, 0]
        self.pinning = self.cuda  # False once the driver refused page-locked memory: pageable copies from then on
        self.copied_bytes = 0  # host-to-device bytes copied so far (pinned staging or pinned sources)
        self.staged_bytes = 0  # of those, bytes that went through a staging buffer

    def __repr__(self) -> str:
        return f"Transfers({str(self.device)!r})"

    def _slot(self, outbound: bool) -> StagingSlot:
        half = len(self._slots) // 2
        index = self._next[outbound]
        self._next[outbound] = (index + 1) % half
        return self._slots[index + half * outbound]

    def _reserve(self, slot: StagingSlot, nbytes: int) -> Optional[torch.Tensor]:
        buffer = slot.reserve(nbytes)
        if buffer is None:
            self.pinning = False
        return buffer

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory held by the staging buffers."""
        return sum(slot.buffer.numel() for slot in self._slots if slot.buffer is not None)

    def release(self) -> None:
        """Free the staging buffers (after the copies that use them are done)."""
        for slot in self._slots:
            slot.settle()
            slot.buffer = None

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the device now, as `.to()` moves it (autograd and layout kept): for values that every
        micro-batch or chunk shares, moved once."""
        return tensor.to(self.device)

    def move(self, obj: Any) -> Any:
        """`obj` with every tensor on the device, usable at once on the current stream."""
        return self.prefetch(obj).take()

    def prefetch(self, obj: Any, stage: Optional[Sequence[torch.Tensor]] = None) -> Pending:
        """Start copying `obj`'s tensors to the device; `take()` the result where it is used. `stage`: the
        tensors of `obj` to move (the others are passed as they are); None: all of them."""
        moving = _distinct(_tensors(obj) if stage is None else stage)
        if not self.cuda:
            ids, device = {id(tensor) for tensor in moving}, self.device
            return Pending(map_tensors(obj, lambda tensor: tensor.to(device) if id(tensor) in ids else tensor))
        host = [t for t in moving if t.device.type == "cpu" and stageable(t)]
        direct = [t for t in host if t.is_pinned()]
        packed = [t for t in host if not t.is_pinned()] if self.pinning else []
        packed, offsets, total, slot, buffer = self._stage(packed, outbound=False)
        chosen = {id(t) for t in packed + direct}
        later = {id(t) for t in moving if id(t) not in chosen}  # moved with .to() on the stream that takes them
        if not chosen:
            return _Arriving(obj, {}, later, self.device)
        stream = self.stream
        placed: Dict[int, torch.Tensor] = {}
        blocks: List[torch.Tensor] = []
        with torch.cuda.stream(stream):
            if buffer is not None:
                for tensor, offset in zip(packed, offsets):
                    view_in(buffer, offset, tensor).copy_(tensor)
                block = torch.empty(total, dtype=torch.uint8, device=self.device)
                block.copy_(buffer[:total], non_blocking=True)
                blocks.append(block)
                for tensor, offset in zip(packed, offsets):
                    placed[id(tensor)] = view_in(block, offset, tensor)
                self.staged_bytes += total
                self.copied_bytes += total
            for tensor in direct:  # pinned by the caller: copied straight from it
                moved = tensor.to(self.device, non_blocking=True)
                blocks.append(moved)
                placed[id(tensor)] = moved
                self.copied_bytes += tensor.numel() * tensor.element_size()
            event = torch.cuda.Event()
            event.record(stream)
        if slot is not None and buffer is not None:
            slot.event = event
        return _Arriving(obj, placed, later, self.device, event, tuple(blocks), stream)

    def to_host(self, obj: Any) -> Pending:
        """Start copying `obj`'s device tensors back to the host once the streams that computed them are done;
        `take()` returns host tensors of their own (staged ones detached). Dense tensors on this device travel
        through pinned staging on the side stream; those on another device (whose streams this one's event
        does not cover), and sparse ones, are copied at once with `.to("cpu")`."""
        if not self.cuda:
            return Pending(map_tensors(obj, lambda tensor: tensor.cpu()))
        tensors = _distinct(_tensors(obj))
        here = [t for t in tensors if t.device == self.device and dense(t)] if self.pinning else []
        here, offsets, total, slot, buffer = self._stage(here, outbound=True)
        staging = {id(t) for t in here}
        elsewhere = [t for t in tensors if t.device.type != "cpu" and id(t) not in staging]
        if not here and not elsewhere:
            return Pending(obj)
        placed: Dict[int, torch.Tensor] = {}
        event = None
        if buffer is not None and slot is not None:
            stream = self.stream
            assert stream is not None
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the outputs are computed there
            with torch.cuda.stream(stream):
                for tensor, offset in zip(here, offsets):
                    view = view_in(buffer, offset, tensor)
                    view.copy_(tensor.detach(), non_blocking=True)
                    placed[id(tensor)] = view
                event = torch.cuda.Event()
                event.record(stream)
            slot.event, slot.reading = event, tuple(here)
        # Synchronous: ordered after the work queued on the tensor's own device's current stream.
        copied = {id(t): t.to("cpu") for t in elsewhere}
        return _Returning(obj, placed, copied, event, slot)

    def _stage(
        self, tensors: List[torch.Tensor], outbound: bool
    ) -> Tuple[List[torch.Tensor], List[int], int, Optional[StagingSlot], Optional[torch.Tensor]]:
        """A staging buffer for `tensors` in the next slot of one direction: (the tensors it takes, their
        offsets, the bytes, the slot, the buffer); no tensors and no buffer when there are none or pinning
        was refused."""
        if not tensors:
            return [], [], 0, None, None
        offsets, total = self._layout(tensors)
        slot = self._slot(outbound)
        buffer = self._reserve(slot, total)
        if buffer is None:
            return [], [], 0, slot, None
        return tensors, offsets, total, slot, buffer

    @staticmethod
    def _layout(tensors: List[torch.Tensor]) -> Tuple[List[int], int]:
        offsets, total = [], 0
        for tensor in tensors:
            offsets.append(total)
            total += aligned(tensor.numel() * tensor.element_size())
        return offsets, max(total, ALIGNMENT)


class MicroBatchTransfers:
    """The micro-batches of one call's logical batch on a device. Only the split (per-row) tensors of a
    micro-batch go through `Transfers.prefetch` (pinned staging where they allow it, `.to()` where they are
    sparse or require grad); tensors in `toma.whole(...)` move once per call with `.to()`, on first use;
    everything else (0-dim tensors, numbers, strings) is passed as given. One instance per call."""

    __slots__ = ("transfers", "_placed")

    def __init__(self, transfers: Transfers) -> None:
        self.transfers = transfers
        self._placed: Dict[int, Tuple[ArgumentBatch, ArgumentBatch]] = {}  # id(split): (split, its placed copy)

    def prefetch(self, split: ArgumentBatch, start: int, stop: int, width: Optional[int] = None) -> Pending:
        """Start moving the arguments for rows `[start, stop)` of `split` (trimmed to `width` positions where
        it has padded tensors); `take()` gives `(args, kwargs)`."""
        entry = self._placed.get(id(split))
        if entry is None:
            entry = self._placed[id(split)] = (split, split.placed(self.transfers.place))
        rows: List[torch.Tensor] = []
        arguments = entry[1].arguments(start, stop, rows, width)
        return self.transfers.prefetch(arguments, stage=rows)


_per_thread = threading.local()


def shared_transfers(device: torch.device) -> Transfers:
    """This thread's `Transfers` for `device`, kept between calls so that staging buffers are pinned once."""
    kept: Dict[torch.device, Transfers] = _per_thread.__dict__.setdefault("transfers", {})
    transfers = kept.get(device)
    if transfers is None:
        transfers = kept[device] = Transfers(device)
    return transfers
