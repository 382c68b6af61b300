"""LOPD environments: the shared contract, the built-in ``toolworld`` environment and ``codegen``.

toolworld is a family of small stateful tool domains (bank, calendar, shop, files, msg,
travel) under four worlds whose conventions differ; tasks come from templates with data
checks and a scripted oracle. See base.py for the contract every environment implements and
contract.py for the checker that enforces it.
"""

from __future__ import annotations

from .base import SPLITS, Environment, FirstObservation, StepResult, Task
from .codegen import CodegenEnv
from .contract import check_env_contract
from .domains import DOMAINS, tool_schemas
from .oracle import OraclePolicy, oracle_actions, run_oracle
from .splits import make_tasks
from .templates import TEMPLATES
from .tools import format_call, parse_action
from .toolworld import ToolWorldEnv
from .worlds import KNOBS, WORLDS

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
