"""Memory on each device: CPU (`toma.memory.cpu`) and CUDA (`toma.memory.cuda`) helpers, the meters that
measure an attempt, the free-memory gauge, and snapshots of what a process holds (`toma.memory.snapshot`,
`toma.memory.History`, kept at `toma.memory` where they have always been)."""

from toma.memory.snapshots import History, MemorySnapshot, snapshot

__all__ = ["MemorySnapshot", "snapshot", "History"]
