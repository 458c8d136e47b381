"""Torch Memory-adaptive Algorithms: code that adapts to the (CUDA) memory it has.

Functions wrapped by toma retry with a smaller batch or step after an out-of-memory error, and a cache
remembers the size that worked. A drop-in successor of toma 1.1.0.
"""

import sys

from toma import memory, old_paths, surface
from toma.accumulation.coupling import CoupledRows
from toma.accumulation.misuse import AccumulationMisuse
from toma.batching.splitting import whole
from toma.core import call_sites as tst
from toma.core.caches import (
    CONTEXT_CACHE_SIZE,
    BatchsizeCache,
    GlobalBatchsizeCache,
    NoBatchsizeCache,
    StacktraceMemoryBatchsizeCache,
    get_cache_for_context,
)
from toma.core.oom import register_oom_predicate, release_memory, should_reduce_batch_size, unregister_oom_predicate
from toma.core.size_file import remember_sizes
from toma.forms import PackageModule, explicit, simple, toma
from toma.generation.generate import generate
from toma.memory.cpu import is_out_of_cpu_memory
from toma.memory.cuda import gc_cuda, is_cuda_out_of_memory, is_cudnn_snafu
from toma.offload.hosted_embedding import HostedEmbedding
from toma.sizing.fit_to_memory import FitToMemory
from toma.sizing.policies import Halving, ShrinkByFactor, SizePolicy
from toma.training.history import TrainingHistory
from toma.training.trainer import Callback, StopTraining, Trainer
from toma.version import __version__

__all__ = [
    "toma",
    "explicit",
    "simple",
    "DEFAULT_CACHE_TYPE",
    "DEFAULT_POLICY",
    "NoBatchsizeCache",
    "GlobalBatchsizeCache",
    "StacktraceMemoryBatchsizeCache",
    "get_cache_for_context",
    "CONTEXT_CACHE_SIZE",
    "should_reduce_batch_size",
    "register_oom_predicate",
    "unregister_oom_predicate",
    "release_memory",
    "SizePolicy",
    "ShrinkByFactor",
    "Halving",
    "FitToMemory",
    "remember_sizes",
    "HostedEmbedding",
    "whole",
    "AccumulationMisuse",
    "CoupledRows",
    "Trainer",
    "generate",
    "Callback",
    "StopTraining",
    "TrainingHistory",
    "memory",
    "is_out_of_cpu_memory",
    "is_cuda_out_of_memory",
    "is_cudnn_snafu",
    "gc_cuda",
    "tst",
    "__version__",
]

# The cache type used where none is given: a live setting (read at call time) that assignments reach, through
# the package module's class. Declared here so that type checkers know it.
DEFAULT_CACHE_TYPE: type[BatchsizeCache]
DEFAULT_POLICY: SizePolicy  # the forms' sizing policy where none is given (Halving), live like DEFAULT_CACHE_TYPE
# `toma.map(func, *inputs, device=...)` also from the package (left out of __all__: a star import would shadow
# the builtin).
map = toma.map
sys.modules[__name__].__class__ = PackageModule
old_paths.register(sys.modules[__name__])  # toma 1.1.0's module paths
surface.settle(sys.modules[__name__], ["map", *old_paths.NAMES])  # and nothing else: no toma.sys, no toma.core
