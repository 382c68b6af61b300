"""The parent's side of a sandbox run's I/O: bounded output capture under a deadline, and the child's report.

Why not `Popen.communicate`: it buffers everything the child writes, so a program printing in a loop would
grow the parent's memory without bound. Here both pipes are drained as they fill (the child never blocks on a
full pipe, so it cannot stall the deadline), only the first `keep_bytes` of each stream are kept, and the run
is stopped once it has written `kill_after_bytes` in total. The report is parsed defensively: it was written
by a process that also ran untrusted code, so every line is checked for shape and size.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

EXIT_GRACE_S = 0.25  # after the leader exits, how long a straggler holding the pipes may keep them open
MAX_REPORT_BYTES = 16 * 1024 * 1024
NO_RESULT = "no result (the run stopped before this call)"


@dataclass
class CapturedIO:
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    stop: str | None  # None, "wall_clock" or "output_limit"


def _leader_exited(pid: int) -> bool:
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def supervise(proc: subprocess.Popen, *, deadline: float, keep_bytes: int, kill_after_bytes: int) -> CapturedIO:
    """Drain stdout/stderr until both close, the deadline passes or the output budget is spent."""
    kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    truncated = dict.fromkeys(kept, False)
    total = 0
    stop = None
    exited_at = None
    with selectors.DefaultSelector() as selector:
        for fd in kept:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            now = time.perf_counter()
            if now >= deadline:
                stop = "wall_clock"
                break
            if exited_at is None and _leader_exited(proc.pid):
                exited_at = now
            if exited_at is not None and now - exited_at > EXIT_GRACE_S:
                break  # the leader is gone; whoever still holds the pipes is killed with the group
            for key, _ in selector.select(timeout=min(deadline - now, 0.05)):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                total += len(chunk)
                room = keep_bytes - len(kept[key.fd])
                if room > 0:
                    kept[key.fd] += chunk[:room]
                if len(chunk) > max(room, 0):
                    truncated[key.fd] = True
            if total > kill_after_bytes:
                stop = "output_limit"
                break
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    return CapturedIO(
        kept[out_fd].decode("utf-8", "replace"),
        kept[err_fd].decode("utf-8", "replace"),
        truncated[out_fd],
        truncated[err_fd],
        stop,
    )


def read_report(path: Path, n_calls: int) -> dict:
    """{"calls": [...], "done": bool, "error", "isolation", "setup_error"} from the child's JSON lines."""
    calls: list[dict] = [{"error": NO_RESULT} for _ in range(n_calls)]
    report: dict = {"calls": calls, "done": False, "error": None}
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_REPORT_BYTES)
    except OSError:
        return report
    for line in raw.splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(record, dict):
            continue
        event = record.get("event")
        error = record.get("error")
        error = error[:2000] if isinstance(error, str) else None
        if event == "call":
            i = record.get("i")
            if isinstance(i, int) and 0 <= i < n_calls:
                calls[i] = {"value": record["value"]} if "value" in record else {"error": error or "error"}
        elif event == "setup" and isinstance(record.get("isolation"), dict):
            report["isolation"] = record["isolation"]
        elif event == "setup_error":
            report["setup_error"] = error or "setup failed"
        elif event == "load_error":
            report["error"] = error or "error"
        elif event == "done":
            report["done"] = True
            report["error"] = error
    return report
