"""Sizes that survive a restart: what a call site learned, kept in an SQLite file.

`toma.remember_sizes(path)` (or the environment variable `TOMA_SIZES=<path>`) turns it on. A cache entry
that a call site uses for the first time starts from the stored size; a size that changes (an OOM, a
measured growth) is written at once, and so is a learning policy's first measurement at a size it kept. Keys are stable across runs and processes: the function's module and
qualified name, the call site's file and line, the device (kind, name, total memory), the world size and the
rank (each rank keeps what it learned; a restart's ranks agree on the smallest). Many processes may share a file
(WAL mode, short transactions, opened together without a "database is locked"). A file that cannot be read or written
costs one WARNING on the `toma` logger; the job then runs without persistence. The hot path (a call whose
entry is known and whose size does not change) never touches the file.
"""

import logging
import os
import sqlite3
import threading
import time
from typing import Any, List, Optional, Tuple

import torch.distributed

from toma.core.caches import LearnedState
from toma.memory.backends import backend_for, default_device

__all__ = ["SizeStore", "remember_sizes", "active_store", "device_key", "describe_model", "ENVIRONMENT_VARIABLE"]

log = logging.getLogger("toma")

ENVIRONMENT_VARIABLE = "TOMA_SIZES"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS toma_sizes (
    key TEXT PRIMARY KEY,
    site TEXT NOT NULL,
    device TEXT NOT NULL,
    size INTEGER NOT NULL,
    model TEXT,
    updated REAL NOT NULL,
    levers TEXT
)
"""
_LEVERS_SEPARATOR = ", "  # between the names of the memory levers a size was learned with


_WAIT_S = 30.0  # how long a write waits for another process's


def _wal_mode(connection: sqlite3.Connection) -> None:
    """Put the file in WAL mode, waiting for the other processes that open it at the same moment: SQLite answers
    "database is locked" at once to a change of journal mode while another connection holds a lock (the ranks of
    a job started together all open a new file at their first call), without its busy timeout."""
    deadline = time.monotonic() + _WAIT_S
    pause = 0.005
    while True:
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


class SizeStore:
    """One SQLite file of remembered sizes. Every method swallows storage errors after one WARNING."""

    def __init__(self, path: str) -> None:
        self.path = os.fspath(path)
        self.broken = False
        self._lock = threading.Lock()
        self._connection: Optional[sqlite3.Connection] = None

    def _connect(self) -> sqlite3.Connection:
        if self._connection is None:
            if os.path.isdir(self.path):
                raise sqlite3.OperationalError("it is a directory")
            connection = sqlite3.connect(self.path, timeout=_WAIT_S, check_same_thread=False, isolation_level=None)
            _wal_mode(connection)
            connection.execute(_SCHEMA)
            columns = {row[1] for row in connection.execute("PRAGMA table_info(toma_sizes)")}
            if "levers" not in columns:  # a file written before the levers were kept
                connection.execute("ALTER TABLE toma_sizes ADD COLUMN levers TEXT")
            self._connection = connection
        return self._connection

    def _fail(self, error: BaseException) -> None:
        if not self.broken:
            self.broken = True
            log.warning("toma: cannot use the size file %s (%s); going on without remembered sizes", self.path, error)

    def recall(self, key: str) -> Optional[Tuple[int, Optional[str], Tuple[str, ...]]]:
        """(size, the policy's model as JSON text or None, the memory levers it needs) remembered under `key`
        (None: nothing usable)."""
        if self.broken:
            return None
        try:
            with self._lock:
                row = (
                    self._connect()
                    .execute("SELECT size, model, levers FROM toma_sizes WHERE key = ?", (key,))
                    .fetchone()
                )
        except (sqlite3.Error, OSError) as error:
            self._fail(error)
            return None
        if row is None or not isinstance(row[0], int) or row[0] < 1:
            return None
        levers = tuple(row[2].split(_LEVERS_SEPARATOR)) if isinstance(row[2], str) and row[2] else ()
        return int(row[0]), row[1] if isinstance(row[1], str) else None, levers

    def put(
        self, key: str, site: str, device: str, size: int, model: Optional[str] = None, levers: Tuple[str, ...] = ()
    ) -> None:
        if self.broken:
            return
        try:
            with self._lock:
                self._connect().execute(
                    "INSERT INTO toma_sizes (key, site, device, size, model, updated, levers) VALUES (?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT(key) DO UPDATE SET size = excluded.size, model = excluded.model, "
                    "updated = excluded.updated, levers = excluded.levers",
                    (key, site, device, int(size), model, time.time(), _LEVERS_SEPARATOR.join(levers)),
                )
        except (sqlite3.Error, OSError) as error:
            self._fail(error)

    def rows(self) -> List[Tuple[str, str, int, Optional[str], float]]:
        """(site, device, size, model, when) for every remembered size (errors raise: for the CLI)."""
        with self._lock:
            return list(
                self._connect().execute("SELECT site, device, size, model, updated FROM toma_sizes ORDER BY site")
            )

    def clear(self) -> int:
        with self._lock:
            return int(self._connect().execute("DELETE FROM toma_sizes").rowcount)


_store: Optional[SizeStore] = None
_environment_checked = False


def remember_sizes(path: Optional[str]) -> Optional[SizeStore]:
    """Keep sizes in the SQLite file at `path` from now on (None: stop). Returns the store."""
    global _store, _environment_checked
    _environment_checked = True
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a file path, got {path!r}")
    if path is not None and not os.fspath(path):  # SQLite would keep the sizes in a temporary file, then drop it
        raise ValueError("path must name a file (None stops remembering sizes), got ''")
    _store = None if path is None else SizeStore(os.fspath(path))
    return _store


def active_store() -> Optional[SizeStore]:
    """The store in use: the one `remember_sizes` set, else `TOMA_SIZES`'s (read once), else None."""
    global _store, _environment_checked
    if not _environment_checked:
        _environment_checked = True
        path = os.environ.get(ENVIRONMENT_VARIABLE)
        if path:
            _store = SizeStore(path)
    return _store


def device_key(device: Any = None) -> str:
    """The device a size was learned on, as its backend names it (for a CUDA device its name and memory, for
    the CPU its address-space limit: what decides which sizes fit), the world size and the rank (a rank's sizes
    are its own: one that ran out of memory alone remembers it; the ranks agree on the smallest when they start).
    `device` None (not known): `toma.memory.backends.default_device()`, the current CUDA device in a process that
    uses CUDA."""
    world, rank = 1, ""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world, rank = torch.distributed.get_world_size(), f":rank={torch.distributed.get_rank()}"
    if device is None:
        device = default_device()
    return f"{backend_for(device).identity(device)}:world={world}{rank}"


def describe_model(learned: Optional[LearnedState]) -> Optional[str]:
    """A learning policy's state as text for the file (None when there is none): its own `describe()`,
    which a later run's policy reads back through `restore`."""
    return None if learned is None else learned.describe()
