"""The progress line every command prints: `[HH:MM:SS] message`, flushed at once.

One definition, because the commands (lopd_cli/), the Prefect tasks and flows (tasks/, flows/) and the
benchmark runs all print the same line; the drivers themselves take a `log` callable instead (print by default),
so a library caller decides where its progress goes. Imports nothing of the package.
"""

from __future__ import annotations

import time


def log(message: str) -> None:
    """One progress line, time-stamped. Under Prefect the flows log prints, so it also reaches the run's logs."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)
