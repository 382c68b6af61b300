"""The codegen oracle: the family's reference solution as the action, for demonstrations and checks.

`oracle_action(task)` is the text a perfect policy answers with on its first attempt (a standalone function
definition, no prose, no fences). `run_codegen_oracle(task)` plays it through a fresh environment, which runs
it in the sandbox like any other answer, and returns (actions, step results, env) — the same shape as
toolworld's `run_oracle`, so a demonstration builder can treat both environments alike.
"""

from __future__ import annotations

from lopd_core.envs.base import StepResult, Task

from .env import CodegenEnv


def oracle_action(task: Task) -> str:
    if task.env != "codegen":
        raise ValueError(f"task {task.task_id} is not a codegen task")
    return task.spec["reference"]


def run_codegen_oracle(task: Task) -> tuple[list[str], list[StepResult], CodegenEnv]:
    env = CodegenEnv()
    env.reset(task)
    action = oracle_action(task)
    return [action], [env.step(action)], env
