"""What the trace store raises: each a one-line message naming the store and what to do."""

from __future__ import annotations


class StoreFull(RuntimeError):
    """The store holds its stated maximum: nothing more is accepted until it is snapshot and cleared."""


class DiskFull(OSError):
    """A write failed (the disk is full, or another I/O error) and was undone: no partial record is left."""


class TraceStoreError(ValueError):
    """A store that cannot be read or written as it is: corrupted, edited, not a folder, not writable."""


class StoreLocked(TraceStoreError):
    """Another process writes to this store (one writer per store)."""


class Rotated(TraceStoreError):
    """A later turn's record names the store epoch its trajectory started in, and the store was rotated since:
    its earlier turns are in the archive, so it must be written as a turn 0 that carries them."""
