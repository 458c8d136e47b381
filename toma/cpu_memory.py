"""toma 1.1.0's `toma.cpu_memory`, which is now `toma.memory.cpu`: this file is for type checkers. At run time
`import toma` makes `toma.cpu_memory` that module itself (`toma.old_paths`), so this code never runs."""

from toma.memory.cpu import *  # noqa: F401,F403
