"""The package version, kept apart so setup.cfg can read it without importing torch."""

__version__ = "1.2.0"
