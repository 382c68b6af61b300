"""Plugin environments behind a per-step timeout: in the trainer's process (here) or isolated (isolated.py,
which builds on this module's messages; registry.new_env picks one of the two).

The trust boundary. A plugin environment (registry.py) is code its author wrote, and by default it runs inside
the trainer's process: its tools get arguments the model chose, with everything the trainer may do — read any
file the user can, reach any address (127.0.0.1 included), read every environment variable (tokens, keys).
That is fine for tools you wrote or reviewed, and it is the fastest way to run them. `envs.isolate_tools: true`
runs each episode's `reset` and `step` in a child process behind the sandbox's layers instead
(isolated.py: no network, a scrubbed environment, files limited to a private folder, rlimits), so a tool the
model can talk into reading `/etc/passwd` or calling a local service cannot. Either way the class itself is
imported in the trainer's process (its tasks are drawn there), so import-time code is trusted.

Either way, every `reset` and `step` of a plugin environment gets `envs.step_timeout_s`: a step that blocks
must not hang `lopd envs check` or a cycle until `cycle.stage_timeout_s`. In the trainer's process the call runs
in a daemon thread (Python cannot stop a thread: it is left behind, the environment is marked broken, the error
raised; a plugin's step therefore cannot install signal handlers); isolated, the child's process group is killed.
The error is one line naming the env, the task and the setting (`EnvironmentStepFailed`).

Tool bugs (`internal_errors`: exceptions a declarative environment caught in a tool) are shown to the agent as
"failed"; a rollout that meets one warns once per env and tool, so a broken tool is not silently trained on.
"""

from __future__ import annotations

import threading
import warnings

from lopd_core.errors import EnvironmentStepFailed

from .base import Task

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def warn_internal_errors(env_name: str, errors: list[str]) -> None:
    """Warn once per (env, tool) for the tool bugs an episode met (an entry reads "tool_name: error")."""
    for error in errors:
        tool, _, detail = str(error).partition(":")
        with _warned_lock:
            if (env_name, tool) in _warned:
                continue
            _warned.add((env_name, tool))
        warnings.warn(
            f"env {env_name!r}: tool {tool!r} raised inside ({detail.strip()[:300]}); the agent saw "
            f"'failed'. Fix the "
            f"tool, or raise ToolError for a bad call (`lopd envs check {env_name}` calls every tool)",
            RuntimeWarning,
            stacklevel=2,
        )


def step_timeout_message(env_name: str, task: Task | None, what: str, timeout_s: float, consequence: str) -> str:
    task_id = task.task_id if task is not None else "(before reset)"
    return (
        f"env {env_name!r} task {task_id}: {what} did not return within {timeout_s:g} s "
        f"(envs.step_timeout_s); {consequence}"
    )


class TimedEnv:
    """A plugin environment in the trainer's process whose `reset` and `step` each get `timeout_s` (module
    docstring). Everything else reads through to the environment itself."""

    def __init__(self, env, name: str, timeout_s: float):
        self._env, self._name, self._timeout_s = env, name, float(timeout_s)
        self._task: Task | None = None
        self._broken: str | None = None
        self._warned_upto = 0

    @property
    def name(self) -> str:
        return self._name

    @property
    def inner(self):
        """The environment instance this wraps."""
        return self._env

    def _call(self, what: str, fn, *args):
        if self._broken is not None:
            raise EnvironmentStepFailed(self._broken)
        box: dict = {}

        def run() -> None:
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # noqa: BLE001  re-raised in the caller's thread, type and all
                box["error"] = exc

        # A daemon thread of its own per call, not a pool: a pool's threads are joined at interpreter exit, so one
        # stuck step would keep the process from ending.
        worker = threading.Thread(target=run, name=f"lopd-env-{self._name}", daemon=True)
        worker.start()
        worker.join(self._timeout_s)
        if worker.is_alive():
            self._broken = step_timeout_message(
                self._name,
                self._task,
                what,
                self._timeout_s,
                "the episode fails (its thread is left behind, the env is unusable)",
            )
            raise EnvironmentStepFailed(self._broken)
        if "error" in box:
            error = box["error"]
            if not isinstance(error, Exception):
                # SystemExit / KeyboardInterrupt raised by plugin code would otherwise end the command with the
                # plugin's exit status (0 looked like a pass): it is the environment failing, named as such.
                self._broken = f"environment {self._name!r} raised {type(error).__name__}({error}) in {what}" + (
                    f" on task {self._task.task_id}" if self._task is not None else ""
                )
                raise EnvironmentStepFailed(self._broken) from error
            raise error
        return box["value"]

    def reset(self, task: Task):
        if self._task is None:
            self._task = task
        return self._call("reset", self._env.reset, task)

    def step(self, action: str):
        result = self._call("step", self._env.step, action)
        errors = getattr(self._env, "internal_errors", None)
        if isinstance(errors, list) and len(errors) > self._warned_upto:
            warn_internal_errors(self._name, errors[self._warned_upto :])
            self._warned_upto = len(errors)
        return result

    @property
    def episode(self) -> list[dict]:
        return self._env.episode

    def __getattr__(self, attr: str):
        if attr.startswith("__") or attr in ("_env", "_name", "_timeout_s", "_task", "_broken", "_warned_upto"):
            raise AttributeError(attr)
        return getattr(self._env, attr)
