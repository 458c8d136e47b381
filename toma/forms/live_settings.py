"""The package's live settings: `toma.DEFAULT_CACHE_TYPE` and `toma.DEFAULT_POLICY`, read at call time, and
assignable on the package module and on the `toma` namespace alike."""

import types
from typing import Any, Type

from toma.core.caches import BatchsizeCache, get_default_cache_type, set_default_cache_type
from toma.core.policy import SizePolicy
from toma.sizing.defaults import get_default_policy, set_default_policy

__all__ = ["PackageModule", "SettingsNamespace"]


class _DefaultCacheType:
    """`DEFAULT_CACHE_TYPE` as a live attribute: reading and assigning it go to one shared setting."""

    def __get__(self, instance: Any, owner: Any = None) -> Type[BatchsizeCache]:
        return get_default_cache_type()

    def __set__(self, instance: Any, value: Type[BatchsizeCache]) -> None:
        set_default_cache_type(value)


class _DefaultPolicy:
    """`DEFAULT_POLICY` as a live attribute, like `DEFAULT_CACHE_TYPE`."""

    def __get__(self, instance: Any, owner: Any = None) -> SizePolicy:
        return get_default_policy()

    def __set__(self, instance: Any, value: SizePolicy) -> None:
        set_default_policy(value)


class SettingsNamespace(type):
    """The metaclass of the `toma` namespace, so that `toma.DEFAULT_POLICY = ...` reaches the setting."""

    DEFAULT_CACHE_TYPE = _DefaultCacheType()
    DEFAULT_POLICY = _DefaultPolicy()


class PackageModule(types.ModuleType):
    """The class of the `toma` package module, so that `toma.DEFAULT_CACHE_TYPE = ...` (and
    `toma.DEFAULT_POLICY = ...`) take effect."""

    DEFAULT_CACHE_TYPE = _DefaultCacheType()
    DEFAULT_POLICY = _DefaultPolicy()
