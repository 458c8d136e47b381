"""Module paths of earlier releases, each the module it moved to (the same object, so that patching a name
through the old path patches the module that uses it). `toma/__init__.py` registers them on import."""

import importlib
import sys
from types import ModuleType
from typing import Dict

__all__ = ["MOVED", "register"]

# old path -> new path (toma 1.1.0's four modules first)
MOVED: Dict[str, str] = {
    "toma.batchsize_cache": "toma.core.caches",
    "toma.cpu_memory": "toma.memory.cpu",
    "toma.stacktrace": "toma.core.call_sites",
    "toma.torch_cuda_memory": "toma.memory.cuda",
    "toma.engine": "toma.core.engine",
    "toma.oom": "toma.core.oom",
    "toma.arguments": "toma.core.arguments",
    "toma.distributed": "toma.core.agreement",
    "toma.signatures": "toma.core.signatures",
    "toma.size_store": "toma.core.size_file",
    "toma.policy": "toma.sizing.policies",
    "toma.fit_to_memory": "toma.sizing.fit_to_memory",
    "toma.need": "toma.sizing.need",
    "toma.bracket": "toma.sizing.bracket",
    "toma.meters": "toma.memory.meters",
    "toma.free_memory": "toma.memory.free",
    "toma.splitting": "toma.batching.splitting",
    "toma.batches": "toma.batching.batches",
    "toma.transfer": "toma.batching.transfer",
    "toma.accumulate": "toma.accumulation.accumulate",
    "toma.gradients": "toma.accumulation.gradients",
    "toma.rollback": "toma.accumulation.rollback",
    "toma.misuse": "toma.accumulation.misuse",
    "toma.trainer": "toma.training.trainer",
    "toma.history": "toma.training.history",
    "toma.progress": "toma.training.progress",
    "toma.host_map": "toma.offload.host_map",
    "toma.hosted_embedding": "toma.offload.hosted_embedding",
    "toma.row_optimizer": "toma.offload.row_optimizer",
    "toma.pinned": "toma.offload.pinned",
}


def register(package: ModuleType) -> None:
    """Make every old path import, and read as an attribute of `package`, the module it moved to."""
    for old, new in MOVED.items():
        module = importlib.import_module(new)
        sys.modules[old] = module
        setattr(package, old.rsplit(".", 1)[1], module)
