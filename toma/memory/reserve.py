"""Room in the address space kept for the moments right after an out-of-memory error, under an address-space
limit (RLIMIT_AS: the CPU's real out-of-memory errors).

Right after an allocation fails, the failed attempt's tensors are still alive (its traceback holds them) and the
process is at its limit: whatever runs then and allocates (Python building the exception, toma's bookkeeping,
the ranks' agreement, which must be reached whatever happens) can fail in its turn, and a rank that fails there
never tells the others. `AddressSpaceReserve` keeps a few MiB mapped, never touched (no memory is used, only
address space), while an attempt runs, and unmaps them the moment the attempt ends, before anything else runs.
`room_for` checks, before a collective that allocates on threads of its own (gloo's), that malloc can give as
much (from the heap's free pieces or fresh address space, as it would give gloo). Without an address-space limit
both do nothing: no other limit fails an allocation in the middle of Python code this way (a GPU's memory is not
where Python allocates)."""

import errno
import mmap
from typing import Optional

import torch

from toma.memory.cpu import address_space_limit

__all__ = ["AddressSpaceReserve", "RESERVED", "room_for"]

RESERVED = 2 * 2**20  # what the moments after an error need: one of Python's 1 MiB arenas, malloc's heap growing


def _mapped(size: int) -> mmap.mmap:
    """`size` bytes of fresh address space, inaccessible (PROT_NONE): counted against RLIMIT_AS, never backed."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0), prot=0)


class AddressSpaceReserve:
    """`size` bytes of address space held from `hold()` to `release()` where an address-space limit is set: what
    the process can allocate right after an out-of-memory error, once `release()` gave them back."""

    __slots__ = ("size", "_mapping")

    def __init__(self, size: int = RESERVED) -> None:
        self.size = size
        self._mapping: Optional[mmap.mmap] = None

    @property
    def held(self) -> bool:
        return self._mapping is not None

    def hold(self) -> None:
        """Map the reserve (where a limit is set and it is not held already). A MemoryError where the limit leaves
        no room for it: the attempt about to run would run out of memory with nothing kept for after."""
        if self._mapping is not None or address_space_limit() is None:
            return
        try:
            self._mapping = _mapped(self.size)
        except OSError as error:
            if error.errno != errno.ENOMEM:
                raise
            raise MemoryError(
                f"toma: no room for the {self.size / 2**20:.0f} MiB of address space kept for what runs right after "
                "an out-of-memory error"
            ) from None

    def release(self) -> None:
        """Give the reserve back (allocation-free: safe right after an out-of-memory error)."""
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            mapping.close()


def room_for(size: int, what: str) -> None:
    """Whether the CPU allocator can give `size` bytes now (allocated and freed at once, never touched); a
    MemoryError naming `what` where an address-space limit leaves no room for them."""
    if address_space_limit() is None:
        return
    try:
        torch.empty(size, dtype=torch.uint8)
    except RuntimeError as error:
        if "can't allocate memory" not in str(error) and "not enough memory" not in str(error):
            raise
        raise MemoryError(f"no room for the {size} bytes kept for {what}") from None
