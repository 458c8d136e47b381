"""Memory on each device: CPU (`toma.memory.cpu`) and CUDA (`toma.memory.cuda`) helpers, the meters that
measure an attempt, the free-memory gauge, and snapshots of what a process holds (`toma.memory.snapshot`,
`toma.memory.History`, kept here where the README has always pointed)."""

from toma.memory.snapshots import History, MemorySnapshot, snapshot

__all__ = ["MemorySnapshot", "snapshot", "History"]
