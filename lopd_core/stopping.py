"""Clean stops on SIGTERM and SIGINT for the long commands: `lopd cycle`, `lopd compare`, `lopd serve`.

SIGTERM is what a scheduler, a CI runner or Kubernetes sends first; SIGINT is Ctrl-C. Under `stop_on_signals`:
  1. the first signal raises StopRequested in the main thread: a KeyboardInterrupt, so no `except Exception`
     swallows it and every `finally` on the way out runs: the stage's MLflow run ends KILLED (tasks/tracking.py),
     folder locks are released, the stage's work folder is left without its completion mark (tasks/caching.py),
     so the next run resumes it, and the Prefect flow runs are marked Cancelled (flows/stopping.py);
  2. a watchdog ends the process after `grace_s` seconds whatever still runs (os._exit), and so does leaving the
     block: Prefect's exit drain once waited forever on a temporary server that the same signal had killed;
  3. a second signal ends the process at once.
The exit status is 128 + the signal's number (143 for SIGTERM, 130 for SIGINT), as a shell shows a process that
the signal killed.

Why raise rather than set a flag that loops poll: the stages are library code (distillation, rollouts, evaluation)
with no stop points, and they run in the main thread, where a handler's exception lands at the next bytecode.
Why the signals are also counted by a thread reading `signal.set_wakeup_fd`: while a Prefect flow runs, Prefect
installs its own SIGTERM handler (it raises TerminationSignal, which unwinds the same way), so ours is not called;
the interpreter's C-level handler writes every signal's number to the wakeup fd whichever Python handler is
installed, so the grace and the second signal hold inside flows too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(KeyboardInterrupt):
    """The first SIGTERM or SIGINT under `stop_on_signals`, raised in the main thread."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_status(signum: int) -> int:
    return 128 + signum


class _Stop:
    """What one `stop_on_signals` block knows: the command, the grace, the first signal, and how many signals each
    observer (the wakeup-fd reader, our handler, a server's own handler) has seen: each counts what it sees, so one
    signal seen by two of them is not taken for a second one."""

    def __init__(self, command: str, grace_s: float):
        self.command, self.grace_s = command, grace_s
        self.signum: int | None = None
        self.seen: dict[str, int] = {}
        self.watching = False
        self.raised = False
        self.lock = threading.Lock()

    def say(self, text: str) -> None:
        print(f"{self.command}: {text}", file=sys.stderr, flush=True)

    def signalled(self, signum: int, observer: str) -> None:
        """`observer` saw a signal: the first starts the grace's watchdog, an observer's second exits at once."""
        with self.lock:
            self.seen[observer] = self.seen.get(observer, 0) + 1
            again = self.seen[observer] > 1
            self.signum = self.signum or signum
            start = not self.watching
            self.watching = True
        name = signal.Signals(signum).name
        if again:
            self.say(f"{name} again: exiting now")
            exit_now(exit_status(self.signum))
        if start:
            self.say(
                f"{name}: stopping (the running work unwinds; exit within {self.grace_s:g}s, a second signal exits now)"
            )
            threading.Thread(target=self._watchdog, name="lopd-stop-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        time.sleep(self.grace_s)
        self.say(f"still running {self.grace_s:g}s after {signal.Signals(self.signum).name}: exiting now")
        exit_now(exit_status(self.signum))


_current: _Stop | None = None


def stop_requested() -> int | None:
    """The signal that asked this process to stop (None: none did, or no `stop_on_signals` block is open)."""
    return _current.signum if _current else None


def exit_now(status: int) -> None:
    """Flush what was printed and end the process without running exit hooks or joining threads."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def note_signal(signum: int, observer: str) -> None:
    """For a server that handles the stop signals itself (uvicorn under `lopd serve`): report each one it gets, so
    the grace and the second signal hold while its handler is installed instead of ours."""
    if _current is not None:
        _current.signalled(signum, observer)


def _handler(signum: int, frame) -> None:
    stop = _current
    if stop is None:
        return
    stop.signalled(signum, "handler")  # a second one exits here
    with stop.lock:
        if stop.raised:
            return
        stop.raised = True
    raise StopRequested(signum)


def _read_signals(read_fd: int, stop: _Stop) -> None:
    """Each byte the C handler writes to the wakeup fd is a signal's number."""
    wanted = {int(s) for s in STOP_SIGNALS}
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            data = b""
        if not data:
            break
        for signum in data:
            if signum in wanted:
                stop.signalled(signum, "wakeup fd")
    os.close(read_fd)


@contextmanager
def stop_on_signals(command: str, grace_s: float) -> Iterator[None]:
    """Run the block under the module docstring's stop rules. Leaving the block after a stop ends the process
    with the signal's status (what a stop left to clean up was cleaned up on the way out); otherwise the handlers
    and wakeup fd from before are restored. Outside the main thread it does nothing."""
    global _current
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stop = _Stop(command, grace_s)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    _current = stop
    previous = {s: signal.signal(s, _handler) for s in STOP_SIGNALS}
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_read_signals, args=(read_fd, stop), name="lopd-stop-signals", daemon=True).start()
    try:
        yield
    finally:
        if stop.signum is not None:
            stop.say(f"stopped by {signal.Signals(stop.signum).name} (exit status {exit_status(stop.signum)})")
            exit_now(exit_status(stop.signum))
        signal.set_wakeup_fd(previous_fd)
        for s, handler in previous.items():
            signal.signal(s, handler)
        _current = None
        os.close(write_fd)  # the reader sees end of file and returns
