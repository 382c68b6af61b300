"""Helpers of the clean-stop tests (tests/pipeline/test_cycle_clean_stop.py, tests/serve/test_serve_clean_stop.py):
start a `lopd` command as a scheduler would (a session of its own, a marker in its environment), SIGTERM it and time
the exit, and list what it left running."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _servers import offline_env

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 30


def left_running(marker: str) -> list[str]:
    """The command lines of live processes whose environment holds the marker."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
            if marker.encode() in environ and stat[stat.rindex(")") + 2] != "Z":
                found.append(Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except (OSError, ValueError):
            continue
    return found


def settle(marker: str, within_s: float = 15.0) -> list[str]:
    """What is still running `within_s` after the exit (a reaped child takes a moment to go)."""
    deadline = time.monotonic() + within_s
    while (left := left_running(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def start(argv: list[str], cwd: Path, marker: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lopd_cli.main", *argv],
        cwd=cwd,
        env=offline_env(LOPD_STOP_TEST=marker, PYTHONPATH=str(ROOT), **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a scheduler's SIGTERM goes to the command alone, not to its process group
    )


def read_until(proc: subprocess.Popen, needle: str, timeout_s: float, lines: list[str]) -> bool:
    """Read the command's output into `lines` until a line holds `needle` (False: it ended or timed out)."""
    found = threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line)
            if needle in line:
                found.set()
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    return found.wait(timeout_s) and any(needle in line for line in lines)


def terminate(proc: subprocess.Popen) -> tuple[int, float]:
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    try:
        code = proc.wait(timeout=GRACE_S + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running {GRACE_S + 30}s after SIGTERM")
    return code, time.monotonic() - sent
