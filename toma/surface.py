"""What `import toma` shows: the public names (`toma.__all__`), toma 1.1.0's module paths and `toma.map`, and
nothing its own imports leave behind (`sys`, `typing` names, the subpackages the import system binds)."""

import sys
from types import ModuleType
from typing import Callable, Iterable, List

__all__ = ["settle"]


def settle(package: ModuleType, extra: Iterable[str]) -> None:
    """Keep in `package` only its dunders, `__all__` and `extra`; an imported submodule is still found as
    `package.<name>` (so `import toma.offload.pinned` then `toma.offload.pinned.HOST` works), but not listed."""
    keep = set(package.__all__) | set(extra)
    namespace = vars(package)
    for name in [name for name in namespace if name not in keep and not _is_dunder(name)]:
        del namespace[name]
    namespace["__getattr__"] = _submodule_lookup(package.__name__)
    namespace["__dir__"] = lambda: _listing(package)


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _submodule_lookup(prefix: str) -> Callable[[str], ModuleType]:
    """The package's `__getattr__` (PEP 562), asked only for a name the namespace lacks: an imported submodule."""

    def __getattr__(name: str) -> ModuleType:
        module = sys.modules.get(f"{prefix}.{name}")
        if module is None:
            raise AttributeError(f"module {prefix!r} has no attribute {name!r}")
        return module

    return __getattr__


def _listing(package: ModuleType) -> List[str]:
    """The package's `dir()`: its namespace and the live settings its module class defines (`DEFAULT_POLICY`)."""
    settings = {name for name in vars(type(package)) if not name.startswith("_")}
    return sorted(set(vars(package)) | settings)
