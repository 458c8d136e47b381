"""Memory on each device: CPU (`toma.memory.cpu`) and CUDA (`toma.memory.cuda`) helpers, the meters that
measure an attempt, the free-memory gauge, and snapshots of what a process holds (`toma.memory.snapshot`,
`toma.memory.MemoryHistory`, kept at `toma.memory` where the docs show them)."""

from toma.memory.snapshots import MemoryHistory, MemorySnapshot, snapshot

__all__ = ["MemorySnapshot", "snapshot", "MemoryHistory"]
