"""toma 1.1.0's `toma.batchsize_cache`, which is now `toma.core.caches`: this file is for type checkers. At run time
`import toma` makes `toma.batchsize_cache` that module itself (`toma.old_paths`), so this code never runs."""

from toma.core.caches import *  # noqa: F401,F403
