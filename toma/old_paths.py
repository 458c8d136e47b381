"""toma 1.1.0's module paths, each the module it moved to (the same object, so that patching a name through the
old path patches the module that uses it). `toma/__init__.py` registers them on import."""

import importlib
import sys
from types import ModuleType
from typing import Dict, List

__all__ = ["MOVED", "NAMES", "register"]

# old path -> new path: the four modules of toma 1.1.0, the last release before the package was split
MOVED: Dict[str, str] = {
    "toma.batchsize_cache": "toma.core.caches",
    "toma.cpu_memory": "toma.memory.cpu",
    "toma.stacktrace": "toma.core.call_sites",
    "toma.torch_cuda_memory": "toma.memory.cuda",
}
NAMES: List[str] = [old.rsplit(".", 1)[1] for old in MOVED]  # as attributes of the package


def register(package: ModuleType) -> None:
    """Make every old path import, and read as an attribute of `package`, the module it moved to."""
    for old, new in MOVED.items():
        module = importlib.import_module(new)
        sys.modules[old] = module
        setattr(package, old.rsplit(".", 1)[1], module)
