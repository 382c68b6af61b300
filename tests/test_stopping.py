"""lopd_core/stopping.py on a real process: the first SIGTERM/SIGINT unwinds the main thread through its `finally`,
a block that will not unwind is ended after the grace, a second signal ends it at once, and a handler installed
over ours (Prefect's SIGTERM handler while a flow runs) changes none of that. Each case runs a small script in a
child process and times its exit; the bounds are generous for a loaded 2-core machine, the grace of each case far
above them so that they tell the paths apart."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import signal, sys, time
from lopd_core.stopping import StopRequested, stop_on_signals
GRACE = float(sys.argv[1])
"""

SCRIPTS = {
    # the ordinary case: the exception unwinds the work, the `finally` runs, leaving the block exits
    "unwinds": """
with stop_on_signals("test", GRACE):
    try:
        print("ready", flush=True)
        time.sleep(600)
    finally:
        print("finally ran", flush=True)
""",
    # work that swallows the stop and goes on: only the watchdog ends it
    "stuck": """
with stop_on_signals("test", GRACE):
    try:
        print("ready", flush=True)
        time.sleep(600)
    except StopRequested:
        print("swallowed", flush=True)
        while True:
            time.sleep(0.1)
""",
    # a handler of its own over ours, as Prefect's while a flow runs: it raises something else
    "foreign": """
class Other(BaseException):
    pass
def other(signum, frame):
    raise Other()
with stop_on_signals("test", GRACE):
    signal.signal(signal.SIGTERM, other)
    try:
        print("ready", flush=True)
        time.sleep(600)
    except Other:
        print("other raised", flush=True)
        while True:
            time.sleep(0.1)
""",
}


def start(case: str, grace_s: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", PRELUDE + SCRIPTS[case], str(grace_s)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def stop(proc: subprocess.Popen, *signals: signal.Signals, gap_s: float = 1.0) -> tuple[int, float, str, str]:
    """Send `signals` gap_s apart; (exit status, seconds from the last signal to the exit, stdout, stderr)."""
    for i, sig in enumerate(signals):
        if i:
            time.sleep(gap_s)
        proc.send_signal(sig)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=120)
    return proc.returncode, time.monotonic() - sent, out, err


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_first_signal_unwinds_through_finally(sig, status):
    code, seconds, out, err = stop(start("unwinds", grace_s=60), sig)
    assert code == status
    assert "finally ran" in out
    assert seconds < 15  # far inside the 60 s grace: the unwinding, not the watchdog, ended it
    assert f"stopped by {sig.name}" in err


def test_watchdog_ends_a_block_that_will_not_unwind():
    code, seconds, out, err = stop(start("stuck", grace_s=3), signal.SIGTERM)
    assert code == 143 and "swallowed" in out
    assert 2.5 <= seconds < 20  # the 3 s grace, not sooner
    assert "exiting now" in err


def test_second_signal_exits_at_once():
    code, seconds, out, err = stop(start("stuck", grace_s=60), signal.SIGTERM, signal.SIGTERM, gap_s=1.0)
    assert code == 143 and "swallowed" in out
    assert seconds < 15  # far inside the 60 s grace
    assert "again: exiting now" in err


def test_grace_and_second_signal_hold_under_a_handler_installed_over_ours():
    code, seconds, out, _err = stop(start("foreign", grace_s=3), signal.SIGTERM)
    assert code == 143 and "other raised" in out
    assert 2.5 <= seconds < 20
    code, seconds, out, _ = stop(start("foreign", grace_s=60), signal.SIGTERM, signal.SIGTERM)
    assert code == 143 and seconds < 15
