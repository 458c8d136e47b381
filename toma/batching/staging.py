"""Page-locked staging buffers for host-to-device copies: tensors packed at an alignment into a pinned block that
is reused while a copy from it may still be in flight."""

import logging
import threading
from typing import Any, Optional, Tuple

import torch

log = logging.getLogger("toma")
_refusal_lock = threading.Lock()
_refusal_warned = False  # a refused pinning is warned about once per process

__all__ = ["ALIGNMENT", "aligned", "dense", "stageable", "pinned_block", "pinning_refused", "StagingSlot", "view_in"]


ALIGNMENT = 256  # bytes between packed tensors: every dtype's alignment, and CUDA's preferred for copies


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def dense(tensor: torch.Tensor) -> bool:
    """A plain strided tensor: its bytes, copied into a buffer and viewed with its dtype and shape, are it."""
    plain = type(tensor) is torch.Tensor and tensor.layout == torch.strided
    return plain and not tensor.is_quantized and not tensor.is_nested


def stageable(tensor: torch.Tensor) -> bool:
    """Whether a host tensor can travel through a uint8 staging buffer: dense and outside autograd. The others
    (sparse, requiring grad, subclasses) move with `.to()`, which keeps their layout and autograd link."""
    return dense(tensor) and not tensor.requires_grad


def pinned_block(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def pinning_refused(error: BaseException, nbytes: int) -> None:
    """Page-locked host memory could not be had: host memory, not device memory, so never an out-of-memory
    error that shrinks device work. Warned once per process; the moves go on with pageable memory."""
    global _refusal_warned
    with _refusal_lock:
        first, _refusal_warned = not _refusal_warned, True
    if first:
        log.warning(
            "toma could not pin %d bytes of host memory for staging transfers (%s); moving tensors from "
            "pageable memory instead (slower, without overlap)",
            nbytes,
            str(error).splitlines()[0] if str(error) else type(error).__name__,
        )
    else:
        log.debug("pinning %d bytes of host memory failed again: %s", nbytes, error)


class StagingSlot:
    """A pinned staging buffer and the event after which the copy that last read or wrote it is done; for a
    copy back, the device tensors it reads, kept alive until then."""

    __slots__ = ("buffer", "event", "reading")

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None
        self.event: Optional[Any] = None
        self.reading: Tuple[torch.Tensor, ...] = ()

    def settle(self) -> None:
        """Wait for the last copy that used the buffer."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        self.reading = ()

    def reserve(self, nbytes: int) -> Optional[torch.Tensor]:
        """The buffer, at least `nbytes` long, once no copy uses it any more; None if the driver refuses to
        pin that much (warned). It follows the chunk size: grown by a quarter beyond what is asked (chunks of
        one size vary a little), released when 4x too large."""
        self.settle()
        capacity = 0 if self.buffer is None else self.buffer.numel()
        if capacity < nbytes or capacity > 4 * max(nbytes, 1 << 20):
            self.buffer = None  # let the old pinned block go before pinning the new one
            try:
                self.buffer = pinned_block(nbytes + nbytes // 4)
            except RuntimeError as error:  # cudaHostAlloc failing reads "CUDA error: out of memory"
                pinning_refused(error, nbytes + nbytes // 4)
                return None
        return self.buffer


def view_in(block: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of `block` from `offset` as a contiguous tensor shaped and typed like `like`."""
    nbytes = like.numel() * like.element_size()
    return block[offset : offset + nbytes].view(like.dtype).view(like.shape)
