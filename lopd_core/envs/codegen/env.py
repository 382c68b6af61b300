"""The codegen Environment: the policy writes a Python function, the sandbox runs it, feedback comes back.

One instance plays one episode of up to `task.max_turns` attempts. Each action is an answer: its code (the
first fenced block, else the whole text) is graded on every test of the task. All tests passing ends the
episode with reward 1; otherwise the observation names the first failing test and what went wrong, and the
next attempt may fix it. The last attempt's fraction of tests passed is the reward (DESIGN §3: r(τ) is the
fraction of the task's checks passed). An empty action gives up at once (the rollout engine closes a
trajectory that outgrew its context that way).
"""

from __future__ import annotations

from lopd_core.envs.base import FirstObservation, StepResult, Task

from .grading import CODEGEN_LIMITS, extract_code, grade

SYSTEM_PROMPT = (
    "Write the Python function the user asks for. Reply with the code only. After a failed "
    "attempt you see the first failing test: reply with the whole corrected function."
)


class CodegenEnv:
    name = "codegen"

    def __init__(self, limits=CODEGEN_LIMITS) -> None:
        self._limits = limits
        self._task: Task | None = None
        self._turns = 0
        self._done = False
        self._episode: list[dict] = []

    def reset(self, task: Task) -> FirstObservation:
        if self._task is not None:
            raise RuntimeError("CodegenEnv is single-use: create a new instance per episode")
        if task.env != self.name:
            raise ValueError(f"task {task.task_id} is for env {task.env!r}, not {self.name!r}")
        self._task = task
        return FirstObservation(system=SYSTEM_PROMPT, user=task.instruction)

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("step() before reset()")
        if self._done:
            raise RuntimeError("episode is over: step() after done")
        self._turns += 1
        spec = self._task.spec
        result = grade(extract_code(action), spec["function"], spec["tests"], self._limits)
        if result.passed == result.total or not action.strip():
            return self._finish(action, result, "answer")
        if self._turns >= self._task.max_turns:
            return self._finish(action, result, "turn_limit")
        self._record(action, result.feedback, result.failure)
        return StepResult(
            observation=result.feedback, reward=0.0, done=False, info={"error": result.failure, "call": None}
        )

    @property
    def episode(self) -> list[dict]:
        return [dict(e) for e in self._episode]

    @property
    def done(self) -> bool:
        return self._done

    def _record(self, action: str, observation: str, error: str | None) -> None:
        self._episode.append({"action": action, "call": None, "observation": observation, "error": error})

    def _finish(self, action: str, result, stop_reason: str) -> StepResult:
        self._record(action, result.feedback, result.failure)
        self._done = True
        info = {
            "success": result.total > 0 and result.passed == result.total,
            "stop_reason": stop_reason,
            "checks_passed": result.passed,
            "checks_total": result.total,
            "error": result.failure,
            "call": None,
        }
        reward = result.passed / result.total if result.total else 0.0
        return StepResult(observation=result.feedback, reward=float(reward), done=True, info=info)
