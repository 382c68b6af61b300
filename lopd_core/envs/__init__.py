"""LOPD environments: the shared contract, the built-in ``toolworld`` environment and ``codegen``.

base.py is the contract every environment implements and contract.py the checker that enforces it;
tasks.py draws any environment's task sets; mix.py spreads a run's tasks over the environment mix. The
environments live in their own packages: toolworld/ (stateful tool domains under worlds with different
conventions), codegen/ (function-writing tasks graded in sandbox/, the only place model code runs).
"""

from __future__ import annotations

from .base import SPLITS, Environment, FirstObservation, StepResult, Task
from .codegen import CodegenEnv
from .contract import check_env_contract
from .tasks import make_tasks
from .toolworld import (
    DOMAINS,
    KNOBS,
    TEMPLATES,
    WORLDS,
    OraclePolicy,
    ToolWorldEnv,
    format_call,
    oracle_actions,
    parse_action,
    run_oracle,
    tool_schemas,
)

ENVS = {"toolworld": ToolWorldEnv, "codegen": CodegenEnv}


def make_env(task_or_env_name: Task | str) -> Environment:
    """A fresh, single-use environment instance for a task (or an env name)."""
    name = task_or_env_name.env if isinstance(task_or_env_name, Task) else task_or_env_name
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; known: {sorted(ENVS)}")
    return ENVS[name]()


__all__ = [
    "DOMAINS",
    "ENVS",
    "KNOBS",
    "SPLITS",
    "TEMPLATES",
    "WORLDS",
    "CodegenEnv",
    "Environment",
    "FirstObservation",
    "OraclePolicy",
    "StepResult",
    "Task",
    "ToolWorldEnv",
    "check_env_contract",
    "format_call",
    "make_env",
    "make_tasks",
    "oracle_actions",
    "parse_action",
    "run_oracle",
    "tool_schemas",
]
