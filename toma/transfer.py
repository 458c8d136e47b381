"""Moving batches between the host and a device ahead of use.

`Transfers(device)` copies tensors (also inside tuples, lists and dicts) to `device` so that the copy of the
next chunk overlaps the compute of this one. On CUDA: host tensors are packed into a pinned staging buffer
(a few, reused round-robin, grown and shrunk with the chunk size, never pinned per chunk), one copy per chunk
runs on a side stream, the stream that uses the result waits on an event, and the result's memory is
recorded on that stream (`record_stream`) so the caching allocator cannot hand it out while work queued
there still reads it. Results come back the same way (`to_host`). Without CUDA the moves are plain `.to()`
calls (nothing is pinned) and tensors already on `device` are not copied at all.
"""

import threading
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from toma.splitting import map_tensors

__all__ = ["Transfers", "Pending", "check_device", "shared_transfers", "ALIGNMENT"]

ALIGNMENT = 256  # bytes between packed tensors: every dtype's alignment, and CUDA's preferred for copies


def check_device(device: Any, name: str) -> torch.device:
    """A device that exists here: a `torch.device`, a string like "cuda:0", or a CUDA index; None: the current
    CUDA device if CUDA is available, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(f"{name} must be a device such as 'cuda:0' or 'cpu', got {device!r} ({error})") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name} is {device!r}, but CUDA is not available on this machine")
        index = torch.cuda.current_device() if resolved.index is None else resolved.index
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"{name} is {device!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
        return torch.device("cuda", index)
    if resolved.type not in ("cpu", "meta") and not _backend_available(resolved.type):
        raise ValueError(f"{name} is {device!r}, but no {resolved.type} device is available on this machine")
    return resolved


def _backend_available(kind: str) -> bool:
    backend = getattr(torch, kind, None) or getattr(torch.backends, kind, None)
    available = getattr(backend, "is_available", None)
    return bool(available()) if callable(available) else False


def _tensors(obj: Any) -> List[torch.Tensor]:
    found: List[torch.Tensor] = []
    map_tensors(obj, lambda tensor: found.append(tensor))
    return found


def _distinct(tensors: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """Each tensor once (one object passed twice is copied once)."""
    return list({id(tensor): tensor for tensor in tensors}.values())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class _Slot:
    """A pinned staging buffer and the event after which the copy that last read or wrote it is done."""

    __slots__ = ("buffer", "event")

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None
        self.event: Optional[Any] = None

    def reserve(self, nbytes: int) -> torch.Tensor:
        """The buffer, at least `nbytes` long, once no copy uses it any more. It follows the chunk size: grown
        by a quarter beyond what is asked (chunks of one size vary a little), released when 4x too large."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        capacity = 0 if self.buffer is None else self.buffer.numel()
        if capacity < nbytes or capacity > 4 * max(nbytes, 1 << 20):
            self.buffer = None  # let the old pinned block go before pinning the new one
            self.buffer = torch.empty(nbytes + nbytes // 4, dtype=torch.uint8, pin_memory=True)
        return self.buffer  # type: ignore[return-value]


class Pending:
    """A transfer under way: `take()` returns its result, usable on the caller's current stream."""

    __slots__ = ("value", "event", "blocks", "copy_out")

    def __init__(
        self,
        value: Any,
        event: Any = None,
        blocks: Tuple[torch.Tensor, ...] = (),
        copy_out: bool = False,
    ) -> None:
        self.value, self.event, self.blocks, self.copy_out = value, event, blocks, copy_out

    def take(self, copy: bool = True) -> Any:
        """The moved value: to a device, once the current stream waits for the copy (the memory recorded on that
        stream); to the host, once the copy is done, copied out of the staging buffer (`copy=False`: views of
        the buffer, valid until the next transfer back reuses it, for a caller that copies them at once)."""
        if self.event is None:
            return self.value
        if self.copy_out:
            self.event.synchronize()
            return map_tensors(self.value, lambda tensor: tensor.clone()) if copy else self.value
        stream = torch.cuda.current_stream(self.blocks[0].device) if self.blocks else None
        if stream is not None:
            stream.wait_event(self.event)
            for block in self.blocks:
                block.record_stream(stream)
        return self.value


class Transfers:
    """Host-to-device (and back) copies for one device, with `slots` staging buffers each way that alternate (2:
    one chunk copied while the previous one is still read)."""

    def __init__(self, device: Any, slots: int = 2) -> None:
        self.device = check_device(device, "device")
        self.cuda = self.device.type == "cuda"
        self.stream: Optional[Any] = torch.cuda.Stream(self.device) if self.cuda else None
        count = max(1, slots) if self.cuda else 0
        self._slots = [_Slot() for _ in range(2 * count)]  # the first half inbound, the rest outbound
        self._next = [0, 0]
        self.copied_bytes = 0  # host-to-device bytes copied so far (pinned staging or pinned sources)
        self.staged_bytes = 0  # of those, bytes that went through a staging buffer

    def __repr__(self) -> str:
        return f"Transfers({str(self.device)!r})"

    def _slot(self, outbound: bool) -> _Slot:
        half = len(self._slots) // 2
        index = self._next[outbound]
        self._next[outbound] = (index + 1) % half
        return self._slots[index + half * outbound]

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory held by the staging buffers."""
        return sum(slot.buffer.numel() for slot in self._slots if slot.buffer is not None)

    def release(self) -> None:
        """Free the staging buffers (after the copies that use them are done)."""
        for slot in self._slots:
            if slot.event is not None:
                slot.event.synchronize()
            slot.buffer, slot.event = None, None

    def move(self, obj: Any) -> Any:
        """`obj` with every tensor on the device, usable at once on the current stream."""
        return self.prefetch(obj).take()

    def prefetch(self, obj: Any) -> Pending:
        """Start copying `obj`'s tensors to the device; `take()` the result where it is used."""
        if not self.cuda:
            device = self.device
            return Pending(map_tensors(obj, lambda tensor: tensor.to(device)))
        host = _distinct(t for t in _tensors(obj) if t.device.type == "cpu")
        if not host:
            return Pending(map_tensors(obj, lambda tensor: tensor.to(self.device, non_blocking=True)))
        staged = [t for t in host if not t.is_pinned()]
        offsets, total = self._layout(staged)
        stream = self.stream
        placed = {}
        blocks: List[torch.Tensor] = []
        slot = self._slot(False) if staged else None
        with torch.cuda.stream(stream):
            if slot is not None:
                buffer = slot.reserve(total)
                for tensor, offset in zip(staged, offsets):
                    _view(buffer, offset, tensor).copy_(tensor)
                block = torch.empty(total, dtype=torch.uint8, device=self.device)
                block.copy_(buffer[:total], non_blocking=True)
                blocks.append(block)
                for tensor, offset in zip(staged, offsets):
                    placed[id(tensor)] = _view(block, offset, tensor)
                self.staged_bytes += total
                self.copied_bytes += total
            for tensor in host:
                if id(tensor) not in placed:  # pinned by the caller: copied straight from it
                    moved = tensor.to(self.device, non_blocking=True)
                    blocks.append(moved)
                    placed[id(tensor)] = moved
                    self.copied_bytes += tensor.numel() * tensor.element_size()
            event = torch.cuda.Event()
            event.record(stream)
        if slot is not None:
            slot.event = event
        device = self.device
        value = map_tensors(obj, lambda tensor: placed.get(id(tensor)) if id(tensor) in placed else tensor.to(device))
        return Pending(value, event, tuple(blocks))

    def to_host(self, obj: Any) -> Pending:
        """Start copying `obj`'s device tensors back to the host once the current stream has computed them;
        `take()` returns host tensors of their own."""
        if not self.cuda:
            return Pending(map_tensors(obj, lambda tensor: tensor.cpu()))
        on_device = _distinct(t for t in _tensors(obj) if t.device.type == "cuda")
        if not on_device:
            return Pending(obj)
        offsets, total = self._layout(on_device)
        slot = self._slot(True)
        buffer = slot.reserve(total)
        stream = self.stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        placed = {}
        with torch.cuda.stream(stream):
            for tensor, offset in zip(on_device, offsets):
                tensor.record_stream(stream)  # computed on the current stream, read on the side stream
                view = _view(buffer, offset, tensor)
                view.copy_(tensor, non_blocking=True)
                placed[id(tensor)] = view
            event = torch.cuda.Event()
            event.record(stream)
        slot.event = event
        value = map_tensors(obj, lambda tensor: placed.get(id(tensor), tensor))
        return Pending(value, event, copy_out=True)

    @staticmethod
    def _layout(tensors: List[torch.Tensor]) -> Tuple[List[int], int]:
        offsets, total = [], 0
        for tensor in tensors:
            offsets.append(total)
            total += _aligned(tensor.numel() * tensor.element_size())
        return offsets, max(total, ALIGNMENT)


def _view(block: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of `block` from `offset` as a contiguous tensor shaped and typed like `like`."""
    nbytes = like.numel() * like.element_size()
    return block[offset : offset + nbytes].view(like.dtype).view(like.shape)



_per_thread = threading.local()


def shared_transfers(device: torch.device) -> Transfers:
    """This thread's `Transfers` for `device`, kept between calls so that staging buffers are pinned once."""
    kept: Dict[torch.device, Transfers] = _per_thread.__dict__.setdefault("transfers", {})
    transfers = kept.get(device)
    if transfers is None:
        transfers = kept[device] = Transfers(device)
    return transfers
