"""Advisory locks on pipeline folders: one writer at a time, a clear message for the second.

Why: two `lopd cycle` runs on one folder both read history.json, both ran "cycle 8" and one record was lost;
two bank refreshes both read the parquet, both appended, and one's rows were lost. The lock is an `flock` on a
`.lock` file inside the folder: the kernel releases it when the holder exits in any way (even SIGKILL), so a
crash never leaves a stale lock behind. The file also records who holds it, for the message the next caller
reads. It sits beside the folder (`data/.bank.lock` for `data/bank`), not inside it, so a DVC-tracked folder's
content does not change with who last held it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def lock_path(folder: str | Path) -> Path:
    folder = Path(folder).resolve()
    return folder.parent / f".{folder.name}.lock"


class FolderLocked(RuntimeError):
    """Another process holds the folder's lock (the message names it and what to do)."""


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return "another process"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')} ({info.get('command', '?')}, since {started})"


@contextmanager
def folder_lock(folder: str | Path, what: str, *, wait_s: float = 0.0, log=None) -> Iterator[Path]:
    """Hold `folder`'s lock for the block. With `wait_s` 0 a held lock raises FolderLocked at once; otherwise
    the caller waits up to `wait_s` seconds (saying so once through `log`) before raising."""
    folder = Path(folder)
    path = lock_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")  # noqa: SIM115  held past this function: the lock lives as long as it
    try:
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    raise FolderLocked(
                        f"{what} {folder} is in use by {_holder(path)}: wait for it to finish, or "
                        f"give this run another folder"
                    ) from None
                if log and not said:
                    log(f"waiting for {what} {folder}, in use by {_holder(path)}")
                    said = True
                time.sleep(0.05)
        handle.seek(0)
        handle.truncate()
        handle.write(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "since": time.time(),
                    "command": " ".join(Path(a).name if i == 0 else a for i, a in enumerate(sys.argv))[:200],
                }
            )
        )
        handle.flush()
        yield path
    finally:
        handle.close()  # closing the descriptor releases the flock
