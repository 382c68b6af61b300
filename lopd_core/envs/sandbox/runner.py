"""Run untrusted Python (model-written code) in a fresh, isolated, resource-limited subprocess.

This is a security boundary: the only place model output is executed. The parent never `exec`s or `eval`s it
and never trusts an object it produced — the child serializes results to JSON (builtin values only) and the
parent compares those (`same_value`).

Protects against, per run:
  * runaway code: a wall-clock deadline kills the whole process group (SIGKILL, which cannot be ignored);
    RLIMIT_CPU stops CPU spinning even if the parent stalls; infinite loops, long sleeps, ignored
    SIGALRM/SIGTERM all end as `timeout`.
  * resource exhaustion: RLIMIT_AS (memory bombs -> MemoryError), RLIMIT_NPROC plus the audit hook (fork
    bombs), RLIMIT_FSIZE and RLIMIT_NOFILE (huge files, descriptor leaks), output read through a bounded
    buffer and the run killed past `max_output_bytes * 8` (huge output), no core dumps.
  * the host and other processes: a private temporary directory (cwd, HOME, TMPDIR) removed afterwards;
    Landlock confines file access to that directory plus read-only standard library, with no execve;
    root drops to an unprivileged uid; signals to processes outside the sandbox are refused (Landlock scope
    and the audit hook); a new session and process group, every member killed when the run ends; a new pid
    namespace under a trusted init, so a descendant that left the group (setsid after a double fork) dies
    with the namespace all the same (guard.enter_pid_namespace).
  * the network: a new network namespace (nothing but a downed loopback) where user namespaces are allowed;
    Landlock ABI >= 4 also refuses TCP connect/bind; the audit hook refuses every socket operation.
  * secrets: the environment is replaced by a minimal one (PATH, HOME, TMPDIR, LANG); Python runs isolated
    (-I: no PYTHON* variables, no user site) and without site-packages (-S).
  * lying results: only JSON crosses back; `==`, `repr` and `__eq__` of returned objects never run in the parent.

Does NOT protect against (use a VM or gVisor for hostile multi-tenant use):
  * kernel exploits and CPython memory-corruption bugs (there is no seccomp filter);
  * timing and other side channels; reading world-readable files where Landlock is unavailable;
  * filling the disk with many files each under RLIMIT_FSIZE until the deadline;
  * code that forges the harness's own report from inside the child (it shares the child's process). For the
    codegen environment this buys nothing: expected outputs never enter the child. HumanEval's test code carries
    its expected values, as in the reference harness.
  * where user namespaces are refused, network isolation rests on Landlock (TCP only) and the audit hook, and
    RLIMIT_NPROC counts all processes of the uid (offset by those it already has), and only the audit hook
    (which refuses fork) keeps a process from leaving the group with setsid() and outliving the run.
Each result says which layers the run actually had (`SandboxResult.isolation`).

Usage:
    result = run_program(source, SandboxLimits(timeout_s=2))
    result = run_calls(source, "add", [[1, 2], [3, 4]])       # result.calls[i] = {"value": ...} | {"error": ...}
    with SandboxPool(workers=4) as pool: results = pool.map_calls(jobs)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .supervise import read_report, supervise

CHILD_SCRIPT = Path(__file__).with_name("child.py")
STATUSES = ("ok", "error", "timeout", "killed")
UNPRIVILEGED_ID = 65534  # "nobody": the uid/gid a root parent's children run as


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0  # wall clock for the whole run
    cpu_s: float = 5.0  # CPU seconds (RLIMIT_CPU, rounded up)
    memory_mb: int = 512  # address space (RLIMIT_AS)
    max_processes: int = 8  # RLIMIT_NPROC within the run's user namespace
    max_file_mb: float = 16.0  # RLIMIT_FSIZE
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 65536  # kept per stream; the run is killed past 8x this in total

    def as_child_limits(self) -> dict:
        return {
            "cpu_s": min(self.cpu_s, self.timeout_s + 1),
            "memory_mb": self.memory_mb,
            "max_processes": self.max_processes,
            "max_file_mb": self.max_file_mb,
            "max_open_files": self.max_open_files,
        }


@dataclass
class SandboxResult:
    status: str  # ok | error | timeout | killed
    stop_reason: str  # exited | wall_clock | cpu_limit | memory_limit | output_limit | signal:NAME | setup_failed
    returncode: int | None
    duration_s: float
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    error: str | None = None  # what stopped the code (an exception as "Type: message"), if it said
    calls: list[dict] = field(default_factory=list)  # mode "calls": per input {"value": v} | {"error": e}
    isolation: dict = field(default_factory=dict)  # layers this run actually had
    workdir: str = ""  # the private directory (already removed)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _scrubbed_env(workdir: str) -> dict:
    return {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def _remove_tree(path: str) -> None:
    def make_writable(func, target, _exc):  # the code may have chmod-ed things read-only
        try:
            os.chmod(os.path.dirname(target) or target, 0o700)
            os.chmod(target, 0o700)
        except OSError:
            pass
        func(target)

    shutil.rmtree(path, onerror=make_writable)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _wait_group_gone(pgid: int, limit_s: float = 2.0) -> None:
    """SIGKILL is asynchronous: return once no member of the group is left (or after `limit_s`)."""
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.005)


def _verdict(returncode: int, stop: str | None, report: dict, cpu_s: float, used_cpu_s: float) -> tuple[str, str]:
    if report.get("setup_error"):
        return "error", "setup_failed"
    if stop == "wall_clock":
        return "timeout", "wall_clock"
    if stop == "output_limit":
        return "killed", "output_limit"
    if returncode < 0:
        sig = -returncode
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and used_cpu_s >= cpu_s - 0.05):
            return "timeout", "cpu_limit"
        return (
            "killed",
            f"signal:{signal.Signals(sig).name}" if sig in signal.Signals._value2member_map_ else f"signal:{sig}",
        )
    error = report.get("error") or ""
    if error.startswith("MemoryError"):
        return "error", "memory_limit"
    if returncode == 0 and report.get("done") and not error:
        return "ok", "exited"
    return "error", "exited"


def run_job(job: dict, limits: SandboxLimits = SandboxLimits(), *, audit_hook: bool = True) -> SandboxResult:
    """Run one job (see child.py for its shape) in a fresh child; always cleans up after itself.

    `audit_hook=False` leaves out the in-process layer: only tests use it, to show the kernel layers hold alone.
    """
    workdir = tempfile.mkdtemp(prefix="lopd-sandbox-")
    is_root = os.geteuid() == 0
    job = {
        **job,
        "limits": limits.as_child_limits(),
        "uid": UNPRIVILEGED_ID,
        "gid": UNPRIVILEGED_ID,
        "audit_hook": audit_hook,
    }
    proc = None
    started = time.perf_counter()
    try:
        proc = _spawn(workdir, job, is_root)
        io = supervise(
            proc,
            deadline=started + limits.timeout_s,
            keep_bytes=limits.max_output_bytes,
            kill_after_bytes=8 * limits.max_output_bytes,
        )
        if io.stop is not None:
            _kill_group(proc.pid)
        returncode, used_cpu_s = _reap(proc)
        duration = time.perf_counter() - started
        report = read_report(Path(workdir, "report.jsonl"), n_calls=len(job.get("inputs", ())))
        status, stop_reason = _verdict(returncode, io.stop, report, limits.as_child_limits()["cpu_s"], used_cpu_s)
        return SandboxResult(
            status=status,
            stop_reason=stop_reason,
            returncode=returncode,
            duration_s=round(duration, 4),
            stdout=io.stdout,
            stderr=io.stderr,
            stdout_truncated=io.stdout_truncated,
            stderr_truncated=io.stderr_truncated,
            error=report.get("setup_error") or report.get("error"),
            calls=report["calls"],
            isolation=report.get("isolation", {}),
            workdir=workdir,
        )
    finally:
        _clean_up(proc, workdir)


def _spawn(workdir: str, job: dict, is_root: bool) -> subprocess.Popen:
    """The child in its own session, isolated interpreter and scrubbed environment, reading the job from
    `workdir`."""
    Path(workdir, "job.json").write_text(json.dumps(job))
    if is_root:  # the child reads the job as root, then works in the directory as the unprivileged uid
        os.chown(workdir, UNPRIVILEGED_ID, UNPRIVILEGED_ID)
    return subprocess.Popen(
        [sys.executable, "-I", "-S", "-u", str(CHILD_SCRIPT), workdir],
        cwd=workdir,
        env=_scrubbed_env(workdir),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )


def _reap(proc: subprocess.Popen) -> tuple[int, float]:
    """Wait for the child, kill whatever its group left, and return its exit code and CPU seconds."""
    # Wait without reaping: while the leader is a zombie its pid, hence the group id, cannot be reused, so
    # killing the group afterwards cannot hit an unrelated process.
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    _kill_group(proc.pid)
    _, wait_status, usage = os.wait4(proc.pid, 0)
    returncode = proc.returncode = os.waitstatus_to_exitcode(wait_status)
    _wait_group_gone(proc.pid)
    return returncode, usage.ru_utime + usage.ru_stime


def _clean_up(proc: subprocess.Popen | None, workdir: str) -> None:
    """Whatever happened: no child left running, its pipes closed, its directory gone."""
    if proc is not None and proc.returncode is None:
        _kill_group(proc.pid)
        proc.kill()
        proc.wait()
    if proc is not None:
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    _remove_tree(workdir)


def run_program(source: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run a whole program; status "ok" iff it ran to its end without an exception."""
    return run_job({"mode": "program", "source": source}, limits)


def run_calls(source: str, function: str, inputs: list[list], limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Define `function` with `source`, call it on each argument list; results in `result.calls`."""
    return run_job({"mode": "calls", "source": source, "function": function, "inputs": inputs}, limits)


class SandboxPool:
    """Many runs in parallel: threads that each wait on their own child process (the work is in the children)."""

    def __init__(self, workers: int = 2):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")

    def map_jobs(self, jobs: list[dict], limits: SandboxLimits = SandboxLimits()) -> list[SandboxResult]:
        return list(self._executor.map(lambda job: run_job(job, limits), jobs))

    def map_programs(self, sources: list[str], limits: SandboxLimits = SandboxLimits()) -> list[SandboxResult]:
        return self.map_jobs([{"mode": "program", "source": s} for s in sources], limits)

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
