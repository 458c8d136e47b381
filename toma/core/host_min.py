"""The ranks' agreement through memory they share, for ranks on one host: each writes its number beside the
others' and reads theirs. No collective, no device synchronisation: microseconds where the others are there
already, where a gloo all-reduce among busy ranks costs milliseconds and an NCCL one waits for the device's queue.
FSDP2's sharded mode agrees before every collective of its passes, so this is what its agreements go through.

`host_min_for(group)` sets it up once per process group, by a handshake over the group: its first rank creates a
small file in /dev/shm, every rank maps it and proves it sees the first rank's token and shares the host's boot
id; where any cannot (ranks on several hosts, containers that do not share /dev/shm, no /dev/shm), every rank
keeps the group's all-reduce. A rank that ends (its process gone) is noticed within a second; one that never comes
stops the others at the group's timeout (where it comes later still, it finds the agreement complete and waits in
the collective after it, until that times out too).
"""

import mmap
import operator
import os
import secrets
import sys
import tempfile
import time
import weakref
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from toma.core.agreement import FINISHED
from toma.core.oom import collective

__all__ = ["HostMin", "host_min_for", "encoded", "decoded"]

# One 64-bit word per rank and agreement: its sequence number (20 bits) above its number's code (43 bits), written
# and read whole, so no rank sees half of another's word (a memoryview's 8-byte item at an 8-aligned offset is one
# load or store on x86-64 and ARM64; nothing else is shared, so no ordering between words is needed). The codes
# keep the agreement's order: its stops (negative), its sizes, and its FINISHED less counts.
_CODE_BITS = 43
_CODE_MASK = (1 << _CODE_BITS) - 1
_SEQUENCE_MASK = (1 << 20) - 1
_STOPS = 1 << 20  # -_STOPS <= a stop < 0
_SIZES = 1 << 41  # 0 <= a size < _SIZES
_COUNTED = FINISHED - _SIZES  # FINISHED - count, for a count < _SIZES
_TOKEN = 0  # the word holding the first rank's token; two banks of one word per rank follow
_YIELDING = 2e-4  # seconds a waiting rank yields its core before it sleeps between looks
_NAPS = (5e-5, 2e-4)  # the shortest and longest sleep; in between a twentieth of the wait so far: a rank that
# comes late is seen at most 5% or 0.2 ms later, and a long wait looks 5000 times a second
_LIVENESS = 1.0  # seconds between checks that the awaited rank's process is still there


def encoded(value: int) -> int:
    """`value` (an agreement's number) as a code below 2**43 in the same order."""
    if -_STOPS <= value < _SIZES:
        return value + _STOPS
    if _COUNTED <= value <= FINISHED:
        return value - _COUNTED + _STOPS + _SIZES
    raise ValueError(f"toma: an agreement cannot carry {value} through shared memory")


def decoded(code: int) -> int:
    """The number `encoded` gave `code` for."""
    return code - _STOPS if code < _STOPS + _SIZES else code - _STOPS - _SIZES + _COUNTED


def _pid_namespace() -> Optional[int]:
    """This process's PID namespace (the ranks' process ids mean the same to each other only within one)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _alive(pid: Optional[int]) -> bool:
    """Whether process `pid` still runs (a zombie does not); None: not known here, taken as running."""
    if pid is None:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


class HostMin:
    """The MIN of one number from every rank of a group on this host (`Agreement.exchange`), through `mapped`."""

    __slots__ = ("_mapped", "_words", "rank", "world_size", "pids", "timeout", "_sequence")

    def __init__(
        self, mapped: mmap.mmap, rank: int, world_size: int, pids: Sequence[Optional[int]], timeout: float
    ) -> None:
        self._mapped, self.rank, self.world_size = mapped, rank, world_size
        self._words = memoryview(mapped).cast("q")
        self.pids, self.timeout = list(pids), timeout
        self._sequence = 0

    def min(self, value: int) -> int:
        """The smallest `value` the ranks gave to their agreement of this number (every rank's n-th call)."""
        code = encoded(operator.index(value))  # a value it cannot carry raises before the others could wait
        # everything worked out before the store, which commits this rank to the agreement (an error before it,
        # a MemoryError at its limit, leaves the agreement as if never called)
        count = self._sequence + 1
        sequence = count & _SEQUENCE_MASK
        base = 1 + (sequence & 1) * self.world_size  # a rank one agreement ahead writes the other bank
        words, word = self._words, (sequence << _CODE_BITS) | code
        words[base + self.rank] = word
        self._sequence = count
        # committed: the others may act on this rank's number already, so an error from here on is one they cannot
        # meet at an agreement (never retried)
        with collective("agreement in shared memory"):
            lowest = _CODE_MASK
            for other in range(self.world_size):
                word = words[base + other]
                if word >> _CODE_BITS != sequence:
                    word = self._await(base + other, sequence, other)
                lowest = min(lowest, word & _CODE_MASK)
            return decoded(lowest)

    def _await(self, index: int, sequence: int, other: int) -> int:
        """Rank `other`'s word once it holds `sequence`: yielding the core at first, then napping; raises where
        its process ended or it did not come within the group's timeout."""
        words, start = self._words, time.monotonic()
        checked = start
        while True:
            word = words[index]
            if word >> _CODE_BITS == sequence:
                return int(word)
            now = time.monotonic()
            if now - start < _YIELDING:
                os.sched_yield()
                continue
            time.sleep(min(max((now - start) / 20, _NAPS[0]), _NAPS[1]))
            if now - checked >= _LIVENESS:
                checked = now
                if not _alive(self.pids[other]):
                    raise RuntimeError(
                        f"toma: rank {other} of the group (process {self.pids[other]}) ended while rank {self.rank} "
                        "waited for it in an agreement"
                    )
                if now - start > self.timeout:
                    raise RuntimeError(
                        f"toma: rank {other} of the group did not reach the agreement within the group's timeout "
                        f"({self.timeout:.0f} s); rank {self.rank} stops"
                    )


def _timeout(group: Any) -> float:
    """The process group's timeout in seconds, where torch says it; else torch's default."""
    for kind in ("cpu", "cuda"):
        try:
            return float(group._get_backend(torch.device(kind)).options._timeout.total_seconds())
        except Exception:  # this backend does not serve the group, or torch keeps its options elsewhere
            continue
    return float(dist.default_pg_timeout.total_seconds())


def _created(size: int) -> "tuple[str, int]":
    """A fresh file of `size` zero bytes in /dev/shm (memory, never a folder another host could share), with a
    token in its first word: its path and the token."""
    descriptor, path = tempfile.mkstemp(prefix="toma-agreement-", dir="/dev/shm")
    token = secrets.randbits(62)
    try:
        os.ftruncate(descriptor, size)
        os.pwrite(descriptor, token.to_bytes(8, sys.byteorder, signed=True), 0)
    except OSError:  # no room in /dev/shm (a container's small one): nothing left behind
        os.unlink(path)
        raise
    finally:
        os.close(descriptor)
    return path, token


def _boot() -> Optional[str]:
    """This host's boot id: ranks that see the same file but differ here are on different hosts."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return boot.read().strip()
    except OSError:
        return None


def _mapped(path: Optional[str], size: int, token: int) -> Optional[mmap.mmap]:
    """The file at `path` mapped, where it exists here and holds `token`."""
    if path is None:
        return None
    try:
        descriptor = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        mapped = mmap.mmap(descriptor, size)
    except OSError:
        return None
    finally:
        os.close(descriptor)
    if memoryview(mapped).cast("q")[_TOKEN] != token:
        mapped.close()
        return None
    return mapped


_BY_GROUP: "weakref.WeakKeyDictionary[Any, Optional[HostMin]]" = weakref.WeakKeyDictionary()


def host_min_for(group: Any = None) -> Optional[HostMin]:
    """The shared-memory MIN of `group`'s ranks (None: the default group), or None where they do not share a host.
    A collective over the group the first time (every rank calls it); remembered for the group after that."""
    group = dist.group.WORLD if group is None else group
    if group in _BY_GROUP:
        return _BY_GROUP[group]
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    size = 8 * (1 + 2 * world_size)
    where: List[Any] = [None, 0]
    if rank == 0:
        try:
            where = list(_created(size))
        except OSError:
            pass
    seen: List[Any] = [None] * world_size
    try:
        dist.broadcast_object_list(where, src=dist.get_global_rank(group, 0), group=group)
        mapped = _mapped(where[0], size, where[1])
        dist.all_gather_object(seen, (mapped is not None, os.getpid(), _pid_namespace(), _boot()), group=group)
    finally:  # every rank mapped it, or gave up (or the handshake failed): the memory lives while mapped
        if rank == 0 and where[0] is not None:
            os.unlink(where[0])
    exchange = None
    if all(ok for ok, *_ in seen) and len({boot for *_, boot in seen}) == 1:
        assert mapped is not None
        # process ids from another PID namespace (containers sharing /dev/shm) name nothing here: not watched
        here = _pid_namespace()
        pids = [pid if here is not None and namespace == here else None for _, pid, namespace, _ in seen]
        exchange = HostMin(mapped, rank, world_size, pids, _timeout(group))
    elif mapped is not None:
        mapped.close()
    _BY_GROUP[group] = exchange
    return exchange
