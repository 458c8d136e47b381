"""Batches as data: splitting a call's arguments into micro-batches, joining results, moving them to a device."""
