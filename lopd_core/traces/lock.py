"""One writer per trace store: an exclusive lock on `DIR/.writer.lock`, held while a server (or a repair) runs.

Why a lock: two servers appending to one store would each count only their own bytes against the bound, could
each open the same next segment, and a repair running beside a server would rewrite a segment under its open
file. `flock` is released by the kernel when the holder dies (a `kill -9` leaves no stale lock to clear by
hand); the file keeps the holder's pid only to name it in the refusal. POSIX only (fcntl), as is the server.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from lopd_core.traces.errors import StoreLocked

LOCK_NAME = ".writer.lock"


class WriterLock:
    """Taken at construction (or StoreLocked), released by `release()` or when the process ends."""

    def __init__(self, store_dir: Path, *, purpose: str):
        self.path = Path(store_dir) / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise StoreLocked(
                f"trace store {store_dir} is in use by {holder}: one writer per store (stop it, or give this "
                "one another --store)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{purpose} (pid {os.getpid()})".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
