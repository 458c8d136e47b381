"""toma 1.1.0's `toma.stacktrace`, which is now `toma.core.call_sites`: this file is for type checkers. At run time
`import toma` makes `toma.stacktrace` that module itself (`toma.old_paths`), so this code never runs."""

from toma.core.call_sites import *  # noqa: F401,F403
