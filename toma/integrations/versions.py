"""The oldest framework release each integration works with, checked when the integration is imported."""

from packaging.version import Version

__all__ = ["require"]


def require(package: str, found: str, minimum: str, extra: str) -> None:
    """Raise ImportError naming `package`, the release `found` and `minimum` when `found` is older."""
    if Version(found).release < Version(minimum).release:
        raise ImportError(
            f"toma's {package} integration needs {package} >= {minimum}, found {found}: "
            f"pip install 'toma[{extra}]' (or '{package}>={minimum}')"
        )
