"""A plugin environment whose `reset` and `step` run in a child process behind the sandbox (`envs.isolate_tools`).

One child per environment instance, so per episode (instances are single-use): started at `reset`, ended when
the episode is done (or the instance is dropped). The child (sandbox/env_child.py) imports the plugin,
constructs the environment, then applies the sandbox's layers (sandbox/runner.py says what they cover and
what they do not) and serves JSON lines; this side never unpickles or evaluates what comes back, and reads
every reply within `envs.step_timeout_s` and a size bound. A step past the timeout, or a child that dies,
kills the child's whole process group and raises `EnvironmentStepFailed` naming the env and the task.

Why per episode and not one child for many: the environment's module-level state (a tool's cache, a counter)
then dies with the episode, as the contract's single-use episodes expect, and one episode's tool calls cannot
reach another's state. What it costs per step and per episode: benchmarks/isolated_tools.py.

Seen from the caller this is an environment like any other (`name`, `reset`, `step`, `episode`,
`internal_errors`); class attributes (`tool_examples`, `max_turns`, ...) read through to the class, which the
trainer's process has imported anyway. Exceptions of `reset`/`step` come back as the same built-in type where it
is RuntimeError, ValueError or TypeError (the contract checker tells a second `reset` by its RuntimeError), as
`EnvironmentStepFailed` otherwise. `step` after done raises RuntimeError here: the child has ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

from lopd_core.errors import EnvironmentStepFailed

from .base import FirstObservation, StepResult, Task
from .guarded import step_timeout_message, warn_internal_errors
from .sandbox.runner import UNPRIVILEGED_ID, _remove_tree, _scrubbed_env

ENV_CHILD = Path(__file__).with_name("sandbox") / "env_child.py"
# The child's first reply also waits for Python to start and import the plugin and lopd_core: a loaded machine
# can take seconds for that, which is not the step's fault.
STARTUP_ALLOWANCE_S = 60.0
MAX_REPLY_BYTES = 33 * 1024 * 1024  # env_child.MAX_REPLY plus the envelope
MEMORY_MB = 1024  # address space of the child (RLIMIT_AS): the interpreter, lopd_core and one episode's state
ERRORS = {"RuntimeError": RuntimeError, "ValueError": ValueError, "TypeError": TypeError}


def _stop(proc: subprocess.Popen, workdir: str) -> None:
    """Kill the child's process group, reap it and remove its folder (also the instance's finalizer)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for stream in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError):
            stream.close()
    proc.wait()
    _remove_tree(workdir)


def child_sys_path() -> list[str]:
    """The trainer's import path as absolute folders (the child's working directory is its private folder)."""
    cwd = os.getcwd()
    return [os.path.abspath(os.path.join(cwd, p)) for p in sys.path]


class IsolatedEnv:
    def __init__(self, name: str, spec: str, cls: type, timeout_s: float):
        self._name, self._spec, self._cls, self._timeout_s = name, spec, cls, float(timeout_s)
        self._proc: subprocess.Popen | None = None
        self._finalizer = None
        self._task: Task | None = None
        self._done = False
        self._episode: list[dict] = []
        self._buffer = b""
        self._broken: str | None = None  # why the child was stopped: every later call raises the same
        self.internal_errors: list[str] = []
        self.isolation: dict = {}  # the layers the child reports it has

    @property
    def name(self) -> str:
        return self._name

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(self._cls, attr)

    # ------------------------------------------------------------------ the child
    def _start(self, task: Task) -> None:
        workdir = tempfile.mkdtemp(prefix="lopd-env-")
        if os.geteuid() == 0:  # the child works there as the unprivileged uid (runner.py)
            os.chown(workdir, UNPRIVILEGED_ID, UNPRIVILEGED_ID)
        # RLIMIT_CPU counts the child's whole life: every turn may use its timeout, plus start-up.
        limits = {
            "cpu_s": self._timeout_s * (task.max_turns + 1) + STARTUP_ALLOWANCE_S,
            "memory_mb": MEMORY_MB,
            "max_processes": 8,
            "max_file_mb": 16.0,
            "max_open_files": 64,
        }
        job = {
            "spec": self._spec,
            "name": self._name,
            "sys_path": child_sys_path(),
            "limits": limits,
            "uid": UNPRIVILEGED_ID,
            "gid": UNPRIVILEGED_ID,
            "audit_hook": True,
        }
        with open(os.path.join(workdir, "stderr.txt"), "wb") as stderr:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-u", str(ENV_CHILD), workdir],
                cwd=workdir,
                env=_scrubbed_env(workdir),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                start_new_session=True,
                close_fds=True,
            )
        self._workdir = workdir
        self._finalizer = weakref.finalize(self, _stop, self._proc, workdir)
        os.set_blocking(self._proc.stdout.fileno(), False)
        reply = self._exchange(job, "start", self._timeout_s + STARTUP_ALLOWANCE_S)
        if "setup_error" in reply:
            raise self._broke(
                f"env {self._name!r}: the isolated process could not start: {reply['setup_error']} (envs.isolate_tools)"
            )
        self.isolation = dict(reply.get("ready", {}).get("isolation", {}))

    def _close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    def _broke(self, message: str) -> EnvironmentStepFailed:
        """Stop the child for good; the error to raise now and on every later call."""
        self._close()
        self._broken = message
        return EnvironmentStepFailed(message)

    def _died(self, what: str) -> EnvironmentStepFailed:
        code = self._proc.poll() if self._proc is not None else None
        tail = ""
        try:
            tail = Path(self._workdir, "stderr.txt").read_bytes()[-300:].decode("utf-8", "replace")
            tail = " ".join(tail.split())[-200:]
        except OSError:
            pass
        self._close()
        code = self._proc.returncode if code is None else code
        how = (
            f"signal {signal.Signals(-code).name}"
            if code is not None and code < 0 and -code in signal.Signals._value2member_map_
            else f"exit status {code}"
        )
        task_id = self._task.task_id if self._task is not None else "(before reset)"
        return self._broke(
            f"env {self._name!r} task {task_id}: the isolated process ended during {what} "
            f"({how}{'; ' + tail if tail else ''}); envs.isolate_tools"
        )

    def _exchange(self, request: dict, what: str, timeout_s: float) -> dict:
        """Send one request and read one reply line within `timeout_s` (the whole exchange)."""
        if self._broken is not None:
            raise EnvironmentStepFailed(self._broken)
        deadline = time.perf_counter() + timeout_s
        data = (json.dumps(request) + "\n").encode()
        try:
            self._proc.stdin.write(data)
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died(what) from None
        fd = self._proc.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise self._broke(
                        step_timeout_message(self._name, self._task, what, timeout_s, "the isolated process was killed")
                    )
                if not selector.select(timeout=left):
                    continue
                try:
                    chunk = os.read(fd, 1 << 20)
                except BlockingIOError:
                    continue
                if not chunk:
                    raise self._died(what)
                self._buffer += chunk
                if len(self._buffer) > MAX_REPLY_BYTES:
                    raise self._broke(
                        f"env {self._name!r}: the isolated {what} replied with more than {MAX_REPLY_BYTES} bytes"
                    )
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise self._broke(f"env {self._name!r}: the isolated {what} sent a reply that is not a JSON object")
        return reply

    def _ask(self, request: dict, what: str):
        reply = self._exchange(request, what, self._timeout_s)
        if "error" in reply:
            message = str(reply["error"])
            error = ERRORS.get(reply.get("type"))
            if error is not None:
                raise error(message)
            task_id = self._task.task_id if self._task is not None else "(before reset)"
            how = "returned a value that cannot cross as JSON:" if reply.get("type") == "not_json" else "raised"
            raise EnvironmentStepFailed(f"env {self._name!r} task {task_id}: {what} {how} {message}")
        new = [str(e) for e in reply.get("internal_errors") or ()]
        if new:
            self.internal_errors.extend(new)
            warn_internal_errors(self._name, new)
        return reply

    # ------------------------------------------------------------------ contract
    def reset(self, task: Task) -> FirstObservation:
        if self._proc is None:
            self._task = task
            self._start(task)
        elif self._done:
            raise RuntimeError(f"{self._cls.__name__} is single-use: create a new instance per episode")
        value = self._ask({"op": "reset", "task": task.to_json()}, "reset")["value"]
        return FirstObservation(system=value["system"], user=value["user"], tools=tuple(value["tools"]))

    def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError("episode is over: step() after done")
        if self._proc is None:
            raise RuntimeError("step() before reset()")
        reply = self._ask({"op": "step", "action": action}, "step")
        value = reply["value"]
        result = StepResult(
            observation=value["observation"], reward=value["reward"], done=value["done"], info=value["info"]
        )
        if result.done:
            self._done = True
            self._episode = list(reply.get("episode") or [])
            self._close()
        return result

    @property
    def episode(self) -> list[dict]:
        if self._done or self._proc is None:
            return [dict(e) for e in self._episode]
        return list(self._ask({"op": "episode"}, "episode")["value"])
