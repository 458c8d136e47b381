"""toma 1.1.0's `toma.torch_cuda_memory`, which is now `toma.memory.cuda`: this file is for type checkers. At run time
`import toma` makes `toma.torch_cuda_memory` that module itself (`toma.old_paths`), so this code never runs."""

from toma.memory.cuda import *  # noqa: F401,F403
