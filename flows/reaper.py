"""A watchdog that ends what a killed `lopd cycle` / `lopd compare` leaves running.

Why: the temporary Prefect server is a child process (uvicorn on 127.0.0.1); when its parent is killed with
SIGKILL nothing in the parent runs, and the server lived on, orphaned. The watchdog is a small separate process
that watches the command's process tree through /proc. When the command ends normally it says so on the pipe
and the watchdog leaves; when the pipe closes without that word (the command died), the watchdog terminates
every descendant it saw, checking each one's start time so that a reused pid is never touched. A command stopped
by SIGTERM or SIGINT (lopd_core/stopping.py) does not say the word either: it ends with os._exit, which skips the
exit hook that would stop the temporary server, so the watchdog ends it. Linux only (/proc); elsewhere
`start_reaper` does nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lopd_core.stopping import stop_requested

DONE = b"done\n"
POLL_S = 0.5


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every living descendant of `root`."""
    parents: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st:
                parents.setdefault(st[0], []).append((int(entry), st[1]))
    found, todo = {}, [root]
    while todo:
        for pid, start in parents.get(todo.pop(), []):
            if pid not in found:
                found[pid] = start
                todo.append(pid)
    return found


def _terminate(seen: dict[int, int], grace_s: float = 5.0) -> None:
    def still(pid, start):
        st = _stat(pid)
        return st is not None and st[1] == start

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, start in seen.items():
            if still(pid, start):
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(still(p, s) for p, s in seen.items()):
            time.sleep(0.1)


def watch(parent: int, pipe) -> None:
    """Record `parent`'s descendants until the pipe closes; terminate them unless the parent said DONE."""
    os.set_blocking(pipe.fileno(), False)
    seen: dict[int, int] = {}
    message = b""
    while True:
        try:
            chunk = pipe.read()
        except BlockingIOError:
            chunk = None
        if chunk:
            message += chunk
        if chunk == b"" or _stat(parent) is None:  # end of file, or the parent is gone (a fork kept the pipe)
            break
        seen.update(descendants(parent))
        seen.pop(os.getpid(), None)
        time.sleep(POLL_S)
    if DONE not in message:
        _terminate(seen)


@contextmanager
def start_reaper() -> Iterator[None]:
    """Run the block with a watchdog over this process's children (see the module docstring)."""
    if not Path("/proc/self/stat").exists():
        yield
        return
    child = subprocess.Popen(
        [sys.executable, "-m", "flows.reaper", str(os.getpid())],
        stdin=subprocess.PIPE,
        start_new_session=True,
        cwd=str(Path(__file__).resolve().parents[1]),
    )
    try:
        yield
    finally:
        stopped = stop_requested() is not None  # SIGTERM/SIGINT: the process ends with os._exit, no exit hooks
        try:
            if not stopped:
                child.stdin.write(DONE)
            child.stdin.close()
        except OSError:
            pass
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=10 if stopped else 30)  # a stop's grace watchdog bounds it anyway


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.stdin.buffer)
