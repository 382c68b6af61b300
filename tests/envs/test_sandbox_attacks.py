"""Adversarial programs against the sandbox: each must end in the right verdict with the host unharmed, no
process left behind and no temporary directory left over.

Every attack runs twice where it matters: with all layers, and with the in-process audit hook left out
(`audit_hook=False`), which shows that the kernel layers (unprivileged uid, namespaces, Landlock, rlimits,
process-group kill) hold on their own. Timeouts are short so the whole file stays fast on a 2-core CPU.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import textwrap
import time
from pathlib import Path

import pytest

from lopd_core.envs.sandbox import SandboxLimits, run_job

FAST = SandboxLimits(
    timeout_s=1.5, cpu_s=1.5, memory_mb=256, max_processes=8, max_file_mb=1.0, max_open_files=32, max_output_bytes=4096
)
LAYERS = [pytest.param(True, id="all-layers"), pytest.param(False, id="kernel-layers-only")]


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline:
            found.append(int(entry))
    return found


def run(source: str, audit_hook: bool = True, limits: SandboxLimits = FAST):
    result = run_job({"mode": "program", "source": textwrap.dedent(source)}, limits, audit_hook=audit_hook)
    assert result.workdir and not Path(result.workdir).exists(), "temporary directory left over"
    assert processes_mentioning(result.workdir) == [], "process left behind"
    return result


def assert_not_ok(result):
    assert result.status != "ok", result.to_dict()


# ----------------------------------------------------------------- runaway code
@pytest.mark.parametrize(
    "source",
    [
        "while True: pass",
        "import time\ntime.sleep(30)",
        (
            "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
            "signal.alarm(1)\nwhile True: pass"
        ),
    ],
    ids=["infinite-loop", "long-sleep", "ignores-sigterm-sigalrm"],
)
def test_runaway_code_times_out(source):
    started = time.perf_counter()
    result = run(source)
    assert result.status == "timeout" and result.stop_reason in ("wall_clock", "cpu_limit")
    assert time.perf_counter() - started < FAST.timeout_s + 2


def test_cpu_limit_stops_a_spinner_before_a_long_deadline():
    limits = SandboxLimits(timeout_s=8, cpu_s=1, memory_mb=256)
    result = run("while True: pass", limits=limits)
    assert result.status == "timeout" and result.stop_reason == "cpu_limit"
    assert result.duration_s < 5


# ----------------------------------------------------------------- resource exhaustion
@pytest.mark.parametrize("audit_hook", LAYERS)
def test_memory_bombs(audit_hook):
    result = run("x = bytearray(2 * 1024 ** 3)", audit_hook)
    assert result.status == "error" and result.stop_reason == "memory_limit"
    result = run("x = []\nwhile True: x.append(' ' * 10 ** 6)", audit_hook)
    assert_not_ok(result)
    assert result.stop_reason in ("memory_limit", "wall_clock", "cpu_limit")


@pytest.mark.parametrize("audit_hook", LAYERS)
def test_fork_bomb(audit_hook):
    result = run(
        """
        import os
        while True:
            try:
                os.fork()
            except BlockingIOError:
                pass
    """,
        audit_hook,
    )
    assert_not_ok(result)
    if audit_hook:
        assert result.error == "PermissionError: sandbox: os.fork is not allowed"


def test_huge_output_is_truncated_and_stopped():
    result = run("while True: print('x' * 10000)")
    assert result.status == "killed" and result.stop_reason == "output_limit"
    assert len(result.stdout) <= FAST.max_output_bytes and result.stdout_truncated


@pytest.mark.parametrize(
    "source",
    [
        "def f(n):\n    return f(n + 1)\nf(0)",
        "import sys\nsys.setrecursionlimit(10 ** 8)\ndef f(n):\n    return f(n + 1)\nf(0)",
    ],
    ids=["recursion-error", "unlimited-recursion"],
)
def test_deep_recursion(source):
    assert_not_ok(run(source))


@pytest.mark.parametrize("audit_hook", LAYERS)
def test_big_file_hits_the_file_size_limit(audit_hook):
    result = run("open('big', 'wb').write(b'x' * (8 * 1024 * 1024))", audit_hook)
    assert_not_ok(result)


# ----------------------------------------------------------------- the host's files
@pytest.mark.parametrize("audit_hook", LAYERS)
def test_writing_outside_the_private_directory(tmp_path, audit_hook):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.chmod(tmp_path, 0o777)  # even a world-writable directory stays out of reach
    os.chmod(victim, 0o666)
    target = tmp_path / "planted.txt"
    result = run(
        f"""
        import os
        for attempt in (lambda: open({str(target)!r}, 'w').write('x'),
                        lambda: open({str(victim)!r}, 'a').write('x'),
                        lambda: os.remove({str(victim)!r}),
                        lambda: os.rename({str(victim)!r}, 'stolen'),
                        lambda: open('/tmp/lopd-sandbox-planted', 'w').write('x')):
            try:
                attempt()
                print('ESCAPED')
            except OSError:
                pass
    """,
        audit_hook,
    )
    assert "ESCAPED" not in result.stdout
    assert victim.read_text() == "keep me" and not target.exists()
    assert not Path("/tmp/lopd-sandbox-planted").exists()


@pytest.mark.parametrize("audit_hook", LAYERS)
def test_reading_files_and_environment_it_has_no_business_reading(tmp_path, monkeypatch, audit_hook):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET-FILE")
    os.chmod(tmp_path, 0o755)
    os.chmod(secret, 0o644)  # world-readable: only the sandbox stands in the way
    monkeypatch.setenv("LOPD_TEST_SECRET", "TOPSECRET-ENV")
    result = run(
        f"""
        import os
        print(dict(os.environ))
        for path in ({str(secret)!r}, '/etc/passwd', '/proc/1/environ', '/proc/%d/environ' % os.getppid()):
            try:
                print(open(path).read())
            except OSError:
                pass
    """,
        audit_hook,
    )
    assert "TOPSECRET" not in result.stdout + result.stderr
    assert "root:" not in result.stdout


# ----------------------------------------------------------------- network
@pytest.mark.parametrize("audit_hook", LAYERS)
def test_no_network(audit_hook):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    try:
        result = run(
            f"""
            import socket
            for target in (('127.0.0.1', {port}), ('1.1.1.1', 53)):
                try:
                    socket.create_connection(target, timeout=0.5)
                    print('CONNECTED')
                except OSError:
                    pass
        """,
            audit_hook,
        )
        assert "CONNECTED" not in result.stdout
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


# ----------------------------------------------------------------- the parent and other processes
@pytest.mark.parametrize("audit_hook", LAYERS)
def test_signalling_the_parent(audit_hook):
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(True))
    try:
        result = run(
            f"""
            import os, signal
            for attempt in (lambda: os.kill({os.getpid()}, signal.SIGUSR1),
                            lambda: os.killpg(os.getpgid({os.getpid()}), signal.SIGUSR1),
                            lambda: os.kill(-1, signal.SIGUSR1)):
                try:
                    attempt()
                except OSError:
                    pass
        """,
            audit_hook,
        )
        time.sleep(0.1)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == [], result.to_dict()


ESCAPE = """
    import os, time
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()  # a new session: out of the run's process group, which the parent kills
        if os.fork() == 0:  # double fork: re-parented, no longer anyone's child in the run
            os.write(w, str(os.getpgid(0)).encode())
            time.sleep(60)
        os._exit(0)
    os.close(w)
    print("escaped" if int(os.read(r, 64)) != os.getpgid(0) else "same group", flush=True)
"""


@pytest.mark.parametrize("audit_hook", LAYERS)
@pytest.mark.parametrize("ending", ["", "while True: pass"], ids=["run-ends", "run-is-killed"])
def test_a_setsid_double_fork_does_not_outlive_the_run(audit_hook, ending):
    """The grandchild really leaves the process group (kernel layers only: the audit hook refuses fork), and
    still dies with the run — whether the run ends by itself or is killed at the deadline (`run` checks that
    no process is left)."""
    # A longer deadline than FAST's: on a loaded machine the child must get as far as printing before the kill.
    # Still far below the grandchild's 60 s sleep, so the timing check below proves nobody waited for it.
    limits = dataclasses.replace(FAST, timeout_s=6.0, cpu_s=6.0)
    started = time.perf_counter()
    result = run(textwrap.dedent(ESCAPE) + ending, audit_hook, limits)
    if audit_hook:
        assert result.error == "PermissionError: sandbox: os.fork is not allowed"
        return
    if not result.isolation.get("pidns"):
        pytest.skip(f"no pid namespace here ({result.isolation.get('why')}); only the audit hook stops this")
    assert result.stdout == "escaped\n", result.to_dict()
    assert result.status == ("ok" if not ending else "timeout"), result.to_dict()
    assert time.perf_counter() - started < limits.timeout_s + 20  # nobody waited for the 60 s sleeper


@pytest.mark.parametrize("audit_hook", LAYERS)
def test_ctypes_subprocess_and_posix_calls(tmp_path, audit_hook):
    os.chmod(tmp_path, 0o777)
    marker = tmp_path / "ran"
    result = run(
        f"""
        attempts = [
            "import ctypes; ctypes.CDLL(None).system(b'touch {marker}')",
            "import subprocess; subprocess.run(['touch', '{marker}'])",
            "import posix; posix.system('touch {marker}')",
            "import os; os.execv('/bin/sh', ['sh', '-c', 'touch {marker}'])",
            "import os; os.posix_spawn('/bin/touch', ['touch', '{marker}'], {{}})",
        ]
        for code in attempts:
            try:
                exec(code)
            except Exception:
                pass
    """,
        audit_hook,
    )
    time.sleep(0.1)
    assert not marker.exists(), result.to_dict()


def test_reloading_modules_does_not_bring_back_blocked_functions(tmp_path):
    os.chmod(tmp_path, 0o777)
    marker = tmp_path / "ran"
    result = run(f"""
        import importlib, os, sys
        importlib.reload(os)
        del sys.modules['os']
        import os as fresh_os
        for fn in (os.system, fresh_os.system):
            try:
                fn('touch {marker}')
            except PermissionError:
                print('blocked')
        try:
            import ctypes
        except PermissionError:
            print('blocked')
    """)
    assert result.stdout.count("blocked") == 3, result.to_dict()
    assert not marker.exists()


def test_the_audit_hook_cannot_be_found_or_patched():
    result = run("""
        import gc
        try:
            gc.get_objects()
            print('FOUND')
        except PermissionError:
            pass
        def f():
            pass
        try:
            f.__code__ = (lambda: 1).__code__
            print('PATCHED')
        except PermissionError:
            pass
    """)
    assert "FOUND" not in result.stdout and "PATCHED" not in result.stdout


def test_exit_tricks_are_not_success():
    for source in ("import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise KeyboardInterrupt"):
        assert_not_ok(run(source))


def test_a_normal_program_runs():
    result = run("import math\nprint(math.factorial(5))")
    assert result.status == "ok" and result.stdout == "120\n"
