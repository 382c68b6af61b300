"""Real servers on loopback for the tests that need them: start, wait until ready, stop — bounded in time.

Each server runs as a child in its own session (process group) bound to 127.0.0.1 on a free port; `stop` ends
the whole group (uvicorn workers, Prefect's services, a worker's flow-run subprocesses) with SIGTERM, then
SIGKILL after a grace period, so no process outlives the test. Output goes to a log file whose tail is shown
when a server fails to come up. `startup_s` is the measured time from spawn to the first good answer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Self

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port free on loopback now (the usual bind-to-0 probe; the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def offline_env(**extra: str) -> dict[str, str]:
    """The child environment: ours, telemetry and hub access off, plus `extra`."""
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "DO_NOT_TRACK": "true",
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "ANONYMIZED_TELEMETRY": "False",
            "DVC_NO_ANALYTICS": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra)
    return env


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


class Server:
    """One server process: `with Server(...) as s:` starts it and waits for `ready_url`; leaving stops it."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        ready_url: str,
        *,
        log_dir: Path,
        env: dict | None = None,
        cwd: Path | None = None,
        start_timeout_s: float = 120.0,
    ):
        self.name, self.argv, self.ready_url = name, argv, ready_url
        self.env, self.cwd, self.start_timeout_s = env or offline_env(), cwd, start_timeout_s
        self.log_path = Path(log_dir) / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.startup_s = float("nan")

    def start(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        deadline = started + self.start_timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                status, _ = http_get(self.ready_url, timeout=2.0)
                if status == 200:
                    self.startup_s = time.perf_counter() - started
                    print(f"{self.name}: ready in {self.startup_s:.1f}s at {self.ready_url}")
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"{self.name} not ready after {self.start_timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 10.0) -> None:
        """End the server's whole process group: SIGTERM, then SIGKILL after `grace_s`."""
        stop_group(self.proc, grace_s)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_group(proc: subprocess.Popen | None, grace_s: float = 10.0) -> None:
    """SIGTERM the process group `proc` leads (it was started with start_new_session=True), SIGKILL what is
    left after `grace_s`; the group is killed even when its leader already exited."""
    if proc is None:
        return
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid  # leader gone: its session id is still the group id of whatever it left behind
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if not _group_alive(pgid):
            break
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)  # stragglers of a group whose leader exited first


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
